"""The Triton prefill kernel (variable-length query chunks over their paged context, causal) and its
launcher :func:`paged_prefill_attention`. Argument checks and the launch arguments it shares with the
decode launcher are in :mod:`.triton_launch`; the tile loop in :mod:`.triton_common`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .triton_checks import check_query_start_loc
from .triton_common import TRITON_AVAILABLE, tl, triton
from .triton_launch import _prepare_attention
from .triton_tiles import prefill_tile_config

if TRITON_AVAILABLE:
    from .triton_common import _attend_context, _store_normalized


if TRITON_AVAILABLE:

    @triton.jit
    def _paged_prefill_kernel(
        out_ptr,
        query_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        query_start_loc_ptr,
        q_strides,
        o_strides,
        k_strides,
        v_strides,
        s_strides,
        stride_bt,
        num_seqs,
        qk_scale,
        softcap,
        sliding_window,
        GROUP: tl.constexpr,
        HEADS: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        DOT_FP32: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        """Grid (T // BLOCK_Q + B, num_kv_heads * cdiv(GROUP, HEADS)). A program owns BLOCK_Q query
        tokens of one request times HEADS of the GROUP query heads of one KV head (BLOCK_M rows,
        row r = token r // HEADS, head r % HEADS of chunk ``head_chunk``; HEADS == GROUP unless the
        tile would not fit the device, see ``triton_tiles.prefill_tile_config``). Request b's tiles
        start at query_start_loc[b] // BLOCK_Q + b, which is increasing in b, so a binary search
        maps program -> request without a host-side table."""
        tile = tl.program_id(0)
        kv_head = tl.program_id(1) // tl.cdiv(GROUP, HEADS)
        head_chunk = tl.program_id(1) % tl.cdiv(GROUP, HEADS)

        # Largest b with query_start_loc[b] // BLOCK_Q + b <= tile.
        # Start from tensors (not Python ints) so the loop-carried types stay int32.
        lo_b = tile * 0
        hi_b = tile * 0 + num_seqs - 1
        while lo_b < hi_b:
            mid = (lo_b + hi_b + 1) // 2
            mid_first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
            lo_b = tl.where(mid_first_tile <= tile, mid, lo_b)
            hi_b = tl.where(mid_first_tile <= tile, hi_b, mid - 1)
        b = lo_b
        q_begin = tl.load(query_start_loc_ptr + b).to(tl.int32)
        q_len = tl.load(query_start_loc_ptr + b + 1).to(tl.int32) - q_begin
        q_tile = tile - (q_begin // BLOCK_Q + b)
        if q_tile * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        context_len = seq_len - q_len

        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        tok = q_tile * BLOCK_Q + rows // HEADS
        in_group = head_chunk * HEADS + rows % HEADS
        heads = kv_head * GROUP + in_group
        row_mask = (rows < BLOCK_Q * HEADS) & (tok < q_len) & (in_group < GROUP)
        q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
        q_rows = (q_begin + tok).to(tl.int64)
        q_ptrs = query_ptr + q_rows[:, None] * q_strides[0] + heads[:, None] * q_strides[1] + dims[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        row_pos = context_len + tok
        row_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        first_pos = context_len + q_tile * BLOCK_Q
        last_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
        start = 0
        if USE_WINDOW:
            row_lo = tl.maximum(row_pos - sliding_window + 1, 0)
            start = (tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N

        m_i, l_i, acc = _attend_context(
            q,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            k_strides,
            v_strides,
            s_strides,
            kv_head,
            block_tables_ptr + b.to(tl.int64) * stride_bt,
            start,
            last_pos + 1,
            seq_len,
            row_pos,
            row_lo,
            qk_scale,
            softcap,
            BLOCK_N,
            BLOCK_D,
            HEAD_DIM,
            BLOCK_SIZE,
            USE_SOFTCAP,
            DOT_FP32,
            QUANT,
        )
        o_ptrs = out_ptr + q_rows[:, None] * o_strides[0] + heads[:, None] * o_strides[1] + dims[None, :]
        _store_normalized(o_ptrs, acc, l_i, q_mask)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    *,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of variable-length query chunks over their paged context (FlashAttention tiling).

    Request ``b`` owns query rows ``query_start_loc[b] : query_start_loc[b + 1]``; its row ``i``
    sits at position ``seq_lens[b] - q_len_b + i`` and attends to every cached key up to and
    including that position (the cached prefix plus the chunk itself, all read through the block
    table). Serves prefill, chunked prefill, resumed requests, prefix-cache hits, and mixed
    batches in which some requests decode (a chunk of length 1) or sit out (length 0).

    Args:
        query: ``[T, num_heads, head_dim]``, fp16/bf16/fp32, same dtype as the cache.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, holding this
            step's keys/values already (see :func:`store_kv`).
        block_tables: int32 ``[B, max_blocks_per_seq]``.
        seq_lens: int32 ``[B]``, context length including this step's tokens.
        query_start_loc: int32 ``[B + 1]``, cumulative query lengths, ``query_start_loc[B] == T``.
        max_query_len: longest query chunk (host int; checked against T only).
        scale, sliding_window, softcap, out, k_scale, v_scale: as in :func:`paged_decode_attention`.

    Returns:
        ``[T, num_heads, head_dim]`` in the query dtype (``out`` when given).

    Raises:
        ValueError: a shape, dtype, device or scalar argument the kernels do not take (named).
        RuntimeError: triton is not installed.
    """
    num_tokens = query.shape[0]

    def check_prefill() -> None:
        check_query_start_loc(query_start_loc, seq_lens)
        if not isinstance(max_query_len, int) or max_query_len < 0 or max_query_len > num_tokens:
            raise ValueError(f"`max_query_len` must be an int in [0, T={num_tokens}], got {max_query_len!r}")

    out, launch = _prepare_attention(
        prefill_tile_config,
        "[T, num_heads, head_dim]",
        check_prefill,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        sliding_window,
        softcap,
        out,
        k_scale,
        v_scale,
        query_start_loc=query_start_loc,
    )
    if launch is None:
        return out
    tile, args = launch.tile, launch.kernel_args
    block_q = tile.rows // tile.heads
    grid = (num_tokens // block_q + seq_lens.shape[0], k_cache.shape[2] * triton.cdiv(args["GROUP"], tile.heads))
    _paged_prefill_kernel[grid](
        query_start_loc_ptr=query_start_loc, num_seqs=seq_lens.shape[0], BLOCK_Q=block_q, BLOCK_M=tile.rows, **args
    )
    return launch.finish()
