"""Cost of padding row counts in the packed linears (hf_contbatch/kernels/linears/onednn_gemm.py, ``padded_rows``).

    python benchmarks/bench_linear_padding.py            # the 100M model's linear shapes
    python benchmarks/bench_linear_padding.py --size tiny

For each distinct (in, out) linear shape of a benchmark model and each row count, times the packed
oneDNN product with the rows padded (what the engine runs) and unpadded (what it ran before, at the
price of a oneDNN primitive kept per row count), interleaved in one process, and F.linear as the
baseline. Prints per-shape times and the ratio padded / unpadded (1.0 = padding is free).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from hf_contbatch.kernels.linears.onednn_gemm import OneDNNGEMM  # noqa: E402

from workload import MODEL_SIZES  # noqa: E402

ROWS = (1, 3, 6, 13, 27, 50, 70, 100, 130, 200, 300, 513, 1000)


def shapes(size: str) -> list[tuple[int, int]]:
    c = MODEL_SIZES[size]
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    return sorted({(h, h), (h, kv * d), (h, c["intermediate_size"]), (c["intermediate_size"], h), (h, c["vocab_size"])})


def best_of(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=sorted(MODEL_SIZES))
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    ratios = []
    onednn = OneDNNGEMM()
    with torch.no_grad():
        for k, n in shapes(args.size):
            w = torch.randn(n, k) / k**0.5
            b = torch.randn(n)
            packed = onednn.pack(w)
            for m in ROWS:
                x = torch.randn(m, k)

                def unpadded(x=x, packed=packed, b=b):
                    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

                def padded(x=x, packed=packed, b=b, n=n):
                    return onednn.linear(x, packed, b, n)

                def plain(x=x, w=w, b=b):
                    return torch.nn.functional.linear(x, w, b)

                for f in (unpadded, padded, plain):
                    f()  # build the primitive outside the timing
                t_u = t_p = t_f = math.inf
                for _ in range(3):  # interleaved, best of each
                    t_u = min(t_u, best_of(unpadded, args.repeats))
                    t_p = min(t_p, best_of(padded, args.repeats))
                    t_f = min(t_f, best_of(plain, args.repeats))
                ratios.append(t_p / t_u)
                print(
                    f"in {k:5d} out {n:5d} rows {m:5d}: unpadded {t_u * 1e6:8.1f} us  padded {t_p * 1e6:8.1f} us  "
                    f"F.linear {t_f * 1e6:8.1f} us  padded/unpadded {t_p / t_u:5.2f}",
                    flush=True,
                )
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"geometric mean padded/unpadded over {len(ratios)} cases: {geo:.3f} (max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
