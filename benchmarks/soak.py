"""Soak: many short requests through one pipeline, watching memory, blocks and unfinished requests.

    python benchmarks/soak.py                                  # embedded model, 10,000 requests
    python benchmarks/soak.py --model small --num-requests 2000  # ~100M-parameter random Llama
    python benchmarks/soak.py --linear-backend torch            # compare: no packed linears

Requests come in waves (default 500): prompts of 1-40 random words, 1-8 new tokens, priorities 0-2,
half greedy and half sampled (temperature 0.8, top_k 50, top_p 0.95), 5% cancelled right after
submission. After each wave the engine is at rest: the script prints the wave's time, the
process's resident memory (RSS, after ``gc.collect()``), the blocks still in use (must be 0) and
the requests not finished (must be 0). A healthy run's RSS flattens after the first waves, when
every batch shape has been seen once. ``tests/test_reliability.py`` runs a short version and fails
on growth beyond a stated bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

WORDS = (
    "the of and to in is that for it as with was on be by this are or from at which an but not "
    "function module class value return list string file object type error name data method "
    "argument default number python set key call code new time line system example first"
).split()


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_soak(
    pipe,
    num_requests: int = 10_000,
    wave_size: int = 500,
    seed: int = 0,
    cancel_fraction: float = 0.05,
    max_words: int = 40,
    max_new_tokens: int = 8,
    report=None,
) -> dict:
    """Drive ``pipe`` (a ``ContinuousBatchingPipeline``) with the soak workload.

    Args:
        report: called with each wave's dict (``wave``, ``seconds``, ``rss_mb``, ``used_blocks``,
            ``unfinished``, ``errors``, ``finish_reasons``) as it ends; None prints nothing.

    Returns:
        ``{"waves": [...], "seconds": total, "rss_mb": [per wave], "unfinished": total,
        "errors": total, "used_blocks_at_rest": [per wave]}``.
    """
    rng = random.Random(seed)
    waves = []
    t_start = time.perf_counter()
    done = 0
    while done < num_requests:
        n = min(wave_size, num_requests - done)
        t0 = time.perf_counter()
        handles = []
        for _ in range(n):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
            kwargs = dict(max_new_tokens=rng.randint(1, max_new_tokens), priority=rng.randint(0, 2))
            if rng.random() < 0.5:
                kwargs.update(do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
            else:
                kwargs.update(do_sample=False)
            handles.append(pipe.submit(prompt, **kwargs))
            if rng.random() < cancel_fraction:
                handles[-1].cancel()
        reasons: dict = {}
        errors = 0
        for h in handles:
            try:
                h.result(timeout=600)
            except Exception:  # noqa: BLE001 - counted and reported, the soak goes on
                errors += 1
            for r in h.finish_reasons():
                reasons[r] = reasons.get(r, 0) + 1
        pipe.engine.wait_idle(60)
        gc.collect()
        stats = pipe.stats()
        wave = {
            "wave": len(waves),
            "requests": n,
            "seconds": time.perf_counter() - t0,
            "rss_mb": rss_mb(),
            "used_blocks": stats.num_used_blocks,
            "unfinished": sum(not h.done() for h in handles),
            "errors": errors,
            "finish_reasons": reasons,
        }
        waves.append(wave)
        done += n
        if report is not None:
            report(wave)
    return {
        "waves": waves,
        "seconds": time.perf_counter() - t_start,
        "rss_mb": [w["rss_mb"] for w in waves],
        "unfinished": sum(w["unfinished"] for w in waves),
        "errors": sum(w["errors"] for w in waves),
        "used_blocks_at_rest": [w["used_blocks"] for w in waves],
    }


def build_pipeline(args):
    from hf_contbatch import CacheConfig, EngineConfig, pipeline

    cfg = EngineConfig(cache=CacheConfig(num_blocks=args.num_blocks), linear_backend=args.linear_backend)
    if args.model == "embedded":
        return pipeline("text-generation", engine_config=cfg, dtype=args.dtype)
    sys.path.insert(0, os.path.dirname(__file__))
    from hf_contbatch import ContinuousBatchingPipeline

    from workload import MODEL_SIZES, build_model, build_tokenizer

    model = build_model(args.model)
    tok = build_tokenizer(MODEL_SIZES[args.model]["vocab_size"])
    return ContinuousBatchingPipeline(model, tok, engine_config=cfg)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="embedded",
        choices=["embedded", "tiny", "small"],
        help="embedded: the package's model; tiny/small: random Llamas of benchmarks/workload.py",
    )
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--wave-size", type=int, default=500)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "native", "onednn"])
    p.add_argument(
        "--dtype",
        default="float32",
        help="embedded model's dtype (stored as bfloat16; float32 is the CPU reference and the packed-linear path)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.model != "embedded":  # the small model's prompts are its tokenizer's words
        global WORDS
        WORDS = tuple(f"w{i}" for i in range(1, 2048))
    pipe = build_pipeline(args)
    print(
        f"model={args.model} dtype={next(pipe.model.parameters()).dtype} requests={args.num_requests} waves of {args.wave_size} num_blocks={args.num_blocks} "
        f"linear_backend={args.linear_backend} rss_at_start={rss_mb():.0f} MiB",
        flush=True,
    )

    def report(w):
        print(
            f"wave {w['wave']:3d}: {w['seconds']:6.1f} s  rss {w['rss_mb']:7.1f} MiB  blocks in use {w['used_blocks']}"
            f"  unfinished {w['unfinished']}  errors {w['errors']}  {w['finish_reasons']}",
            flush=True,
        )

    try:
        res = run_soak(pipe, args.num_requests, args.wave_size, seed=args.seed, report=report)
    finally:
        pipe.close()
    rss = res["rss_mb"]
    print(
        f"total {res['seconds']:.0f} s; RSS first wave {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB, max {max(rss):.0f} MiB; "
        f"blocks in use at rest max {max(res['used_blocks_at_rest'])}; unfinished {res['unfinished']}; errors {res['errors']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **res}, f, indent=1)
    return res


if __name__ == "__main__":
    main()
