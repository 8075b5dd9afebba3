"""The W8A8 GEMM (int8 weights x per-row int8 activations, VNNI) against our bf16 GEMM and torch's
``F.linear`` in bf16, per linear shape of a model and row count.

    python benchmarks/bench_w8a8.py                          # the medium anchor's shapes
    python benchmarks/bench_w8a8.py --rows 1,32,1024 --repeats 9
    python benchmarks/bench_w8a8.py --baseline /tmp/old      # also an older int8_gemm.{py,c}
    python benchmarks/bench_w8a8.py --rows 1 --no-float --weight-only --kv --lm-head --baseline /tmp/old \
        --threads 1 --cpu-time                               # decode: every int8 kernel, before/after

Per shape (q/k/v fused, o, gate/up fused, down of ``workload.py``'s model; ``--lm-head`` adds the
tied LM head) and row count, the kernels run interleaved (A, B, C, A, B, C, ...) for ``--repeats``
rounds and the table gives each one's fastest round (the machine may be shared: load only adds
time): ms per pass, int8/bf16 GOP/s (two ops a multiply-add) and the share of the VNNI peak.
Each pass runs over enough copies of the weight to exceed the last-level cache (at most the
model's layer count), so weights stream from memory as in a model step; the weight GB/s (one byte a
weight for int8, two for bf16) is given against a ``Tensor.copy_`` of the int8 bytes (bytes read
plus written, as ``cpu_peak.copy_bandwidth_gbs``).

The VNNI peak is measured here: a register-only loop of independent ``VPDPBUSD`` (512-bit with
AVX512-VNNI, else 256-bit AVX-VNNI) on every thread, 64 (32) multiply-adds an instruction.

``--baseline DIR``: ``DIR/hf_contbatch/kernels/linears/int8_gemm.{py,c}`` (e.g. ``git archive`` of an
older commit) is loaded beside the tree's own and timed in the same rounds, for a before/after
ratio from one command. ``--weight-only`` adds the weight-only kernels (``native-int8`` as "int8",
``native-int8-movsx``, and the baseline's ``native-int8`` as "int8-base"), fed float32 rows.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_contbatch.kernels.linears import NativeGEMM
from hf_contbatch.kernels.linears.int8_gemm import W8A8GEMM

from workload import MODEL_SIZES

_PEAK_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
typedef __m512i V;
#define DP(a, b, c) _mm512_dpbusd_epi32(a, b, c)
#define SET1(x) _mm512_set1_epi32(x)
#define LANES 16
#elif defined(__AVXVNNI__)
typedef __m256i V;
#define DP(a, b, c) _mm256_dpbusd_avx_epi32(a, b, c)
#define SET1(x) _mm256_set1_epi32(x)
#define LANES 8
#else
#error no VNNI
#endif
int peak_lanes(void) { return LANES; }
/* iters x 12 independent VPDPBUSD chains per thread (named registers: GCC shuffles an array of
 * accumulators between registers every iteration) */
int64_t peak_dpbusd(int64_t iters, int threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        V a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5);
        V a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10), a11 = SET1(11);
        V b = SET1(0x01020304), c = SET1(0x05060708);
        for (int64_t it = 0; it < iters; it++) {
            a0 = DP(a0, b, c); a1 = DP(a1, b, c); a2 = DP(a2, b, c); a3 = DP(a3, b, c);
            a4 = DP(a4, b, c); a5 = DP(a5, b, c); a6 = DP(a6, b, c); a7 = DP(a7, b, c);
            a8 = DP(a8, b, c); a9 = DP(a9, b, c); a10 = DP(a10, b, c); a11 = DP(a11, b, c);
            /* pin the chains to registers (no copies between iterations) */
            __asm__("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
            __asm__("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
        }
        V s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
        int32_t lanes[LANES];
        __builtin_memcpy(lanes, &s, sizeof(lanes));
        total += lanes[0];
    }
    return total;
}
"""


