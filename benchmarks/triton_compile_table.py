"""Compile every Triton kernel variant our launchers produce for NVIDIA archs, without a GPU, and
print a table: kernel x arch x dtype -> shared memory (and the arch's limit), registers, spills,
tensor-core path, for the worst variant of each row, plus every failure or refusal.

    python benchmarks/triton_compile_table.py                      # full plan, sm_75/80/86/90
    python benchmarks/triton_compile_table.py --plan corners       # head sizes x dtypes x groups 1/7/64
    python benchmarks/triton_compile_table.py --plan sampled       # what the test suite checks
    python benchmarks/triton_compile_table.py --arch 75 --json out.jsonl --workers 2

The full plan is ~900 launcher calls per arch (every head size, GQA groups 1-64, window/softcap,
split decode, store_kv dtype pairs); at ~5-15 s per compile on one core, budget hours on 2 cores
and use ``--arch`` to split the work. See hf_contbatch/attention/triton_aot.py for the method.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_contbatch.kernels.attention import triton_aot  # noqa: E402


def summarize(results: list) -> list:
    """Rows (kernel, arch, dtype, variants, max shared, limit, max registers, max spill stores,
    tensor-core paths) over the compiled kernels, worst variant per row."""
    rows = defaultdict(lambda: {"n": 0, "shared": 0, "regs": 0, "spills": 0, "tc": set(), "worst": ""})
    for r in results:
        for k in r.get("kernels", []):
            row = rows[(k["name"].strip("_"), r["arch"], r["case"]["dtype"])]
            row["n"] += 1
            row["limit"] = r["limit"]
            if k["shared"] >= row["shared"]:
                row["shared"], row["worst"] = k["shared"], r["label"]
            row["regs"] = max(row["regs"], k["registers"] or 0)
            row["spills"] = max(row["spills"], k["spill_stores"])
            row["tc"].add(k["tensor_cores"])
    return [
        (
            name,
            arch,
            dtype,
            v["n"],
            v["shared"],
            v["limit"],
            v["regs"],
            v["spills"],
            "/".join(sorted(v["tc"])),
            v["worst"],
        )
        for (name, arch, dtype), v in sorted(rows.items())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="full", choices=("full", "corners", "sampled"))
    parser.add_argument("--arch", type=int, nargs="+", default=list(triton_aot.ARCHS))
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: all cores)")
    parser.add_argument("--json", default=None, help="also write one JSON result per line to this file")
    args = parser.parse_args()

    start = time.perf_counter()
    jobs = triton_aot.plan(args.plan, args.arch)
    print(
        f"compiling {len(jobs)} launcher calls ({args.plan} plan, archs {args.arch}) "
        f"on {args.workers or os.cpu_count()} processes ...",
        flush=True,
    )
    results = []
    out = open(args.json, "w") if args.json else None  # noqa: SIM115 - written as results arrive
    try:
        for r in triton_aot.iter_plan(jobs, args.workers):
            results.append(r)
            if out:
                out.write(json.dumps(r) + "\n")
                out.flush()
    finally:
        if out:
            out.close()
    elapsed = time.perf_counter() - start

    header = (
        "kernel",
        "arch",
        "dtype",
        "variants",
        "max shared KiB",
        "limit KiB",
        "max regs",
        "max spill B",
        "tensor cores",
        "largest-shared variant",
    )
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for name, arch, dtype, n, shared, limit, regs, spills, tc, worst in summarize(results):
        flag = "  OVER" if shared > limit else ""
        print(
            f"{name} | sm_{arch} | {dtype} | {n} | {shared / 1024:.1f}{flag} | {limit / 1024:.0f} | {regs} | "
            f"{spills} | {tc} | {worst}"
        )
    failures = [r for r in results if "error" in r]
    refused = [r for r in results if "refused" in r]
    over = sum(k["shared"] > r["limit"] for r in results for k in r.get("kernels", []))
    spilling = sum(k["spill_stores"] > 0 for r in results for k in r.get("kernels", []))
    print(
        f"\n{len(results)} launcher calls in {elapsed:.0f} s: {len(failures)} compile failures, {over} kernels over "
        f"shared memory, {spilling} kernels spilling, {len(refused)} refused by the launcher"
    )
    for r in failures:
        print(f"FAILED sm_{r['arch']} {r['label']}: {r['error'][:500]}")
    for r in refused[:5]:
        print(f"refused sm_{r['arch']} {r['label']}: {r['refused'][:160]}")
    sys.exit(1 if failures or over else 0)


if __name__ == "__main__":
    main()
