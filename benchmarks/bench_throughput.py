"""Throughput on the standard mixed workload: transformers' pipeline vs transformers' continuous
batching vs hf_contbatch, in one run, with ratios.

    python benchmarks/bench_throughput.py --model tiny            # all three engines
    python benchmarks/bench_throughput.py --model small --engines generate_batch,ours

Throughput = generated tokens (the ones asked for) / wall time of the whole workload, model build
excluded. Each engine runs in its own fresh process, one after another (an engine's leftover worker
threads would otherwise slow the next one), on the same seeded model and workload; each gets a
warm-up request first. Greedy outputs are compared token for token and the agreement printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workload import build_model, build_tokenizer, make_workload, run_in_own_process, run_ours, run_transformers_cb  # noqa: E402


def run_pipeline(model, tok, prompts, new_tokens, batch_size=16):
    """(a) transformers.pipeline("text-generation"), static batches of 16 in arrival order; each
    batch runs to its longest max_new_tokens (one max_new_tokens per call, as the pipeline allows)."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    texts = [tok.decode(p) for p in prompts]
    pipe(texts[0], max_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        n = max(new_tokens[i : i + batch_size])
        pipe(chunk, max_new_tokens=n, do_sample=False, batch_size=batch_size, return_full_text=False)
    wall = time.perf_counter() - t0
    return wall, None


def run_generate_batch(model, prompts, new_tokens, num_blocks=512, block_size=64, max_batch_tokens=1024):
    """(b) transformers' own continuous batching, per-request max_new_tokens, fair CPU settings
    (sdpa, page 64, 512 blocks, 1024 batch tokens: its defaults reserve ~14 GB here and run slower)."""
    return run_transformers_cb(model, prompts, new_tokens, num_blocks, block_size, max_batch_tokens)


def run_ours_configured(model, prompts, new_tokens, args):
    """(c) hf_contbatch, every request submitted at once with its own max_new_tokens."""
    from hf_contbatch import CacheConfig, EngineConfig, SchedulerConfig

    cfg = EngineConfig(
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        compile_model=args.compile,
    )
    return run_ours(model, prompts, new_tokens, cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--engines", default="pipeline,generate_batch,ours")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "native", "onednn"])
    ap.add_argument(
        "--compile", action="store_true", help="ours with EngineConfig(compile_model=True) (compiled before timing)"
    )
    ap.add_argument("--cooldown", type=float, default=15.0, help="idle seconds before each engine")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: run one engine, write here
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.model)
    vocab = model.config.vocab_size
    prompts, new_tokens = make_workload(args.requests, vocab, args.seed)
    asked = sum(new_tokens)
    print(
        f"workload: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, "
        f"new tokens asked {asked}; model {args.model}, torch threads {torch.get_num_threads()}"
    )
    results = {}
    outputs = {}
    engines = args.engines.split(",")
    if args.single:
        name = engines[0]
        if name == "pipeline":
            wall, outs = run_pipeline(model, build_tokenizer(vocab), prompts, new_tokens)
        elif name == "generate_batch":
            wall, outs = run_generate_batch(model, prompts, new_tokens)
        elif name == "ours":
            wall, outs, stats = run_ours_configured(model, prompts, new_tokens, args)
            results["ours_stats"] = {"preemptions": stats.num_preemptions, "peak_used_blocks": stats.peak_used_blocks}
        else:
            raise SystemExit(f"unknown engine {name!r}; choose from pipeline, generate_batch, ours")
        results[name] = {"seconds": round(wall, 3), "tokens_per_s": round(asked / wall, 1)}
        with open(args.single, "w") as f:
            json.dump({"results": results, "outputs": outs}, f)
        return 0
    for name in engines:
        child = run_in_own_process(__file__, name, argv if argv is not None else sys.argv[1:], args.cooldown)
        results.update(child["results"])
        if child["outputs"] is not None:
            outputs[name] = child["outputs"]
        r = results[name]
        print(f"{name:>15}: {r['seconds']:7.2f} s  {r['tokens_per_s']:8.1f} tok/s", flush=True)
    if "ours" in results:
        for base in ("pipeline", "generate_batch"):
            if base in results:
                ratio = results[base]["seconds"] / results["ours"]["seconds"]
                results[f"ours_vs_{base}"] = round(ratio, 2)
                print(f"ours / {base}: {ratio:.2f}x")
    if "ours" in outputs and "generate_batch" in outputs:
        same = sum(a == b for a, b in zip(outputs["ours"], outputs["generate_batch"]))
        results["identical_greedy_vs_generate_batch"] = f"{same}/{len(prompts)}"
        print(f"identical greedy outputs (ours vs generate_batch): {same}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
