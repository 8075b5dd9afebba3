"""Prefill attention on the CPU: the compiled kernel (``cpu_prefill.c``) against the torch path
(``torch_paged``: per-request ``scaled_dot_product_attention`` over the gathered context), one layer.

    PYTHONPATH=$PWD python benchmarks/bench_prefill_attention.py            # medium's shape, fp32
    PYTHONPATH=$PWD python benchmarks/bench_prefill_attention.py --dtype bfloat16 --heads 15 --kv-heads 5
    PYTHONPATH=$PWD python benchmarks/bench_prefill_attention.py --dtype int8   # int8 pools with scales

For each prompt length: one request whose whole prompt is this step's chunk (the torch path then
reads the step's own K/V, no gather, and runs causal SDPA), and the same number of query tokens as
the last chunk of a context twice as long (chunked prefill or a prefix-cache hit: a gather and a
masked SDPA). GFLOP/s counts the multiply-adds of the visible (query, key) pairs only:
``4 * heads * head_dim * pairs``. Timings are the median of ``--repeats`` calls, the two paths
interleaved; on a shared machine they are noisy (only gross differences mean anything), and at
more than one thread a busy machine makes both paths wait for cores (``--threads 1`` is steadier).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_contbatch.kernels.attention.cpu_prefill import CPUPrefillKernel, _prefill_batch
from hf_contbatch.kernels.attention.torch_paged import torch_paged_attention


def _pairs(q_len: int, seq_len: int) -> int:
    """Visible (query, key) pairs of a causal chunk of ``q_len`` tokens ending at ``seq_len``."""
    start = seq_len - q_len
    return sum(start + i + 1 for i in range(q_len))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=15)
    ap.add_argument("--kv-heads", type=int, default=5)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--lengths", default="8,64,192,512,2000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch's thread count (default: as set)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernel = CPUPrefillKernel()
    kernel.enabled = True
    if not kernel.available:
        raise SystemExit(f"the compiled prefill kernel is unavailable: {kernel.error}")
    print(
        f"heads {args.heads}, KV heads {args.kv_heads}, head_dim {args.head_dim}, block {args.block_size}, "
        f"{args.dtype}, {torch.get_num_threads()} threads"
    )
    print(f"{'case':>22} {'torch ms':>9} {'GFLOP/s':>8} {'kernel ms':>9} {'GFLOP/s':>8} {'speedup':>7}")
    for length in map(int, args.lengths.split(",")):
        for label, seq_len in ((f"prompt {length}", length), (f"{length} of {2 * length}", 2 * length)):
            q, k, v, meta, key, value, scales = _prefill_batch(
                1, length, seq_len, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype
            )
            whole = seq_len == length
            flops = 4 * args.heads * args.head_dim * _pairs(length, seq_len)
            times: dict[str, list[float]] = {"torch": [], "kernel": []}
            scale = args.head_dim**-0.5
            with torch.inference_mode():
                for i in range(args.repeats + 1):
                    for name in times:
                        meta._derived.clear()
                        t0 = time.perf_counter()
                        if name == "kernel":
                            kernel(q, k, v, meta, scale, **scales)
                        else:
                            torch_paged_attention(
                                q,
                                k,
                                v,
                                meta,
                                scale,
                                key=key if whole else None,
                                value=value if whole else None,
                                **scales,
                            )
                        if i:
                            times[name].append(time.perf_counter() - t0)
            t_torch, t_kernel = (statistics.median(times[n]) for n in ("torch", "kernel"))
            print(
                f"{label:>22} {1e3 * t_torch:9.3f} {flops / t_torch / 1e9:8.1f} {1e3 * t_kernel:9.3f} "
                f"{flops / t_kernel / 1e9:8.1f} {t_torch / t_kernel:6.2f}x"
            )


if __name__ == "__main__":
    main()
