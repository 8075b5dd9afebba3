"""int8 K/V quantization of the paged cache: symmetric, one float32 scale per token and KV head.

A token's K (or V) row of one KV head, ``x`` ``[head_size]``, is stored as
``q = round(x / s)`` in int8 (clamped to [-127, 127]) with ``s = max|x| / 127`` (float32, one per
token-head; 0 for an all-zero row, which then dequantizes to zeros), and read back as ``q * s``.
This is the per-token, per-head absmax scheme of KIVI's key/value quantization without its
grouping (Liu et al., 2024, arXiv:2402.02750) and of vLLM's per-token-head int8 KV cache;
OpenVINO GenAI keeps a zero point as well (u8 asymmetric); on the default model's held-out text a
zero point changed perplexity no more than the symmetric scheme's own cost (both within 0.02% of
the float cache, issue 32's note), so the scheme is symmetric and stores no zero point.
"""

from __future__ import annotations

import torch

QMAX = 127.0
"""Largest stored magnitude: symmetric int8 leaves -128 unused so that q and -q both exist."""


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_size]`` (any float dtype) -> (int8 ``[..., head_size]``, float32 scales
    ``[..., 1]``), computed in float32."""
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(dim=-1, keepdim=True) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x32 / safe).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 ``q`` ``[..., head_size]`` times float32 ``scale`` ``[..., 1]``, in ``dtype`` (the product
    is formed in float32, then cast)."""
    return (q.to(torch.float32) * scale).to(dtype)


def store_quantized(key, value, k_pool, v_pool, k_scale, v_scale, slot_mapping) -> None:
    """Quantize ``key``/``value`` ``[T, KVH, Dk]`` and ``[T, KVH, Dv]`` and write them and their
    scales into their slots: pools int8 ``[num_blocks, block_size, KVH, Dk]`` and ``[..., Dv]``,
    scales float32 ``[num_blocks, block_size, KVH, 1]``, ``slot_mapping`` int64 ``[T]`` on the pools' device."""
    kvh = k_pool.shape[2]
    for x, pool, scales in ((key, k_pool, k_scale), (value, v_pool, v_scale)):
        q, s = quantize_kv(x)
        pool.view(-1, kvh, pool.shape[3]).index_copy_(0, slot_mapping, q)
        scales.view(-1, kvh, 1).index_copy_(0, slot_mapping, s)
