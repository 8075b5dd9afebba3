"""This CPU's peaks, measured: float32 FMA throughput (GFLOP/s) and memory copy bandwidth (GB/s).

    python benchmarks/cpu_peak.py            # both, with the torch thread count

The FMA peak runs a register-only loop of independent fused multiply-adds at the widest vector the
compiler targets with ``-march=native`` (512-bit where ``__AVX512F__``, else 256-bit), 16 independent
accumulators per OpenMP thread (12 with 256-bit vectors, so that they stay in the 16 ymm registers):
what "FMA width x FMA units x cores x clock" comes to on this machine,
measured instead of read from a data sheet. The copy bandwidth is ``dst.copy_(src)`` of 512 MiB
float32 tensors, counted as bytes read plus bytes written. Other benchmarks (``bench_breakdown.py``)
quote their GEMM GFLOP/s and weight GB/s against these.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import torch

_SOURCE = r"""
#include <stdint.h>
#if defined(__AVX512F__)
#define VW 16
#define NACC 16
#else
#define VW 8
#define NACC 12
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
int peak_lanes(void) { return VW; }
int peak_chains(void) { return NACC; }
/* iters x NACC independent FMA chains per thread; returns a value so nothing is optimised away.
   NACC + 2 constants must fit the register file (32 zmm; 16 ymm without AVX-512): 16 chains on AVX2
   spilled to the stack and measured half of Zen 3's two FMA pipes. */
float peak_fma(int64_t iters, float b, float c, int threads) {
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        vf a[NACC];
        for (int i = 0; i < NACC; i++) a[i] = (vf){} + (float)i;
        const vf vb = (vf){} + b, vc = (vf){} + c;
        for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 16
            for (int i = 0; i < NACC; i++) a[i] = a[i] * vb + vc;
        }
        for (int i = 0; i < NACC; i++) total += a[i][0];
    }
    return total;
}
"""


def fma_peak_gflops(threads: int | None = None, seconds: float = 0.5, clock=time.perf_counter) -> tuple[float, int]:
    """Measured float32 FMA peak in GFLOP/s over ``threads`` OpenMP threads (default: torch's),
    and the vector width in float lanes. ``clock``: seconds (``time.thread_time`` with one thread
    leaves out the time other processes hold the core). Raises ``RuntimeError`` without a C compiler."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_contbatch.kernels.native_build import build_library

    src = Path(os.environ.get("TMPDIR", "/tmp")) / "hf_contbatch_peak.c"
    src.write_text(_SOURCE)
    lib = ctypes.CDLL(
        str(build_library(src, ["-O2", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]))
    )
    lib.peak_fma.argtypes = [ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.peak_fma.restype = ctypes.c_float
    threads = threads or torch.get_num_threads()
    lanes = lib.peak_lanes()
    chains = lib.peak_chains()
    iters = 1_000_000
    lib.peak_fma(iters, 0.5, 0.25, threads)  # warm-up (clocks up, threads started)
    while True:
        t0 = clock()
        lib.peak_fma(iters, 0.5, 0.25, threads)
        dt = clock() - t0
        if dt > seconds / 4:
            break
        iters *= 4
    best = dt
    for _ in range(3):
        t0 = clock()
        lib.peak_fma(iters, 0.5, 0.25, threads)
        best = min(best, clock() - t0)
    return iters * chains * lanes * 2 * threads / best / 1e9, lanes


def copy_bandwidth_gbs(mib: int = 512) -> float:
    """Measured ``copy_`` bandwidth in GB/s (bytes read + bytes written), best of 5."""
    n = mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best / 1e9


def cpu_name() -> str:
    """The CPU's model name and its vector/matrix flags that matter here, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return f"{name} ({', '.join(f for f in wanted if f in flags) or 'no AVX2'}; {os.cpu_count()} CPUs)"


if __name__ == "__main__":
    gflops, lanes = fma_peak_gflops()
    print(cpu_name())
    print(f"FMA peak: {gflops:.0f} GFLOP/s float32 ({lanes} lanes, {torch.get_num_threads()} threads)")
    print(f"copy bandwidth: {copy_bandwidth_gbs():.1f} GB/s (read + write)")
