"""Whether the compiled decode kernel or the torch path serves decode attention here: both timed
once per CPU, torch version, kernel source, thread count and model geometry by the package's one
tuner (``kernels.tuning.Tuner``, cached beside the C kernels), the faster one kept (``LLMEngine``
builds its KV pools through ``choose_decode_path``)."""

from __future__ import annotations

import time

import torch

from ..tuning import Tuner, attention_choice_key, attention_tuner
from .cpu_kernel import DECODE_SOURCE, CPUDecodeKernel
from .kv_quant import quantize_kv
from .metadata import AttentionMetadata
from .torch_paged import torch_paged_attention


def _decode_batch(
    num_seqs: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
):
    """A synthetic decode step (query, pools, metadata, scales) of ``num_seqs`` sequences of ``context``
    tokens; ``dtype`` int8: normal K/V quantized by ``kv_quant`` into int8 pools with float32 scales
    (``{"k_scale", "v_scale"}``, else ``{}``) and a float32 query.

    Quantized normal rows, as a model's K/V are stored: random int8 with arbitrary scales (what
    this built before) makes scores of hundreds, whose softmax underflows into subnormals that
    x86 computes slowly; the timing then measured something no model computes and turned the
    kernel off."""
    blocks = -(-context // block_size)
    g = torch.Generator().manual_seed(0)
    pool_shape = (num_seqs * blocks, block_size, num_kv_heads, head_dim)
    scales = {}
    if dtype == torch.int8:
        k_pool, k_scale = quantize_kv(torch.randn(pool_shape, generator=g))
        v_pool, v_scale = quantize_kv(torch.randn(pool_shape, generator=g))
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        dtype = torch.float32
    else:
        k_pool = torch.randn(pool_shape, generator=g).to(dtype)
        v_pool = torch.randn(pool_shape, generator=g).to(dtype)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(dtype)
    tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    lens = [context] * num_seqs
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.long),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=num_seqs,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc_cpu=list(range(num_seqs + 1)),
        seq_lens_cpu=lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
    )
    return query, k_pool, v_pool, meta, scales


def measure_decode_paths(
    kernel: CPUDecodeKernel, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
) -> dict[str, float]:
    """Seconds per call of the compiled kernel and of the torch path for one layer's decode
    attention (``dtype`` int8: int8 pools with scales), summed over two steps: 16 sequences of 256 tokens and 2 of 512 (a full batch and the
    tail). Minimum of 3 calls each, the two paths interleaved."""
    totals = {"kernel": 0.0, "torch": 0.0}
    for num_seqs, context in ((16, 256), (2, 512)):
        q, k, v, meta, scales = _decode_batch(num_seqs, context, num_heads, num_kv_heads, head_dim, block_size, dtype)
        best = {"kernel": float("inf"), "torch": float("inf")}
        paths = {"kernel": kernel, "torch": None}
        with torch.inference_mode():
            for _ in range(4):  # the first round warms both up
                for name, decode_kernel in paths.items():
                    meta._derived.clear()  # a step's derived tensors are built once per step, as here
                    t0 = time.perf_counter()
                    torch_paged_attention(q, k, v, meta, head_dim**-0.5, decode_kernel=decode_kernel, **scales)
                    best[name] = min(best[name], time.perf_counter() - t0)
        for name in totals:
            totals[name] += best[name]
    return totals


def choose_decode_path(
    kernel: CPUDecodeKernel, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
) -> str:
    """Turn ``kernel`` off where the torch path is faster for this geometry on this CPU (measured by
    :func:`measure_decode_paths` once per CPU, torch version and kernel build, cached beside the
    C kernels). Returns a line saying what was chosen and the times, for the engine's log."""
    if not kernel.available:
        return f"decode attention: torch path ({kernel.error or 'kernel disabled'})"
    if dtype != torch.int8 and not kernel.reads(dtype):
        kernel.enabled = False
        return f"decode attention: torch path (no {dtype} kernel in this build)"
    tuner: Tuner = attention_tuner(DECODE_SOURCE, torch.get_num_threads(), "decode attention")
    winner, times = tuner.fastest(
        attention_choice_key("decode", num_heads, num_kv_heads, head_dim, block_size, dtype),
        lambda: measure_decode_paths(kernel, num_heads, num_kv_heads, head_dim, block_size, dtype),
    )
    kernel.enabled = winner == "kernel"
    chosen = "compiled kernel" if kernel.enabled else "torch path"
    return (
        f"decode attention: {chosen} (per layer, 16 x 256 + 2 x 512 tokens: kernel {1e3 * times['kernel']:.3f} ms, "
        f"torch {1e3 * times['torch']:.3f} ms)"
    )
