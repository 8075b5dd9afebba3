"""Linear layers of a whole model at serving row counts: our GEMM vs oneDNN vs ``F.linear``.

    python benchmarks/bench_gemm.py                  # the small anchor model's shapes (12 layers)
    python benchmarks/bench_gemm.py --model tiny --rows 1,16,64

Each layer has its own weights (as in a model, so a step streams all of them from memory, not from
cache): q/k/v fused, o, gate/up fused, down, for ``num_hidden_layers`` layers of the
``workload.py`` model. For every row count the three kernels run in turn (``--repeats`` rounds,
median), and the table gives ms per pass over all layers, GFLOP/s, weight GB/s and the ratios of
oneDNN's and ``F.linear``'s time to ours. No model forward, no engine: the GEMMs alone.

    python benchmarks/bench_gemm.py --int8 --rows 1,4,16,64,256   # int8 kernels against float ones

    python benchmarks/bench_gemm.py --int8 --model medium --rows 1 --kv --head --no-float   # decode
    python benchmarks/bench_gemm.py --int8 --model medium --rows 1 --kv --head --threads 1 --cpu-time

With ``--int8``, per layer shape (``--kv``: also the unfused k/v projection; ``--head``: the LM head;
copies of each until the int8 ones pass 256 MB, so weights stream from memory) and row count: our
float32 GEMM, our bfloat16 one (AVX512-BF16 CPUs), ``native-int8`` (weight-only, dequantized in
registers), ``native-int8-movsx`` (the same, widened by VPMOVSXBD; x86) and ``w8a8`` (int8
activations, VNNI), interleaved with a copy (``Tensor.copy_``) of as many bytes as
each weight format holds (float32, bf16, int8). Each kernel's weight GB/s is given as a share of the
copy bandwidth of its own byte count (copy GB/s counts the bytes read and written, as
``cpu_peak.copy_bandwidth_gbs``), and its GFLOP/s (for ``w8a8``: int8 multiply-adds, two ops each).

    python benchmarks/bench_gemm.py --prefill-anchor small --threads 2   # prefill: % of the FMA peak
    python benchmarks/bench_gemm.py --prefill-anchor /tmp/peers/anchor/medium --threads 2

With ``--prefill-anchor`` (a ``workload.py`` model size, or a directory holding a transformers
``config.json``), per prefill row count and projection shape (fused q/k/v, o, fused gate/up, down;
copies of each weight adding up to ``--stream-mb`` per candidate, so weights come from memory as in a
model's step), every candidate's GFLOP/s and its share of the float32 FMA peak ``cpu_peak.fma_peak_gflops`` measures at the same thread count,
all in one process, candidates interleaved, the fastest of ``--repeats`` rounds (as the engine's tuner
keeps, ``tuning.robust_seconds``): our GEMM (x read in place by 10-row tiles), ``ours-packx``
(``NativePackedXGEMM``: x copied into 14-row tiles, the weight walked in L2-sized chunks), oneDNN and
``F.linear``. ``--cpu-time`` with ``--threads 1``: thread CPU time (a shared machine).
Row counts (``--rows`` overrides): the engine's token budget (``SchedulerConfig.max_num_batched_tokens``:
the chunk a step of many prefilling requests fills), the last chunk of the size's standard workload
(its prompt tokens modulo the budget), and its longest prompt (one request prefilled alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from hf_contbatch.kernels.linears import NativeGEMM, NativePackedXGEMM, OneDNNGEMM, onednn_available
from hf_contbatch.kernels.linears.native_gemm import HALF_ISAS

from workload import MODEL_SIZES


def layer_shapes(size: str) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's linears, siblings fused."""
    c = MODEL_SIZES[size]
    h, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    i = c["intermediate_size"]
    return [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]


