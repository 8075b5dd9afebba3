"""Naive paged-attention reference: the specification the kernels are tested against.

Deliberately plain: one query token at a time, each request's keys gathered position by position
through its block table, softmax over the visible keys in float32 (elementwise products and sums,
no matmul kernels). Shares no code with ``hf_contbatch.attention``.
"""

from __future__ import annotations

from typing import Optional

import torch


def reference_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[t]`` / ``value[t]`` (``[T, num_kv_heads, head_dim]``) into slot ``slot_mapping[t]``
    of ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, num_kv_heads, head_dim]``), in place,
    cast to the cache dtype. Negative slots (padding tokens) are skipped."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = value[t].to(v_cache.dtype)


def reference_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    chunk_size: Optional[int] = None,
    position_bias: Optional[torch.Tensor] = None,
    row_sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of a flattened, unpadded batch over the paged KV cache.

    Args:
        query: ``[T, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``v_cache``'s last
            dim, the V head size, may differ from the K head size).
        block_tables: ``[B, max_blocks_per_seq]``.
        seq_lens: ``[B]``, context length including this step's tokens.
        query_start_loc: ``[B + 1]``, cumulative query lengths (``arange(B + 1)`` for pure decode).
        scale: multiplies ``q . k``.
        sliding_window: a query at position ``pos`` sees keys ``max(0, pos - sliding_window + 1) .. pos``.
        softcap: scores become ``softcap * tanh(scores / softcap)``.
        chunk_size: chunked local attention: a query at position ``pos`` sees keys
            ``(pos // chunk_size) * chunk_size .. pos`` only.
        position_bias: ``[num_heads, T, max_seq_len]``: ``position_bias[h, t, j]`` is added to query
            row ``t``'s (scaled, soft-capped) score of its request's key at position ``j``, head ``h``.
        row_sinks: ``[T, num_heads]``: one more logit in row ``t``'s softmax, head ``h``, with no value
            (an attention sink per query row).

    Returns:
        ``[T, num_heads, v_head_dim]`` in the query dtype.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros((query.shape[0], num_heads, v_cache.shape[-1]), dtype=torch.float32)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_begin
        # The request's keys and values in position order, looked up through its block table, and
        # widened so that query head h sits beside its KV head h // group: [seq_len, num_heads, head_dim].
        positions = torch.arange(seq_len)
        blocks = block_tables[b, positions // block_size].long()
        keys_all = k_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        values_all = v_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        for i in range(q_len):
            pos = seq_len - q_len + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            if chunk_size is not None:
                first = max(first, pos - pos % chunk_size)
            keys, values = keys_all[first : pos + 1], values_all[first : pos + 1]  # [n, num_heads, head_dim]
            q = query[q_begin + i].float()  # [num_heads, head_dim]
            scores = (keys * q).sum(-1) * scale  # [n, num_heads]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if position_bias is not None:
                scores = scores + position_bias[:, q_begin + i, first : pos + 1].float().transpose(0, 1)
            if row_sinks is not None:
                with_sink = torch.cat([scores, row_sinks[q_begin + i].float().unsqueeze(0)], dim=0)
                probs = torch.softmax(with_sink, dim=0)[:-1]
            else:
                probs = torch.softmax(scores, dim=0)
            out[q_begin + i] = (probs.unsqueeze(-1) * values).sum(0)
    return out.to(query.dtype)
