"""One layer's attention and KV store, int8 cache against bfloat16 (or float32) pools, per path.

    PYTHONPATH=$PWD python benchmarks/bench_kv_attention.py                 # medium's shape, 2 threads
    PYTHONPATH=$PWD python benchmarks/bench_kv_attention.py --float-dtype float32 --repeats 30
    PYTHONPATH=$PWD python benchmarks/bench_kv_attention.py --tail      # few sequences, long contexts

What an engine step of the medium anchor (SmolLM2-360M: 15 heads, 5 KV heads, head_dim 64, block
16) runs per layer, through the engine's own backend objects (``backends.CPUKernelAttentionBackend``
over float pools, ``backends.Int8CPUKernelAttentionBackend`` over int8 pools with scales), with the
query in the model's dtype:

- ``decode``: 32 sequences, one query token each, contexts spread evenly over 64..320 tokens;
- ``prefill``: four prompt chunks (48, 96, 160, 192 tokens) from position 0, and one chunk of 64
  tokens after 256 cached ones (chunked prefill, a prefix-cache hit);
- ``store decode`` / ``store prefill``: ``store_kv`` of those steps' K/V rows (``[T, KVH, D]``
  views of the ``[1, KVH, T, D]`` tensors the model passes).

``--tail`` measures instead the decode tail: 1, 2 and 4 sequences at contexts of 256, 1024 and 4096
tokens, float32, bfloat16 and int8 pools, medium's head geometry and tiny's (8 heads, 4 KV heads,
head_dim 32), through the engine's backend (``attend``), cycling over one pool per layer as a step
does (up to the model's layer count, within ``--pool-mib``), so that each call reads its keys and
values from memory rather than from a cache that still holds them. Each row gives the median ms
per call (and the fastest: on a shared machine the median mostly measures the other processes), the bytes of K/V (and scales) it reads and the GB/s that makes, beside ``cpu_peak``'s
copy bandwidth; a last table gives the fixed cost of one call (a one-token context): the backend's
``attend`` and, under it, the kernel's Python and C call. Rows are timed interleaved over
``--repeats`` rounds.

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


GEOMETRIES = {"medium": (15, 5, 64, 32), "tiny": (8, 4, 32, 4)}  # heads, KV heads, head_dim, layers


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _tail_case(num_seqs, context, heads, kv_heads, head_dim, block_size, dtype, layers, seed=0):
    """A decode step of ``num_seqs`` sequences of ``context`` tokens: the query ``[b, H, D]`` (float32
    for int8 pools), the metadata (pages scattered over the pool) and ``layers`` pools of ``dtype``, each
    ``(k, v)`` or, int8, ``(k, v, k_scale, v_scale)`` (normal K/V quantized by ``kv_quant``)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // block_size)
    num_blocks = num_seqs * blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    pools = []
    for _ in range(layers):
        if dtype == torch.int8:
            kq, ks = quantize_kv(torch.randn(shape, generator=g))
            vq, vs = quantize_kv(torch.randn(shape, generator=g))
            pools.append((kq, vq, ks, vs))
        else:
            pools.append((torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)))
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = perm.view(num_seqs, blocks).contiguous()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.long),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32),
        block_tables=tables,
        num_decodes=num_seqs,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc_cpu=list(range(num_seqs + 1)),
        seq_lens_cpu=[context] * num_seqs,
        block_size=block_size,
        num_kv_heads=kv_heads,
    )
    qdtype = torch.float32 if dtype == torch.int8 else dtype
    # [b, H, D] as the model hands it for one token per sequence: a view of [1, H, b, D].
    query = torch.randn(1, heads, num_seqs, head_dim, generator=g).to(qdtype)[0].transpose(0, 1)
    return query, meta, pools