def int8_table(args) -> None:
    """The ``--int8`` table: per shape and row count, float32/bf16/int8 kernels and copies, interleaved."""
    from hf_contbatch.kernels.linears.int8_gemm import W8A8GEMM, NativeInt8GEMM, NativeInt8MovsxGEMM

    c = MODEL_SIZES[args.model]
    shapes = layer_shapes(args.model)
    if args.kv:
        shapes.append((c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]))
    if args.head:
        shapes.append((c["hidden_size"], c["vocab_size"]))
    layers = c["num_hidden_layers"]
    clock = time.thread_time if args.cpu_time else time.perf_counter
    g = torch.Generator().manual_seed(0)
    fp32 = NativeGEMM()
    kernels = {} if args.no_float else {"fp32": (fp32, torch.float32, 4)}
    if not args.no_float and torch.bfloat16 in fp32.dtypes:
        kernels["bf16"] = (fp32, torch.bfloat16, 2)
    kernels["native-int8"] = (NativeInt8GEMM(), torch.float32, 1)
    try:
        kernels["native-int8-movsx"] = (NativeInt8MovsxGEMM(), torch.float32, 1)
    except RuntimeError as exc:
        print(f"native-int8-movsx: {exc}")
    kernels["w8a8"] = (W8A8GEMM(), torch.float32, 1)
    print(
        f"{args.model}: up to {layers} copies per shape, {torch.get_num_threads()} threads, "
        f"{'thread CPU' if args.cpu_time else 'wall'} time, {'fastest' if args.best else 'median'} of "
        f"{args.repeats} interleaved rounds; int8 ISA {kernels['native-int8'][0].isa}, w8a8 ISA "
        f"{kernels['w8a8'][0].isa}; GB/s of weights read, % of a copy of the same bytes (GB/s counting read + "
        "written, as cpu_peak.copy_bandwidth_gbs), GFLOP/s (w8a8: int8 GOP/s)"
    )
    for k, n in shapes:
        # Copies (each layer its own weight, as in a model) until the int8 ones pass 256 MB: weights
        # stream from memory as in a step (the LM head: two copies).
        copies = max(2, min(layers, -(-256 * 2**20 // (n * k))))
        ws = [torch.randn(n, k, generator=g) * 0.02 for _ in range(copies)]
        packed = {name: [kern.pack(w.to(dt)) for w in ws] for name, (kern, dt, _) in kernels.items()}
        del ws
        # Copies into a buffer allocated once (a fresh clone's page faults would slow the copy).
        buffers = {
            size: (
                torch.ones(copies * n * k * size, dtype=torch.uint8),
                torch.empty(copies * n * k * size, dtype=torch.uint8),
            )
            for size in sorted({s for *_, s in kernels.values()})
        }
        print(f"shape in={k} out={n}: {copies} copies, {copies * n * k / 1e6:.1f} M weights")
        for m in [int(r) for r in args.rows.split(",")]:
            xs = {dt: torch.randn(m, k, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16)}
            runs = {}
            for name, (kern, dt, _) in kernels.items():
                runs[name] = lambda kern=kern, x=xs[dt], ps=packed[name], n=n: [kern.linear(x, p, None, n) for p in ps]
            for size, (src, dst) in buffers.items():
                runs[f"copy{size}"] = lambda src=src, dst=dst: dst.copy_(src)
            times = {name: [] for name in runs}
            for f in runs.values():
                f()
            for _ in range(args.repeats):
                for name, f in runs.items():
                    t0 = clock()
                    f()
                    times[name].append(clock() - t0)
            med = {name: (min if args.best else statistics.median)(t) for name, t in times.items()}
            parts = []
            for name, (_, _, size) in kernels.items():
                gbs = copies * n * k * size / med[name] / 1e9
                copy_gbs = 2 * copies * n * k * size / med[f"copy{size}"] / 1e9
                gf = 2 * m * copies * n * k / med[name] / 1e9
                parts.append(
                    f"{name} {med[name] / copies * 1e6:7.1f} us {gbs:5.1f} GB/s {100 * gbs / copy_gbs:4.0f}% {gf:5.0f} GF/s"
                )
            copy1 = 2 * copies * n * k / med["copy1"] / 1e9
            print(f"  rows {m:>4}: copy1 {copy1:5.1f} GB/s | " + " | ".join(parts))


def decode_candidates() -> list[tuple[str, object, torch.dtype]]:
    """(label, kernel, weight dtype) of every GEMM that runs here, for the ``--decode`` table: our
    kernel per weight dtype and half-precision variant, oneDNN, ``F.linear`` and the int8 kernels."""
    from hf_contbatch.kernels.linears.int8_gemm import W8A8GEMM, NativeInt8GEMM
    from hf_contbatch.kernels.linears.torch_linear import TorchLinear

    out = []
    ours = NativeGEMM()
    onednn = OneDNNGEMM() if onednn_available() else None
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for variant, kern in half_variants(ours, dt):
            out.append((f"ours{variant}", kern, dt))
        if onednn is not None and dt in onednn.dtypes:
            out.append(("oneDNN", onednn, dt))
        out.append(("F.linear", TorchLinear(), dt))
    out.append(("native-int8", NativeInt8GEMM(), torch.float32))
    out.append(("w8a8", W8A8GEMM(), torch.float32))
    return out


def half_variants(ours, dtype: torch.dtype) -> list[tuple[str, object]]:
    """Our kernel's variants for ``dtype`` weights: bfloat16 both ways where the CPU has
    AVX512-BF16 ("-avx512_bf16", "-widen"), else the one it has; float32 and float16 one each."""
    if dtype not in ours.dtypes:
        return []
    if dtype != torch.bfloat16:
        return [("", ours)]
    isas = HALF_ISAS if ours.half_isa == "avx512_bf16" else ("widen",)
    return [(f"-{isa}", NativeGEMM(half_isa=isa)) for isa in isas]


def decode_table(args) -> None:
    """The ``--decode`` table: per shape of one layer (copies of it adding up to ``--stream-mb`` of
    float32 weights per candidate, so the weights stream from memory as in a step) and row count, every candidate's weight GB/s and its
    share of a copy of the same bytes (read + written), all interleaved in one process."""
    cands = decode_candidates()
    c = MODEL_SIZES[args.model]
    shapes = layer_shapes(args.model)
    if args.head:
        shapes.append((c["hidden_size"], c["vocab_size"]))
    layers = c["num_hidden_layers"]
    g = torch.Generator().manual_seed(0)
    print(
        f"{args.model}: ~{args.stream_mb} MB of float32 weight copies per shape and candidate, {torch.get_num_threads()} threads, median of {args.repeats} "
        "interleaved rounds; GB/s of weights read, % of a copy of as many bytes (GB/s counting read + written)"
    )
    for k, n in shapes:
        # Copies of float32 weights adding up to --stream-mb (each candidate its own: all of them
        # together outgrow the last-level cache, so weights stream from memory as in a model's step).
        copies = max(2, min(layers, -(-args.stream_mb * 2**20 // (4 * n * k))))
        ws = [torch.randn(n, k, generator=g) * 0.02 for _ in range(copies)]
        packs = {}
        for i, (_label, kern, dt) in enumerate(cands):
            w0 = ws[0].to(dt)
            if kern.supports(w0):
                packs[i] = [kern.pack(w.to(dt)) for w in ws]
        nbytes = {i: sum(p.nbytes for p in ps) for i, ps in packs.items()}
        nbytes.update(
            {
                i: copies * n * k * torch.empty((), dtype=cands[i][2]).element_size()
                for i in packs
                if cands[i][0] == "F.linear"
            }
        )
        sizes = sorted(set(nbytes.values()))
        bufs = {b: (torch.ones(b, dtype=torch.uint8), torch.empty(b, dtype=torch.uint8)) for b in sizes}
        for m in [int(r) for r in args.rows.split(",")]:
            runs = {}
            with torch.inference_mode():
                for i, ps in packs.items():
                    label, kern, dt = cands[i]
                    x = torch.randn(m, k, generator=g).to(dt)
                    runs[i] = lambda kern=kern, x=x, ps=ps, n=n: [kern.linear_verified(x, p, None, n) for p in ps]
                for b, (src, dst) in bufs.items():
                    runs[("copy", b)] = lambda src=src, dst=dst: dst.copy_(src)
                times = {key: [] for key in runs}
                for f in runs.values():
                    f()
                for _ in range(args.repeats):
                    for key, f in runs.items():
                        t0 = time.perf_counter()
                        f()
                        times[key].append(time.perf_counter() - t0)
            med = {key: statistics.median(t) for key, t in times.items()}
            for i in packs:
                label, kern, dt = cands[i]
                gbs = nbytes[i] / med[i] / 1e9
                copy_gbs = 2 * nbytes[i] / med[("copy", nbytes[i])] / 1e9
                print(
                    f"{k}x{n} rows {m:>3} {str(dt).removeprefix('torch.'):>8} {label:<14} {med[i] * 1e3:8.3f} ms "
                    f"{gbs:6.1f} GB/s {100 * gbs / copy_gbs:5.0f}% of copy ({copy_gbs:.1f} GB/s)"
                )


def anchor_shapes(anchor: str) -> tuple[list[tuple[str, int, int]], dict]:
    """(projection name, in_features, out_features) per linear of one decoder layer, siblings fused
    as the engine fuses them (q/k/v, gate/up), and the config dict, for a ``workload.py`` size or a
    directory with a transformers ``config.json``."""
    if anchor in MODEL_SIZES:
        c = dict(MODEL_SIZES[anchor])
    else:
        import json

        with open(os.path.join(anchor, "config.json")) as f:
            c = json.load(f)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    q, kv, i = heads * head_dim, c["num_key_value_heads"] * head_dim, c["intermediate_size"]
    return [("qkv", h, q + 2 * kv), ("o", q, h), ("gate_up", h, 2 * i), ("down", i, h)], c


def prefill_rows(anchor: str) -> list[int]:
    """The prefill row counts of ``anchor``'s standard workload: the token budget, the last chunk
    (prompt tokens modulo the budget) and the longest prompt (see the module docstring)."""
    from hf_contbatch.config import SchedulerConfig

    from workload import workload_for

    budget = SchedulerConfig().max_num_batched_tokens
    # a config directory named after a size (../peers/anchor/medium) takes that size's workload
    size = anchor if anchor in MODEL_SIZES else os.path.basename(os.path.normpath(anchor))
    size = size if size in MODEL_SIZES else "small"
    prompts, _ = workload_for(size, vocab_size=2048)
    total = sum(len(p) for p in prompts)
    return sorted({budget, total % budget or budget, max(len(p) for p in prompts)}, reverse=True)


def prefill_table(args) -> None:
    """The ``--prefill-anchor`` table (see the module docstring)."""

    from cpu_peak import fma_peak_gflops

    from hf_contbatch.kernels.linears.torch_linear import TorchLinear

    shapes, _ = anchor_shapes(args.prefill_anchor)
    rows = [int(r) for r in args.rows.split(",")] if args.rows else prefill_rows(args.prefill_anchor)
    threads = torch.get_num_threads()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    peak, lanes = fma_peak_gflops(threads, clock=clock)
    cands: dict[str, object] = {"ours": NativeGEMM()}
    try:
        cands["ours-packx"] = NativePackedXGEMM()
    except RuntimeError as exc:  # a build without the packed-x tiles (not AVX-512)
        print(f"ours-packx: {exc}")
    if onednn_available():
        cands["oneDNN"] = OneDNNGEMM()
    cands["F.linear"] = TorchLinear()
    print(
        f"prefill {args.prefill_anchor}: {threads} threads, {'thread CPU' if args.cpu_time else 'wall'} time, FMA peak "
        f"{peak:.0f} GFLOP/s float32 ({lanes} lanes, measured now), fastest of {args.repeats} interleaved rounds; GFLOP/s and % of the peak"
    )
    names = list(cands)
    print(f"{'rows':>5} {'shape':>18} " + " ".join(f"{n:>20}" for n in names))
    g = torch.Generator().manual_seed(0)
    totals = {n: 0.0 for n in names}
    flops_total = 0.0
    for m in rows:
        for label, k, n in shapes:
            # Copies of the weight adding up to --stream-mb per candidate (each layer of a model has
            # its own: a step reads them from memory, not from a cache the previous call warmed).
            copies = max(1, -(-args.stream_mb * 2**20 // (4 * n * k)))
            ws = [torch.randn(n, k, generator=g) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, generator=g)
            packed = {name: [kern.pack(w) for w in ws] for name, kern in cands.items()}
            del ws
            runs = {}
            with torch.inference_mode():
                for name, kern in cands.items():
                    runs[name] = lambda kern=kern, ps=packed[name], x=x, n=n: [
                        kern.linear_verified(x, p, None, n) for p in ps
                    ]
                for f in runs.values():
                    f()  # warm-up (oneDNN builds its primitive)
                times = {name: [] for name in names}
                for r in range(args.repeats):
                    for j in range(len(names)):
                        name = names[(r + j) % len(names)]
                        t0 = clock()
                        runs[name]()
                        times[name].append((clock() - t0) / copies)
            del packed, runs
            flops = 2 * m * k * n
            flops_total += flops
            best = {name: min(t) for name, t in times.items()}
            for name in names:
                totals[name] += best[name]
            cells = [f"{flops / best[n] / 1e9:7.0f} {100 * flops / best[n] / 1e9 / peak:4.0f}%" for n in names]
            print(f"{m:>5} {label:>7} {k:>5}x{n:<5} " + " ".join(f"{c:>20}" for c in cells), flush=True)
    cells = [f"{flops_total / totals[n] / 1e9:7.0f} {100 * flops_total / totals[n] / 1e9 / peak:4.0f}%" for n in names]
    print(f"{'all':>5} {'':>18} " + " ".join(f"{c:>20}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=sorted(MODEL_SIZES))
    ap.add_argument(
        "--rows",
        default=None,
        help="row counts (default 1,4,8,16,32,64,128,256,1024; with --prefill-anchor its chunks)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--prefill-anchor",
        default=None,
        help="a workload.py model size or a config.json directory: its prefill shapes, %% of the FMA peak",
    )
    ap.add_argument("--int8", action="store_true", help="the int8 kernels against the float ones, per shape")
    ap.add_argument("--decode", action="store_true", help="every candidate per shape at decode rows, %% of copy GB/s")
    ap.add_argument("--head", action="store_true", help="with --decode or --int8: the LM head's shape too")
    ap.add_argument("--kv", action="store_true", help="with --int8: the unfused k (or v) projection's shape too")
    ap.add_argument("--no-float", action="store_true", help="with --int8: the int8 kernels only")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="with --threads 1: the calling thread's CPU time (time.thread_time), which leaves out the time "
        "other processes hold the core on a shared machine (not their cache or memory traffic)",
    )
    ap.add_argument(
        "--stream-mb", type=int, default=96, help="with --decode or --prefill-anchor: MB of float32 copies per shape"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch (and our kernels') threads; default torch's")
    ap.add_argument("--best", action="store_true", help="report the fastest round, not the median (a shared machine)")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time needs --threads 1 (the kernels' other threads are not the calling thread)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefill_anchor:
        prefill_table(args)
        return
    args.rows = args.rows or "1,4,8,16,32,64,128,256,1024"
    if args.int8:
        int8_table(args)
        return
    if args.decode:
        decode_table(args)
        return
    shapes = layer_shapes(args.model)
    layers = MODEL_SIZES[args.model]["num_hidden_layers"]
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g) * 0.02 for k, n in shapes] for _ in range(layers)]
    kernels = {"ours": NativeGEMM()}
    if onednn_available():
        kernels["oneDNN"] = OneDNNGEMM()
    packed = {name: [[kern.pack(w) for w in layer] for layer in weights] for name, kern in kernels.items()}

    def run(name: str, xs: list[torch.Tensor]) -> None:
        if name == "F.linear":
            for layer in weights:
                for x, w in zip(xs, layer):
                    torch.nn.functional.linear(x, w)
            return
        kern = kernels[name]
        for layer in packed[name]:
            for x, p, (_, n) in zip(xs, layer, shapes):
                kern.linear(x, p, None, n)

    names = [*kernels, "F.linear"]
    weight_bytes = layers * sum(k * n for k, n in shapes) * 4
    print(
        f"{args.model}: {layers} layers of {shapes} (in, out), {weight_bytes / 1e6:.0f} MB of float32 weights, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'rows':>5} "
        + " ".join(f"{n + ' ms':>12}" for n in names)
        + "   ours GF/s  ours GB/s  "
        + "  ".join(f"{n}/ours" for n in names[1:])
    )
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(m, k, generator=g) for k, _ in shapes]
        times = {n: [] for n in names}
        for n in names:
            run(n, xs)  # warm-up (oneDNN builds its primitive for this shape)
        for _ in range(args.repeats):
            for n in names:
                t0 = time.perf_counter()
                run(n, xs)
                times[n].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) for n, t in times.items()}
        flops = 2 * m * layers * sum(k * n for k, n in shapes)
        print(
            f"{m:>5} "
            + " ".join(f"{med[n] * 1e3:>12.2f}" for n in names)
            + f"   {flops / med['ours'] / 1e9:>9.0f}  {weight_bytes / med['ours'] / 1e9:>9.1f}  "
            + "  ".join(f"{med[n] / med['ours']:>{len(n) + 5}.2f}" for n in names[1:])
        )


if __name__ == "__main__":
    main()
