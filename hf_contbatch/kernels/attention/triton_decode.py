"""The Triton decode kernel (one query token per request) and its flash-decoding reduce, with
their launcher :func:`paged_decode_attention` and the choice of context partitions
(:func:`decode_num_splits`). Argument checks and the launch arguments it shares with the prefill
launcher are in :mod:`.triton_launch`; the tile loop in :mod:`.triton_common`.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .triton_common import TRITON_AVAILABLE, tl, triton
from .triton_launch import _prepare_attention
from .triton_tiles import decode_tile_config, next_power_of_2

if TRITON_AVAILABLE:
    from .triton_common import _attend_context, _store_normalized

# Flash-decoding never makes a partition shorter than this many tokens: below it the reduce
# costs more than the parallelism gains.
_MIN_PARTITION_TOKENS = 256


if TRITON_AVAILABLE:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr,
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        query_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        q_strides,
        o_strides,
        k_strides,
        v_strides,
        s_strides,
        stride_bt,
        num_heads,
        num_splits,
        partition_size,
        qk_scale,
        softcap,
        sliding_window,
        GROUP: tl.constexpr,
        HEADS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_FP32: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        """Grid (B, num_kv_heads * cdiv(GROUP, HEADS), num_splits). One query token per request; rows
        = HEADS of the GROUP query heads sharing KV head ``kv_head`` (all of them unless the tile
        would not fit the device, see ``triton_tiles.decode_tile_config``). With SPLIT, writes the
        unnormalised partial of context partition ``split`` (flash-decoding); otherwise the output."""
        b = tl.program_id(0)
        kv_head = tl.program_id(1) // tl.cdiv(GROUP, HEADS)
        head_chunk = tl.program_id(1) % tl.cdiv(GROUP, HEADS)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        pos = seq_len - 1
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(pos - sliding_window + 1, 0)
        start = (lo // BLOCK_N) * BLOCK_N
        end = seq_len
        if SPLIT:
            start = tl.maximum(start, split * partition_size)
            # The last partition runs to seq_len, so an underestimated max_seq_len costs speed, not keys.
            if split < num_splits - 1:
                end = tl.minimum(end, (split + 1) * partition_size)

        g = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        in_group = head_chunk * HEADS + g
        heads = kv_head * GROUP + in_group
        row_mask = (g < HEADS) & (in_group < GROUP)
        q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
        q_ptrs = query_ptr + b.to(tl.int64) * q_strides[0] + heads[:, None] * q_strides[1] + dims[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
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
            end,
            seq_len,
            tl.zeros([BLOCK_G], dtype=tl.int32) + pos,
            tl.zeros([BLOCK_G], dtype=tl.int32) + lo,
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
        if SPLIT:
            # Partials are laid out [B, num_heads, num_splits(, HEAD_DIM)], contiguous.
            stat = (b * num_heads + heads).to(tl.int64) * num_splits + split
            tl.store(part_max_ptr + stat, m_i, mask=row_mask)
            tl.store(part_sum_ptr + stat, l_i, mask=row_mask)
            tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)
        else:
            o_ptrs = out_ptr + b.to(tl.int64) * o_strides[0] + heads[:, None] * o_strides[1] + dims[None, :]
            _store_normalized(o_ptrs, acc, l_i, q_mask)

    @triton.jit
    def _decode_reduce_kernel(
        out_ptr,
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        stride_ob,
        stride_oh,
        num_heads,
        num_splits,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """Grid (B, num_heads): merge the partitions' (max, sum, acc) into the softmax output."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, BLOCK_D)
        s_mask = splits < num_splits
        base = (b * num_heads + h).to(tl.int64) * num_splits
        m = tl.load(part_max_ptr + base + splits, mask=s_mask, other=-1.0e30)
        l = tl.load(part_sum_ptr + base + splits, mask=s_mask, other=0.0)
        acc = tl.load(
            part_acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
            mask=s_mask[:, None] & (dims[None, :] < HEAD_DIM),
            other=0.0,
        )
        m_max = tl.max(m, axis=0)
        w = tl.exp2(m - m_max)
        total = tl.sum(l * w, axis=0)
        o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + dims,
            o.to(out_ptr.dtype.element_ty),
            mask=dims < HEAD_DIM,
        )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target_programs(device: torch.device) -> int:
    """How many decode programs keep the device busy (used to decide on flash-decoding splits)."""
    if device.type == "cuda":
        return 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 16


