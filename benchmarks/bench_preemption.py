"""Preemption under memory pressure: recompute vs swap vs auto, against transformers' continuous
batching with the same KV pool, on the standard mixed workload (benchmarks/workload.py).

    python benchmarks/bench_preemption.py                      # tiny model, 128 blocks of 16 tokens
    python benchmarks/bench_preemption.py --num-blocks 96 --engines ours

The pool (default 128 blocks x 16 = 2,048 tokens of KV) is far below what 64 requests of up to
256 + 256 tokens want at once, so every engine has to preempt or queue. transformers gets the same
pool through ``ContinuousBatchingConfig(num_blocks=..., page_size=block_size, max_batch_tokens=...)``
(``num_blocks`` counts whole-model blocks of ``page_size`` tokens, as ours does), driven through the
manager that ``model.generate_batch`` wraps, because only the manager takes a max_new_tokens per
request. Throughput = generated tokens asked for / wall time of the whole workload, model build and a
warm-up request excluded; each engine runs in its own fresh process, one after another. A "roomy" run of ours
(no preemption) shows what preemption costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workload import build_model, make_workload, run_in_own_process, run_ours, run_transformers_cb  # noqa: E402


def run_transformers(model, prompts, new_tokens, num_blocks, block_size, max_batch_tokens):
    wall, outs = run_transformers_cb(model, prompts, new_tokens, num_blocks, block_size, max_batch_tokens)
    return wall, outs, {}


def run_ours_mode(model, prompts, new_tokens, mode, num_blocks, args):
    from hf_contbatch import CacheConfig, EngineConfig, SchedulerConfig

    cfg = EngineConfig(
        cache=CacheConfig(block_size=args.block_size, num_blocks=num_blocks, swap_space_gib=args.swap_space_gib),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batch_tokens, preemption_mode=mode
        ),
        num_threads=args.threads,
    )
    wall, outs, s = run_ours(model, prompts, new_tokens, cfg)
    info = {
        "preemptions_swap": s.num_preemptions_swap,
        "preemptions_recompute": s.num_preemptions_recompute,
        "blocks_swapped_out": s.num_blocks_swapped_out,
        "swap_seconds": round(s.swap_seconds, 3),
        "peak_used_blocks": s.peak_used_blocks,
        "iterations": s.num_iterations,
    }
    return wall, outs, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"])
    ap.add_argument(
        "--engines",
        default="transformers,recompute,swap,auto,roomy",
        help="comma list of: transformers, recompute, swap, auto, roomy",
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=128, help="KV pool of every engine, in blocks")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--swap-space-gib", type=float, default=1.0)
    ap.add_argument("--cooldown", type=float, default=15.0, help="idle seconds before each engine")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: run one engine, write here
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.model)
    prompts, new_tokens = make_workload(args.requests, model.config.vocab_size, args.seed)
    asked = sum(new_tokens)
    worst = max(len(p) + n for p, n in zip(prompts, new_tokens))
    print(
        f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {asked} new tokens asked; "
        f"model {args.model}; pool {args.num_blocks} x {args.block_size} = {args.num_blocks * args.block_size} tokens "
        f"(largest request {worst}, all at once {sum(map(len, prompts)) + asked}); torch threads {torch.get_num_threads()}"
    )
    results, outputs = {}, {}
    if args.single:
        name = args.engines
        if name == "transformers":
            wall, outs, info = run_transformers(
                model, prompts, new_tokens, args.num_blocks, args.block_size, args.max_batch_tokens
            )
        elif name in ("recompute", "swap", "auto"):
            wall, outs, info = run_ours_mode(model, prompts, new_tokens, name, args.num_blocks, args)
        elif name == "roomy":
            wall, outs, info = run_ours_mode(model, prompts, new_tokens, "recompute", 4096, args)
        else:
            raise SystemExit(f"unknown engine {name!r}")
        with open(args.single, "w") as f:
            json.dump({"wall": wall, "outputs": outs, "info": info}, f)
        return 0
    for name in args.engines.split(","):
        child = run_in_own_process(__file__, name, argv if argv is not None else sys.argv[1:], args.cooldown)
        wall, outs, info = child["wall"], child["outputs"], child["info"]
        results[name] = {"seconds": round(wall, 3), "tokens_per_s": round(asked / wall, 1), **info}
        outputs[name] = outs
        extra = "  ".join(f"{k}={v}" for k, v in info.items())
        print(f"{name:>12}: {wall:7.2f} s  {asked / wall:8.1f} tok/s  {extra}", flush=True)
    if "transformers" in results:
        base = results["transformers"]["seconds"]
        for name in results:
            if name != "transformers":
                results[name]["vs_transformers"] = round(base / results[name]["seconds"], 2)
                same = sum(a == b for a, b in zip(outputs[name], outputs["transformers"]))
                results[name]["identical_greedy_vs_transformers"] = f"{same}/{len(prompts)}"
                print(
                    f"{name:>12} / transformers: {base / results[name]['seconds']:.2f}x   "
                    f"identical greedy outputs {same}/{len(prompts)}"
                )
    if "recompute" in results:
        for name in ("swap", "auto"):
            if name in results:
                print(f"{name:>12} / recompute: {results['recompute']['seconds'] / results[name]['seconds']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
