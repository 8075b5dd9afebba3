"""The decode tail: a few long requests left, each step streams every weight once. How close does a
decode step come to the machine's memory bandwidth, and does OpenMP thread placement change it?

    python benchmarks/bench_decode_tail.py --model small
    python benchmarks/bench_decode_tail.py --model small --placements "none;OMP_PROC_BIND=close,OMP_PLACES=cores"

For each placement (environment variables set before torch starts, each in its own process,
interleaved over ``--repeats`` rounds) it reports:

- ``copy GB/s``: ``dst.copy_(src)`` of a 256 MiB float32 tensor with ``--threads`` threads, counting
  bytes read plus bytes written (the reference: what the threads can stream);
- ``decode GB/s``: weight bytes / time of one engine decode step with ``--batch`` requests in their
  decode phase (a step reads every weight once; KV reads are small next to them at these lengths);
- the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))


def _single(args) -> dict:
    import torch

    from workload import build_model

    torch.set_num_threads(args.threads)
    src = torch.randn(64 * 2**20)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    copy_gbs = 2 * src.numel() * 4 / min(copies) / 1e9
    del src, dst

    from hf_contbatch import EngineConfig, LLMEngine, SamplingParams

    model = build_model(args.model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = LLMEngine(model, EngineConfig())
    try:
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(64)] for i in range(args.batch)]
        n = args.steps + 8
        handles = [engine.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
        times = []
        # Drive the engine here, one step at a time, timing the decode steps (after the prefill).
        engine.driver.drive(
            lambda: all(h.done() for h in handles), after_iteration=lambda: times.append(time.perf_counter())
        )
        for h in handles:
            h.result()
    finally:
        engine.close()
    steps = [b - a for a, b in zip(times[4:], times[5:])]  # skip prefill and the first decodes
    step = sorted(steps)[len(steps) // 2]
    return {
        "copy_gbs": copy_gbs,
        "decode_step_ms": 1e3 * step,
        "decode_gbs": weight_bytes / step / 1e9,
        "weight_mb": weight_bytes / 1e6,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=["tiny", "small"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="requests decoding together")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--placements",
        default="none;OMP_PROC_BIND=close,OMP_PLACES=cores;OMP_PROC_BIND=spread,OMP_PLACES=cores",
        help="';'-separated env assignments (comma-separated within one; 'none' for unset)",
    )
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.single:
        with open(args.single, "w") as f:
            json.dump(_single(args), f)
        return 0
    placements = args.placements.split(";")
    runs: dict = {p: [] for p in placements}
    for _ in range(args.repeats):
        for p in placements:
            env = dict(os.environ)
            if p != "none":
                env.update(kv.split("=", 1) for kv in p.split(","))
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                cmd = [
                    sys.executable,
                    __file__,
                    "--single",
                    tmp.name,
                    "--model",
                    args.model,
                    "--threads",
                    str(args.threads),
                    "--batch",
                    str(args.batch),
                    "--steps",
                    str(args.steps),
                ]
                subprocess.run(cmd, check=True, env=env)
                with open(tmp.name) as f:
                    runs[p].append(json.load(f))
    print(
        f"model {args.model}, {args.threads} threads, {args.batch} requests decoding, "
        f"weights {runs[placements[0]][0]['weight_mb']:.0f} MB, {args.repeats} round(s), best of rounds"
    )
    print(f"{'placement':>45} {'copy GB/s':>10} {'step ms':>8} {'decode GB/s':>12} {'decode/copy':>12}")
    for p in placements:
        copy = max(r["copy_gbs"] for r in runs[p])
        best = min(runs[p], key=lambda r: r["decode_step_ms"])
        print(
            f"{p:>45} {copy:10.2f} {best['decode_step_ms']:8.2f} {best['decode_gbs']:12.2f} "
            f"{best['decode_gbs'] / copy:12.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