def vnni_peak_gops(threads: int) -> float:
    """Int8 multiply-add peak (two ops each) of ``threads`` cores: the fastest one-thread round of 5
    times ``threads`` (one thread gets a whole core more often on a shared machine; the cores are alike)."""
    from hf_contbatch.kernels.native_build import build_library

    src = Path(os.environ.get("TMPDIR", "/tmp")) / "hf_contbatch_vnni_peak.c"
    src.write_text(_PEAK_SOURCE)
    lib = ctypes.CDLL(str(build_library(src, ["-O2", "-march=native", "-fopenmp", "-shared", "-fPIC"])))
    lib.peak_dpbusd.argtypes, lib.peak_dpbusd.restype = [ctypes.c_int64, ctypes.c_int], ctypes.c_int64
    lanes = lib.peak_lanes()
    iters = 2_000_000
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        lib.peak_dpbusd(iters, 1)
        best = min(best, time.perf_counter() - t0)
    return iters * 12 * lanes * 4 * 2 * threads / best / 1e9


def load_baseline(root: Path):
    """The W8A8GEMM class of ``root/hf_contbatch/kernels/linears/int8_gemm.py``, imported under a
    private package name (its relative imports answered by this tree's modules)."""
    import hf_contbatch.kernels.linears.gemm_kernel as gemm_kernel
    import hf_contbatch.kernels.native_build as native_build

    for name in ("w8a8_base", "w8a8_base.linears"):
        pkg = types.ModuleType(name)
        pkg.__path__ = []
        sys.modules[name] = pkg
    sys.modules["w8a8_base.native_build"] = native_build
    sys.modules["w8a8_base.linears.gemm_kernel"] = gemm_kernel
    stub = types.ModuleType("w8a8_base.linears.linear_op")
    stub.register_linear_op = lambda *a, **k: None
    sys.modules["w8a8_base.linears.linear_op"] = stub
    # A tree whose int8 linears are split by job (weights, the C library, the dequantizing kernel)
    # has its int8_gemm.py import those siblings: theirs, loaded first where they exist.
    for stem in ("int8_weights", "int8_library", "dequant_gemm", "int8_gemm"):
        path = root / "hf_contbatch" / "kernels" / "linears" / f"{stem}.py"
        if not path.exists():
            continue
        spec = importlib.util.spec_from_file_location(f"w8a8_base.linears.{stem}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def shapes(size: str, lm_head: bool, kv_shape: bool = False) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one decoder layer's linears, siblings fused."""
    c = MODEL_SIZES[size]
    h, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    i = c["intermediate_size"]
    out = [("qkv", h + 2 * kv, h), ("o", h, h), ("gate_up", 2 * i, h), ("down", h, i)]
    if kv_shape:
        out.append(("k", kv, h))
    if lm_head:
        out.append(("lm_head", c["vocab_size"], h))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", choices=sorted(MODEL_SIZES))
    ap.add_argument("--rows", default="1,4,16,32,64,256,1024")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activations' dtype")
    ap.add_argument("--lm-head", action="store_true", help="also the tied LM head (vocab x hidden)")
    ap.add_argument("--baseline", type=Path, default=None, help="a tree with an older int8_gemm.{py,c}")
    ap.add_argument("--only", default="", help="comma-separated shape names to run (default all)")
    ap.add_argument("--no-float", action="store_true", help="skip the bf16 kernels (int8 kernels only)")
    ap.add_argument(
        "--weight-only",
        action="store_true",
        help="also the weight-only int8 kernels (native-int8, native-int8-movsx; with --baseline, the older "
        "tree's native-int8), fed float32 activations",
    )
    ap.add_argument("--kv", action="store_true", help="also the unfused k (or v) projection's shape")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --threads 1: time the calling thread's CPU time (time.thread_time), which leaves out the "
        "time other processes hold the core on a shared machine (not their cache or memory traffic)",
    )
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time needs --threads 1 (the kernels' other threads are not the calling thread)")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    dt = getattr(torch, args.dtype)
    peak = vnni_peak_gops(args.threads)
    kernels = {"w8a8": W8A8GEMM()}
    base = load_baseline(args.baseline) if args.baseline is not None else None
    if base is not None:
        kernels["w8a8-base"] = base.W8A8GEMM()
    weight_only = {}
    if args.weight_only:
        from hf_contbatch.kernels.linears.int8_gemm import NativeInt8GEMM, NativeInt8MovsxGEMM

        weight_only["int8"] = NativeInt8GEMM()
        try:
            weight_only["int8-movsx"] = NativeInt8MovsxGEMM()
        except RuntimeError as exc:
            print(f"native-int8-movsx: {exc}")
        if base is not None:
            weight_only["int8-base"] = base.NativeInt8GEMM()
    native = NativeGEMM()
    float_kernels = {} if args.no_float else {"bf16-native": native, "F.linear": None}
    if not args.no_float and torch.bfloat16 not in native.dtypes:
        del float_kernels["bf16-native"]
    g = torch.Generator().manual_seed(0)
    src = torch.ones(64 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    print(
        f"{args.model}, {args.threads} threads, {'thread CPU' if args.cpu_time else 'wall'} time, x {args.dtype}; w8a8 ISA {kernels['w8a8'].isa}; VNNI peak "
        f"{peak:.0f} GOP/s (measured); fastest of {args.repeats} interleaved rounds. Columns: ms per weight, "
        "GOP/s, % of the VNNI peak, weight GB/s (int8: 1 B, bf16: 2 B a weight)"
    )
    only = set(filter(None, args.only.split(",")))
    for name, n, k in shapes(args.model, args.lm_head, kv_shape=args.kv):
        if only and name not in only:
            continue
        copies = max(1, min(MODEL_SIZES[args.model]["num_hidden_layers"], -(-96 * 2**20 // (n * k))))
        ws = [(torch.randn(n, k, generator=g) * 0.02).to(dt) for _ in range(copies)]
        packed = {kn: [kern.pack(w) for w in ws] for kn, kern in kernels.items()}
        packed.update({kn: [kern.pack(w.float()) for w in ws] for kn, kern in weight_only.items()})
        if "bf16-native" in float_kernels:
            packed["bf16-native"] = [native.pack(w.bfloat16()) for w in ws]
        wbf = [w.bfloat16() for w in ws]
        print(f"{name}: out {n} x in {k}, {copies} copies")
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, generator=g).to(dt)
            xb = x.bfloat16()
            runs = {}
            for kn, kern in kernels.items():
                runs[kn] = lambda kern=kern, ps=packed[kn], x=x, n=n: [kern.linear(x, p, None, n) for p in ps]
            xf = x.float()
            for kn, kern in weight_only.items():
                runs[kn] = lambda kern=kern, ps=packed[kn], xf=xf, n=n: [kern.linear(xf, p, None, n) for p in ps]
            if "bf16-native" in float_kernels:
                runs["bf16-native"] = lambda ps=packed["bf16-native"], xb=xb, n=n: [
                    native.linear(xb, p, None, n) for p in ps
                ]
            if "F.linear" in float_kernels:
                runs["F.linear"] = lambda xb=xb, wbf=wbf: [torch.nn.functional.linear(xb, w) for w in wbf]
            runs["copy"] = lambda size=copies * n * k: dst[:size].copy_(src[:size])
            best = {kn: float("inf") for kn in runs}
            for f in runs.values():
                f()
            reps = args.repeats if m * n * k * copies < 2e10 else max(3, args.repeats // 2)
            for _ in range(reps):
                for kn, f in runs.items():
                    t0 = clock()
                    f()
                    best[kn] = min(best[kn], clock() - t0)
            copy_gbs = 2 * copies * n * k / best["copy"] / 1e9
            parts = []
            for kn in runs:
                if kn == "copy":
                    continue
                t = best[kn] / copies
                gops = 2 * m * n * k / t / 1e9
                wbytes = 1 if kn.startswith(("w8a8", "int8")) else 2
                parts.append(
                    f"{kn} {t * 1e3:7.3f} {gops:5.0f} {100 * gops / peak:3.0f}% {n * k * wbytes / t / 1e9:5.1f}"
                )
            ratios = []
            if "w8a8-base" in best:
                ratios.append(f"base/new {best['w8a8-base'] / best['w8a8']:.2f}")
            if "int8-base" in best:
                ratios.append(
                    "int8 base/new "
                    + " ".join(f"{best['int8-base'] / best[kn]:.2f}" for kn in ("int8", "int8-movsx") if kn in best)
                )
            if "bf16-native" in best:
                ratios.append(f"bf16/w8a8 {best['bf16-native'] / best['w8a8']:.2f}")
            print(f"  {m:>5} | " + " | ".join(parts) + f" | copy {copy_gbs:4.1f} GB/s | " + " ".join(ratios))


if __name__ == "__main__":
    main()
