"""Plain-torch paged attention over a flattened, unpadded batch (the CPU path and the reference
the Triton kernels slot in beside).

Decode requests (one query token) are served in one batched ``scaled_dot_product_attention`` call
over their gathered pages; prefill chunks (variable length, with a cached prefix) are served one
request at a time with a bottom-right-aligned causal mask. Masks and gather indices are built once
per step and shared by all layers through ``AttentionMetadata.derived``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..kv.paged_cache import AttentionMetadata


def _attend(q, k, v, mask, scale: float, softcap: Optional[float], is_causal: bool = False):
    """q ``[B, H, Lq, D]``, k/v ``[B, KVH, Lk, D]``, mask bool broadcastable to ``[B, H, Lq, Lk]``."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal and mask is None,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif is_causal:
        lq, lk = scores.shape[-2:]
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def _decode_gather(meta: AttentionMetadata, sliding_window: Optional[int]):
    """Slot indices ``[Bd * L]`` and key mask ``[Bd, 1, 1, L]`` for the decode requests."""
    nd = meta.num_decodes
    seq_lens = meta.seq_lens[:nd].to(torch.long)
    max_len = max(meta.seq_lens_cpu[:nd])
    num_blocks = -(-max_len // meta.block_size)
    tables = meta.block_tables[:nd, :num_blocks].to(torch.long)
    offsets = torch.arange(meta.block_size, device=tables.device)
    slots = (tables.unsqueeze(-1) * meta.block_size + offsets).reshape(nd, -1)[:, :max_len]
    pos = torch.arange(max_len, device=tables.device)
    mask = pos.unsqueeze(0) < seq_lens.unsqueeze(1)
    if sliding_window is not None:
        mask &= pos.unsqueeze(0) > (seq_lens.unsqueeze(1) - 1 - sliding_window)
    return slots.reshape(-1), mask[:, None, None, :], max_len


def _prefill_gather(meta: AttentionMetadata, i: int, sliding_window: Optional[int]):
    """Slot indices ``[S]`` of request ``i``'s context and its mask ``[Lq, S]`` (None = plain causal)."""
    seq_len = meta.seq_lens_cpu[i]
    q_len = meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
    num_blocks = -(-seq_len // meta.block_size)
    table = meta.block_tables[i, :num_blocks].to(torch.long)
    offsets = torch.arange(meta.block_size, device=table.device)
    slots = (table.unsqueeze(-1) * meta.block_size + offsets).reshape(-1)[:seq_len]
    if sliding_window is None and q_len == seq_len:
        return slots, None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=table.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=table.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return slots, mask


def torch_paged_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention of every query token over its request's paged context.

    Args:
        query: ``[T, H, D]``, this step's query rows (decodes first, then prefill chunks).
        k_pool, v_pool: ``[num_blocks, block_size, KVH, D]`` (already holding this step's K/V).
        meta: the step's metadata.
        scale: softmax scale (usually ``D ** -0.5``).
        sliding_window: keys further than this many positions back are masked (Mistral, Gemma 2).
        softcap: logit soft-capping ``softcap * tanh(s / softcap)`` (Gemma 2).

    Returns:
        ``[T, H, D]`` in the query dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    kvh = k_pool.shape[2]
    flat_k = k_pool.view(-1, kvh, head_dim)
    flat_v = v_pool.view(-1, kvh, head_dim)
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        slots, mask, max_len = meta.derived(("decode", sliding_window), lambda: _decode_gather(meta, sliding_window))
        k = flat_k.index_select(0, slots).view(nd, max_len, kvh, head_dim).transpose(1, 2)
        v = flat_v.index_select(0, slots).view(nd, max_len, kvh, head_dim).transpose(1, 2)
        q = query[:nd].unsqueeze(2)  # [Bd, H, 1, D]
        o = _attend(q, k.to(query.dtype), v.to(query.dtype), mask, scale, softcap)
        out[:nd] = o.squeeze(2)
    for i in range(nd, meta.num_requests):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        slots, mask = meta.derived(("prefill", i, sliding_window), lambda: _prefill_gather(meta, i, sliding_window))
        k = flat_k.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(query.dtype)
        v = flat_v.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(query.dtype)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        o = _attend(q, k, v, mask, scale, softcap, is_causal=mask is None)
        out[start:end] = o[0].transpose(0, 1)
    return out