def decode_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Number of context partitions the decode kernel uses (1 = single pass, no reduce).

    Splits only when ``batch_size * num_kv_heads`` programs would leave the device idle and the
    context is long enough that each partition still has at least 256 tokens (flash-decoding).
    """
    programs = batch_size * num_kv_heads
    target = _target_programs(device)
    if programs == 0 or programs >= target:
        return 1
    return max(1, min(math.ceil(max_seq_len / _MIN_PARTITION_TOKENS), math.ceil(target / programs)))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    *,
    max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one new token per request over its paged context (PagedAttention decode).

    Each program streams the context of one request block by block through the block table with
    the online softmax of FlashAttention, for all query heads of one KV head at once (GQA). When
    ``batch * num_kv_heads`` programs would underfill the device, the context is split into
    partitions processed in parallel and merged by a reduce kernel (flash-decoding).

    Args:
        query: ``[B, num_heads, head_dim]``, fp16/bf16/fp32, same dtype as the cache. Token ``b``
            is at position ``seq_lens[b] - 1`` and its K/V are already in the cache.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int32 ``[B, max_blocks_per_seq]``.
        seq_lens: int32 ``[B]``, context length including the new token (>= 1).
        scale: softmax scale applied to ``q . k``.
        sliding_window: keys at positions ``> pos - sliding_window`` only, or None.
        softcap: scores become ``softcap * tanh(scores / softcap)``, or None.
        out: optional ``[B, num_heads, head_dim]`` tensor to write into.
        max_seq_len: ``max(seq_lens)`` if the caller knows it on the host (avoids a device sync);
            default ``block_tables.shape[1] * block_size``. Only sizes the context partitions: an
            underestimate makes the last partition longer, never drops keys.
        num_splits: force the number of context partitions (1 = single pass); default automatic
            (:func:`decode_num_splits`).
        k_scale, v_scale: an int8 cache's float32 scales ``[num_blocks, block_size, num_kv_heads,
            1]`` (see :func:`store_kv`); the query is then of any supported float dtype, and each
            K/V tile is dequantized into it.

    Returns:
        ``[B, num_heads, head_dim]`` in the query dtype (``out`` when given).

    Raises:
        ValueError: a shape, dtype, device or scalar argument the kernels do not take (named).
        RuntimeError: triton is not installed.
    """
    batch = query.shape[0]

    def check_decode() -> None:
        if seq_lens.shape[0] != batch:
            raise ValueError(f"`seq_lens` has {seq_lens.shape[0]} entries but `query` has {batch} tokens")
        if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
            raise ValueError(f"`num_splits` must be None or a positive int, got {num_splits!r}")

    out, launch = _prepare_attention(
        decode_tile_config,
        "[B, num_heads, head_dim]",
        check_decode,
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
    )
    if launch is None:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    tile, args = launch.tile, launch.kernel_args
    head_programs = k_cache.shape[2] * triton.cdiv(args["GROUP"], tile.heads)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
    if num_splits is None:
        num_splits = decode_num_splits(batch, head_programs, max_seq_len, query.device)
    partition_size = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), tile.block_n) * tile.block_n
    num_splits = max(1, triton.cdiv(max_seq_len, partition_size))
    split = num_splits > 1
    if split:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = launch.target  # unused by the kernel
    _paged_decode_kernel[(batch, head_programs, num_splits)](
        part_acc_ptr=part_acc,
        part_max_ptr=part_max,
        part_sum_ptr=part_sum,
        num_heads=num_heads,
        num_splits=num_splits,
        partition_size=partition_size,
        BLOCK_G=tile.rows,
        SPLIT=split,
        **args,
    )
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            launch.target,
            part_acc,
            part_max,
            part_sum,
            launch.target.stride(0),
            launch.target.stride(1),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=args["BLOCK_D"],
            BLOCK_S=next_power_of_2(num_splits),
        )
    return launch.finish()
