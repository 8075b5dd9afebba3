"""One engine, the same workload repeated with new prompts: per-repeat walls and what else happened
in each (issue 47, item 4: "why did the third repeat take 1.7x the first two?").

    python benchmarks/bench_repeats.py --model small --repeats 5
    python benchmarks/bench_repeats.py --model medium --requests 1 --repeats 7 --dtype bfloat16

The protocol is the peers' (``../shared/peers/bench_ours.py``): one engine, one warm-up request,
then every repeat submits all requests at once and waits for them. Each repeat keeps the workload's
prompt lengths and ``max_new_tokens`` but draws new token ids (no prefix-cache hits across repeats,
same work every repeat). Printed per repeat: wall, tok/s, our CPU share, the machine's steal and
other processes' CPU, involuntary context switches, engine iterations, preemptions, swapped blocks,
prefix-cache evictions and kernel timing (``run_evidence.RepeatEvidence``), then
``run_evidence.explain`` for every repeat more than 15% slower than the median.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_evidence import RepeatEvidence, explain  # noqa: E402

from workload import build_model, workload_for  # noqa: E402


def fresh_ids(prompts: list[list[int]], vocab_size: int, seed: int) -> list[list[int]]:
    """``prompts`` with new token ids of the same lengths (seed 0 keeps them as they are)."""
    if seed == 0:
        return prompts
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in p] for p in prompts]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="tiny, small, medium, or a saved model's path")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--requests", type=int, default=None, help="default: the model's standard workload")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quantization", default=None, help="EngineConfig(quantization=...), e.g. int8")
    ap.add_argument("--kv-dtype", default=None, help="CacheConfig(dtype=...), e.g. int8")
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="CacheConfig(enable_prefix_caching=False): does a slowdown follow the prefix cache's evictions?",
    )
    ap.add_argument("--json", default=None, help="write the per-repeat figures here")
    args = ap.parse_args(argv)

    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(args.threads)
    model = build_model(args.model, dtype=getattr(torch, args.dtype))
    prompts, new_tokens = workload_for(args.model, model.config.vocab_size, 0, args.requests)
    cfg = EngineConfig(**({"quantization": args.quantization} if args.quantization else {}))
    if args.kv_dtype or args.no_prefix_caching:
        cfg.cache = CacheConfig(dtype=args.kv_dtype, enable_prefix_caching=not args.no_prefix_caching)
    engine = LLMEngine(model, cfg)
    repeats = []
    try:
        engine.submit([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)).result()
        for r in range(args.repeats):
            ev = RepeatEvidence(args.threads)
            ev.begin(engine)
            hs = [
                engine.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                for p, n in zip(fresh_ids(prompts, model.config.vocab_size, r + 1), new_tokens)
            ]
            [h.result() for h in hs]
            rec = ev.end(engine)
            rec["tok_per_s"] = sum(new_tokens) / rec["wall_s"]
            repeats.append(rec)
    finally:
        engine.close()

    print(f"{args.model} {args.dtype}, {len(prompts)} requests, {args.threads} threads, {sum(new_tokens)} new tokens")
    cols = {
        "wall_s": "wall s",
        "tok_per_s": "tok/s",
        "cpu_share": "our CPU",
        "steal_s": "steal s",
        "others_cpu_s": "others s",
        "involuntary_switches": "inv. sw.",
        "iterations": "steps",
        "preemptions": "preempt",
        "blocks_swapped_out": "swapped",
        "prefix_evictions": "evicted",
        "tuning_s": "timing s",
    }
    print(" ".join(f"{c:>9}" for c in ["repeat", *cols.values()]))
    for i, rec in enumerate(repeats):
        cells = [f"{rec[c]:.3g}" if isinstance(rec.get(c), float) else str(rec.get(c)) for c in cols]
        print(" ".join(f"{c:>9}" for c in [str(i), *cells]))
    for line in explain(repeats) or ["every repeat within 15% of the median wall"]:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(repeats, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
