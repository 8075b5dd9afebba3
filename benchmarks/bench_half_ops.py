"""The non-GEMM ops of a decoder layer in float32 against bfloat16 (and float16), one process,
interleaved: does half precision ever cost more than float32, as on a CPU without native bf16?

    PYTHONPATH=$PWD python benchmarks/bench_half_ops.py --emulate-cpu no-bf16 --threads 1
    PYTHONPATH=$PWD python benchmarks/bench_half_ops.py --dtypes float32,bfloat16,float16

Medium's shapes (SmolLM2-360M: hidden 960, intermediate 2560, 15 heads, 5 KV heads, head_dim 64,
block 16), at a decode step of 32 sequences (32 rows, contexts 64..320) and a prefill step of 496
rows (chunks of 48, 96, 160, 192 tokens from position 0 and one of 64 after 256 cached):

- the fused C ops (``kernels.fused_ops``): ``rms_norm``, ``add_rms_norm``, ``rotary`` (q and k of a
  fused q/k/v GEMM output), ``silu_mul`` (a fused gate/up output's halves);
- paged attention and the KV store through the engine's C backend
  (``backends.CPUKernelAttentionBackend``, its decode and prefill kernels on) and torch's
  (``TorchAttentionBackend``: SDPA), over pools of the dtype.

Each row: the median of ``--repeats`` rounds of ``time.thread_time`` (the CPU time of this thread:
steadier than the wall clock on a shared machine at one thread), every dtype timed in each round
(A B A B ...), and each half dtype's time over float32's. ``--emulate-cpu no-bf16`` reruns the
command as on a CPU without AVX512-BF16/FP16 or AMX (``emulate_cpu.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import emulate_cpu  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 960, 2560, 15, 5, 64, 16
CASES = {
    "decode": ([1] * 32, [64 + (256 * i) // 31 for i in range(32)]),
    "prefill": ([48, 96, 160, 192, 64], [48, 96, 160, 192, 320]),
}


def _ops(dtype: torch.dtype, q_lens, seq_lens):
    """name -> a call of that op on this step's inputs in ``dtype``."""
    from bench_kv_attention import _step

    from hf_contbatch.kernels import fused_ops
    from hf_contbatch.kernels.attention.backends import CPUKernelAttentionBackend, TorchAttentionBackend

    g = torch.Generator().manual_seed(0)
    rows = sum(q_lens)
    x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    res = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    scale = torch.rand(HIDDEN, generator=g) + 0.5
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
    cos = torch.randn(rows, HEAD_DIM, generator=g).to(dtype)
    sin = torch.randn(rows, HEAD_DIM, generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * INTER, generator=g).to(dtype)
    q_cols = HEADS * HEAD_DIM
    k_cols = KV_HEADS * HEAD_DIM
    query, pools, _, meta, key, value = _step(q_lens, seq_lens, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype)
    c_backend = CPUKernelAttentionBackend()
    c_backend.decode_kernel.enabled = c_backend.prefill_kernel.enabled = True
    t_backend = TorchAttentionBackend()
    sm = HEAD_DIM**-0.5

    def attend(backend):
        meta._derived.clear()  # a step's derived tensors are built once per step: count them
        return backend.attend(query, *pools, meta, sm)

    return {
        "rms_norm": lambda: fused_ops.rms_norm(x, scale, 1e-6, True),
        "add_rms_norm": lambda: fused_ops.add_rms_norm(x, res, scale, 1e-6, True),
        "rotary q+k": lambda: (
            fused_ops.rotary(qkv[:, :q_cols], cos, sin, HEAD_DIM),
            fused_ops.rotary(qkv[:, q_cols : q_cols + k_cols], cos, sin, HEAD_DIM),
        ),
        "silu_mul": lambda: fused_ops.silu_mul(gate_up[:, :INTER], gate_up[:, INTER:]),
        "attention (C)": lambda: attend(c_backend),
        "attention (torch)": lambda: attend(t_backend),
        "store_kv (C)": lambda: c_backend.store_kv(key, value, *pools, meta),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; the first is the base")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    emulate_cpu.add_argument(ap)
    args = ap.parse_args(argv)
    if not emulate_cpu.emulating(args.emulate_cpu):  # the same command again, as on the emulated CPU
        argv = sys.argv[1:] if argv is None else list(argv)
        return subprocess.run([sys.executable, __file__, *argv], env=emulate_cpu.child_env(args.emulate_cpu)).returncode
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    names = [str(d).removeprefix("torch.") for d in dtypes]
    emulated = f", emulating {args.emulate_cpu}" if args.emulate_cpu else ""
    print(f"{args.threads} thread(s), median of {args.repeats} rounds of thread_time{emulated}")
    print(
        f"{'step':>8} {'op':>18} "
        + " ".join(f"{n + ' ms':>12}" for n in names)
        + "".join(f" {n[:4] + '/f32':>9}" for n in names[1:])
    )
    with torch.inference_mode():
        for case, (q_lens, seq_lens) in CASES.items():
            ops = {d: _ops(d, q_lens, seq_lens) for d in dtypes}
            for op in ops[dtypes[0]]:
                times = {d: [] for d in dtypes}
                for d in dtypes:
                    ops[d][op]()  # warm-up: libraries built, threads started
                for _ in range(args.repeats):
                    for d in dtypes:
                        t0 = time.thread_time()
                        ops[d][op]()
                        times[d].append(time.thread_time() - t0)
                med = {d: statistics.median(times[d]) for d in dtypes}
                cells = " ".join(f"{1e3 * med[d]:12.4f}" for d in dtypes)
                ratios = "".join(f" {med[d] / med[dtypes[0]]:9.2f}" for d in dtypes[1:])
                print(f"{case:>8} {op:>18} {cells}{ratios}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
