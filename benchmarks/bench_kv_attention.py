"""One layer's attention and KV store, int8 cache against bfloat16 (or float32) pools, per path.

    PYTHONPATH=$PWD python benchmarks/bench_kv_attention.py                 # medium's shape, 2 threads
    PYTHONPATH=$PWD python benchmarks/bench_kv_attention.py --float-dtype float32 --repeats 30

What an engine step of the medium anchor (SmolLM2-360M: 15 heads, 5 KV heads, head_dim 64, block
16) runs per layer, through the engine's own backend objects (``backends.CPUKernelAttentionBackend``
over float pools, ``backends.Int8CPUKernelAttentionBackend`` over int8 pools with scales), with the
query in the model's dtype:

- ``decode``: 32 sequences, one query token each, contexts spread evenly over 64..320 tokens;
- ``prefill``: four prompt chunks (48, 96, 160, 192 tokens) from position 0, and one chunk of 64
  tokens after 256 cached ones (chunked prefill, a prefix-cache hit);
- ``store decode`` / ``store prefill``: ``store_kv`` of those steps' K/V rows (``[T, KVH, D]``
  views of the ``[1, KVH, T, D]`` tensors the model passes).

Each path also runs through the plain torch backend of its pool (``torch`` rows) for reference.
Every case's candidates are timed interleaved (A B A B ...), the fastest of ``--repeats`` rounds
kept (load from other processes only adds time); the ratio column is int8's time over the float
pool's. On a shared machine only gross ratios mean anything.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_contbatch.kernels.attention.backends import (
    CPUKernelAttentionBackend,
    Int8CPUKernelAttentionBackend,
    Int8TorchAttentionBackend,
    TorchAttentionBackend,
)
from hf_contbatch.kernels.attention.kv_quant import quantize_kv
from hf_contbatch.kernels.attention.metadata import AttentionMetadata


def _step(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """Query ``[T, H, D]`` (a view of ``[1, H, T, D]``, as the model hands it), float pools and int8
    pools + scales holding the same (quantized) K/V, the metadata, and this step's K/V ``[T, KVH, D]``
    views."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kq, ks = quantize_kv(torch.randn(shape, generator=g))
    vq, vs = quantize_kv(torch.randn(shape, generator=g))
    # The float pools hold the dequantized values: both caches then hold the same numbers.
    k_float = (kq.float() * ks).to(dtype)
    v_float = (vq.float() * vs).to(dtype)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)  # pages scattered over the pool
    at = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[at : at + b]
        at += b
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    t = qsl[-1]
    slots = []
    for i, (n, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(s - n, s):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=sum(1 for n in q_lens if n == 1),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
        num_kv_heads=kv_heads,
    )
    query = torch.randn(1, heads, t, head_dim, generator=g).to(dtype)[0].transpose(0, 1)
    key = torch.randn(1, kv_heads, t, head_dim, generator=g).to(dtype)[0].transpose(0, 1)
    value = torch.randn(1, kv_heads, t, head_dim, generator=g).to(dtype)[0].transpose(0, 1)
    return query, (k_float, v_float), (kq, vq, ks, vs), meta, key, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=15)
    ap.add_argument("--kv-heads", type=int, default=5)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--float-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="skip the plain torch backends")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.float_dtype)
    geo = (args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
    decode_lens = [64 + (256 * i) // 31 for i in range(32)]
    cases = {
        "decode": ([1] * 32, decode_lens),
        "prefill": ([48, 96, 160, 192, 64], [48, 96, 160, 192, 320]),
    }
    fk, ik = CPUKernelAttentionBackend(), Int8CPUKernelAttentionBackend()
    for b in (fk, ik):  # the kernels serve wherever they can: what is compared is the kernels
        b.decode_kernel.enabled = b.prefill_kernel.enabled = True
    backends = {"float": fk, "int8": ik}
    if not args.no_torch:
        backends.update({"float torch": TorchAttentionBackend(), "int8 torch": Int8TorchAttentionBackend()})
    scale = args.head_dim**-0.5
    print(
        f"heads {args.heads}, KV heads {args.kv_heads}, head_dim {args.head_dim}, block {args.block_size}, "
        f"float pool {args.float_dtype}, {torch.get_num_threads()} threads, fastest of {args.repeats}"
    )
    print(f"{'case':>14} " + " ".join(f"{n + ' ms':>14}" for n in backends) + f" {'int8/float':>10}")
    with torch.inference_mode():
        for case, (q_lens, seq_lens) in cases.items():
            query, fpools, qpools, meta, key, value = _step(q_lens, seq_lens, args.heads, *geo[1:])

            def attend(name, query=query, fpools=fpools, qpools=qpools, meta=meta):
                b = backends[name]
                meta._derived.clear()  # a step's derived tensors are built once per step: count them
                if name.startswith("int8"):
                    kq, vq, ks, vs = qpools
                    return b.attend(query, kq, vq, meta, scale, k_scale=ks, v_scale=vs)
                return b.attend(query, *fpools, meta, scale)

            def store(name, key=key, value=value, fpools=fpools, qpools=qpools, meta=meta):
                b = backends[name]
                if name.startswith("int8"):
                    kq, vq, ks, vs = qpools
                    return b.store_kv(key, value, kq, vq, meta, k_scale=ks, v_scale=vs)
                return b.store_kv(key, value, *fpools, meta)

            for label, fn in ((case, attend), (f"store {case}", store)):
                best = {n: float("inf") for n in backends}
                for _ in range(args.repeats + 1):
                    for name in backends:
                        t0 = time.perf_counter()
                        fn(name)
                        best[name] = min(best[name], time.perf_counter() - t0)
                row = " ".join(f"{1e3 * best[n]:14.4f}" for n in backends)
                print(f"{label:>14} {row} {best['int8'] / best['float']:10.2f}")


if __name__ == "__main__":
    main()