def tail(args) -> None:
    """The decode tail (see the module docstring): ms per call, bytes read, GB/s, fixed cost."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cpu_peak import copy_bandwidth_gbs

    fk, ik = CPUKernelAttentionBackend(), Int8CPUKernelAttentionBackend()
    for b in (fk, ik):  # the kernel serves wherever it can: what is measured is the kernel
        b.decode_kernel.enabled = True
    copy = copy_bandwidth_gbs(256)
    print(
        f"decode tail, {torch.get_num_threads()} threads, block {args.block_size}, median of {args.repeats}; "
        f"copy bandwidth {copy:.1f} GB/s (read + write)"
    )
    print(
        f"{'geometry':>8} {'pool':>8} {'seqs':>4} {'context':>7} {'layers':>6} {'ms':>8} {'min ms':>8} {'MB read':>8} "
        f"{'GB/s':>6} {'min GB/s':>8}"
    )
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}

    def attend(query, meta, pools, scale):
        if len(pools) == 4:
            kq, vq, ks, vs = pools
            return ik.attend(query, kq, vq, meta, scale, k_scale=ks, v_scale=vs)
        return fk.attend(query, *pools, meta, scale)

    def kernel_only(query, meta, pools, scale):
        kernel = (ik if len(pools) == 4 else fk).decode_kernel
        scales = {"k_scale": pools[2], "v_scale": pools[3]} if len(pools) == 4 else {}
        return kernel(query, pools[0], pools[1], meta.block_tables, meta.seq_lens, scale, **scales)

    fixed = {}
    with torch.inference_mode():
        for gname in args.geometries.split(","):
            heads, kvh, dim, model_layers = GEOMETRIES[gname]
            scale = dim**-0.5
            for dname in args.dtypes.split(","):
                dtype = dtypes[dname]
                elem = 1 if dtype == torch.int8 else torch.finfo(dtype).bits // 8
                per_token = kvh * (dim * elem + (4 if dtype == torch.int8 else 0)) * 2
                for b in (1, 2, 4):
                    for ctx in (256, 1024, 4096):
                        layer_bytes = b * ctx * per_token
                        layers = max(1, min(model_layers, args.pool_mib * 2**20 // layer_bytes))
                        query, meta, pools = _tail_case(b, ctx, heads, kvh, dim, args.block_size, dtype, layers)
                        times = []
                        for _ in range(args.repeats + 1):  # the first round warms up
                            t0 = time.perf_counter()
                            for layer in pools:  # one call per layer, as a step makes them
                                attend(query, meta, layer, scale)
                            times.append((time.perf_counter() - t0) / layers)
                        ms, fastest = 1e3 * _median(times[1:]), 1e3 * min(times[1:])
                        print(
                            f"{gname:>8} {dname:>8} {b:4d} {ctx:7d} {layers:6d} {ms:8.4f} {fastest:8.4f} "
                            f"{layer_bytes / 1e6:8.2f} {layer_bytes / ms / 1e6:6.1f} {layer_bytes / fastest / 1e6:8.1f}",
                            flush=True,
                        )
                        del pools
                # One-token context: the fixed cost of a call (Python, ctypes, waking the threads).
                query, meta, pools = _tail_case(1, 1, heads, kvh, dim, args.block_size, dtype, 1)
                runs = {"attend": [], "kernel": []}
                for _ in range(args.repeats + 1):
                    for name, fn in (("attend", attend), ("kernel", kernel_only)):
                        t0 = time.perf_counter()
                        for _ in range(50):
                            fn(query, meta, pools[0], scale)
                        runs[name].append((time.perf_counter() - t0) / 50)
                fixed[(gname, dname)] = [1e6 * _median(runs[k][1:]) for k in ("attend", "kernel")]
    print("fixed cost of one call (one sequence, a one-token context), µs: the backend's attend, the kernel's call")
    print(f"{'geometry':>8} {'pool':>8} {'attend':>8} {'kernel':>8}")
    for (gname, dname), (a, k) in fixed.items():
        print(f"{gname:>8} {dname:>8} {a:8.1f} {k:8.1f}")


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
    ap.add_argument("--tail", action="store_true", help="the decode tail instead (1, 2, 4 sequences, long contexts)")
    ap.add_argument("--geometries", default="medium,tiny", help="--tail: comma-separated, of " + ",".join(GEOMETRIES))
    ap.add_argument("--dtypes", default="float32,bfloat16,int8", help="--tail: pool dtypes, comma-separated")
    ap.add_argument("--pool-mib", type=int, default=128, help="--tail: the per-layer pools cycled over, at most")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.tail:
        return tail(args)
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
