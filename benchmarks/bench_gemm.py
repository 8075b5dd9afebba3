"""Linear layers of a whole model at serving row counts: our GEMM vs oneDNN vs ``F.linear``.

    python benchmarks/bench_gemm.py                  # the small anchor model's shapes (12 layers)
    python benchmarks/bench_gemm.py --model tiny --rows 1,16,64

Each layer has its own weights (as in a model, so a step streams all of them from memory, not from
cache): q/k/v fused, o, gate/up fused, down, for ``num_hidden_layers`` layers of the
``workload.py`` model. For every row count the three kernels run in turn (``--repeats`` rounds,
median), and the table gives ms per pass over all layers, GFLOP/s, weight GB/s and the ratios of
oneDNN's and ``F.linear``'s time to ours. No model forward, no engine: the GEMMs alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from hf_contbatch.kernels.linears import NativeGEMM, OneDNNGEMM, onednn_available

from workload import MODEL_SIZES


def layer_shapes(size: str) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's linears, siblings fused."""
    c = MODEL_SIZES[size]
    h, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    i = c["intermediate_size"]
    return [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=sorted(MODEL_SIZES))
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
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
