"""Triton kernels for attention over the paged KV cache.

The paged layout is owned by the engine (``hf_contbatch.kernels.paged_cache``):

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer.
* ``slot_mapping``: int64 ``[T]``, flat slot ``block_id * block_size + offset`` of each new token.
* ``block_tables``: int32 ``[B, max_blocks_per_seq]``; entry ``j`` of row ``b`` holds the block of
  request ``b``'s tokens ``j * block_size .. (j + 1) * block_size - 1``.
* ``seq_lens``: int32 ``[B]``, context length of each request INCLUDING this step's tokens, which are
  already in the cache when attention runs.
* ``query_start_loc``: int32 ``[B + 1]``, cumulative query lengths of the flattened, unpadded batch.

Algorithms: the tiled online softmax of FlashAttention (Dao et al., 2022, arXiv:2205.14135) read
through a block table as in vLLM's PagedAttention (Kwon et al., SOSP 2023, arXiv:2309.06180), and
for long contexts with few requests the split-context reduction of flash-decoding (Dao, Haziza,
Massa, Sizov, 2023, "Flash-Decoding for long-context inference").

Every kernel gathers keys token by token (``block_tables[b, n // block_size]``), so a key tile is
independent of the block size: any power-of-two block size >= 8 works with the same tile shapes.
All query heads that share a KV head are processed by one program (GQA), so each K/V tile is read
from memory once per KV head rather than once per query head - unless the tile would not fit the
device, when the group is split over a few programs.

The decode and the prefill kernel differ in the query rows a program holds and the keys each row
may see, and share the tile loop (``_attend_context``); their launchers share the launch arguments
(``_prepare_attention``). Tiles are sized per device (:mod:`.triton_tiles`) from its compute
capability and shared memory per block, read from the device or, when compiling ahead of time
(``triton_aot``: sm_75/80/86/90 without a GPU), from a per-arch table. bfloat16 needs sm_80.

The module imports without Triton; ``TRITON_AVAILABLE`` says whether the kernels exist. Kernels run
on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was imported.
Arguments are checked on the host (:mod:`hf_contbatch.kernels.attention.triton_checks`), ValueError
naming the argument.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch

from .triton_checks import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    check_attention_args,
    check_query_start_loc,
    check_store_args,
    unsupported_shape_reason,
)
from .triton_tiles import (
    ARCH_SHARED_MEMORY,
    DeviceLimits,
    TileConfig,
    arch_limits,
    check_device_dtype,
    decode_tile_config,
    next_power_of_2,
    prefill_tile_config,
)

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    TRITON_AVAILABLE = False

__all__ = [
    "TRITON_AVAILABLE",
    "SUPPORTED_HEAD_SIZES",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_attention",
    "decode_num_splits",
    "DeviceLimits",
    "ARCH_SHARED_MEMORY",
    "arch_limits",
    "check_device_dtype",
    "prefers_torch",
    "unsupported_reason",
]

# Flash-decoding never makes a partition shorter than this many tokens: below it the reduce
# costs more than the parallelism gains.
_MIN_PARTITION_TOKENS = 256


if TRITON_AVAILABLE:

    @triton.jit
    def _store_kv_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        k_scale_ptr,
        v_scale_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kcb,
        stride_kco,
        stride_kch,
        stride_vcb,
        stride_vco,
        stride_vch,
        num_kv_heads,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        # QUANT: int8 caches; each (token, KV head) row is stored as round(x / s), s = absmax / 127,
        # with s at k/v_scale_ptr[slot * num_kv_heads + head] (kv_quant's scheme).
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:  # padding token: nothing to store
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
        v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads[:, None] * stride_kch + dims[None, :]
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads[:, None] * stride_vch + dims[None, :]
        if QUANT:
            k, k_s = _quantize_rows(k)
            v, v_s = _quantize_rows(v)
            head_mask = heads < num_kv_heads
            tl.store(k_scale_ptr + slot * num_kv_heads + heads, k_s, mask=head_mask)
            tl.store(v_scale_ptr + slot * num_kv_heads + heads, v_s, mask=head_mask)
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_rows(x):
        # x [heads, dims] (masked entries 0) -> (int8-valued rows, float32 scales [heads]): round
        # half away from zero (float -> int conversion truncates), clamped to [-127, 127].
        x = x.to(tl.float32)
        s = tl.max(tl.abs(x), axis=1) / 127.0
        r = x / tl.where(s > 0, s, 1.0)[:, None]
        r = tl.where(r >= 0, r + 0.5, r - 0.5).to(tl.int32)
        r = tl.minimum(tl.maximum(r, -127), 127)
        return r.to(tl.int8), s

    @triton.jit
    def _softcap_scores(s, softcap):
        # softcap * tanh(s / softcap), with tanh written through exp2 (no tanh in tl).
        x = s / softcap
        t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
        th = (1.0 - t) / (1.0 + t)
        return softcap * tl.where(x >= 0, th, -th)

    @triton.jit
    def _load_kv_tile(head_ptr, blocks, offsets, dims, strides, mask):
        # [BLOCK_N, BLOCK_D] keys or values of one KV head; the cache's strides: (block, offset, head, dim).
        ptrs = head_ptr + blocks[:, None] * strides[0] + offsets[:, None] * strides[1] + dims[None, :] * strides[3]
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _store_normalized(out_ptrs, acc, l_i, mask):
        # The softmax output: the accumulator over the sum of weights (rows without keys stay 0).
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _attend_context(
        q,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        k_strides,
        v_strides,
        s_strides,
        kv_head,
        block_table_row_ptr,
        start,
        end,
        seq_len,
        row_pos,
        row_lo,
        qk_scale,
        softcap,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        DOT_FP32: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        """The tile loop of both attention kernels: the online softmax of FlashAttention over keys
        ``start .. end - 1`` of one request, BLOCK_N keys a tile, read through its block table row.

        ``q`` [rows, BLOCK_D] holds the query rows of KV head ``kv_head``; ``k_strides`` / ``v_strides``
        are the caches' (block, offset, head, dim) strides.
        ``row_pos`` / ``row_lo`` ([rows]) bound the keys each row may see (causal + window). Scores
        and the running max are in the log2 domain (scaled by log2(e)) so exp2 can be used. The
        running max starts at -1e30, not -inf: a row with no visible key in a tile (a padding row, a
        window edge) then gets exp2(-inf - -1e30) = 0 rather than NaN. Returns the running max and
        sum ([rows] fp32) and the unnormalised output ([rows, BLOCK_D] fp32).
        QUANT: int8 caches; K/V tiles are widened to the query's dtype, the scores multiplied by
        their keys' scales and the softmax weights by their values' scales (``s_strides``: the
        scales' (block, offset, head) strides).
        """
        if DOT_FP32:
            q = q.to(tl.float32)
        k_head_ptr = k_cache_ptr + kv_head * k_strides[2]
        v_head_ptr = v_cache_ptr + kv_head * v_strides[2]
        m_i = tl.zeros(row_pos.shape, dtype=tl.float32) - 1.0e30
        l_i = tl.zeros(row_pos.shape, dtype=tl.float32)
        acc = tl.zeros([row_pos.shape[0], BLOCK_D], dtype=tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            dims = tl.arange(0, BLOCK_D)
            in_seq = keys < seq_len
            # Gather each key's physical block; entries past the sequence are never read.
            blocks = tl.load(block_table_row_ptr + keys // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
            offsets = (keys % BLOCK_SIZE).to(tl.int64)
            kv_mask = in_seq[:, None] & (dims[None, :] < HEAD_DIM)
            k = _load_kv_tile(k_head_ptr, blocks, offsets, dims, k_strides, kv_mask)
            v = _load_kv_tile(v_head_ptr, blocks, offsets, dims, v_strides, kv_mask)
            if QUANT:
                # int8 -> the query's dtype is exact (|x| <= 127); the token scales multiply the scores
                # (keys) and the softmax weights (values), never a whole tile: no float32 tile in registers.
                at = blocks * s_strides[0] + offsets * s_strides[1] + kv_head * s_strides[2]
                k_s = tl.load(k_scale_ptr + at, mask=in_seq, other=0.0)
                v_s = tl.load(v_scale_ptr + at, mask=in_seq, other=0.0)
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if QUANT:
                s = s * k_s[None, :]
            if USE_SOFTCAP:
                s = _softcap_scores(s * qk_scale, softcap) * 1.4426950408889634
            else:
                s = s * (qk_scale * 1.4426950408889634)
            visible = (keys[None, :] <= row_pos[:, None]) & (keys[None, :] >= row_lo[:, None]) & in_seq[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if QUANT:
                p = p * v_s[None, :]
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return m_i, l_i, acc

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


# --- host side: device checks, tile choice, launches ------------------------------------------


def _is_interpreted() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_paged_decode_kernel).__name__ == "InterpretedFunction"


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            "hf_contbatch.kernels.attention.triton_kernels needs the `triton` package, which is not installed; "
            "use the plain-torch attention path instead."
        )


def _check_device(tensors: dict) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(
            "all tensors must be on one device, got "
            + ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        )
    device = devices.pop()
    if device.type != "cuda" and not _is_interpreted():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got tensors on {device}); on CPU set TRITON_INTERPRET=1 "
            "before importing hf_contbatch.kernels.attention.triton_kernels, or use the plain-torch attention path"
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 must not silently drop to tf32; and Triton's interpreter multiplies bf16 operands of
    # tl.dot as raw uint16 bit patterns, so under the interpreter bf16 tiles are upcast first.
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _is_interpreted())


@dataclasses.dataclass(frozen=True)
class _AttentionLaunch:
    """What both attention launchers derive from their checked arguments: the tile, the tensor the
    kernel writes (``out``, or a stand-in contiguous in head_dim that :meth:`finish` copies back),
    and ``kernel_args``, the keyword arguments the decode and the prefill kernel share."""

    tile: TileConfig
    out: torch.Tensor
    target: torch.Tensor
    kernel_args: dict

    def finish(self) -> torch.Tensor:
        if self.target is not self.out:
            self.out.copy_(self.target)
        return self.out


def _prepare_attention(
    tile_config,
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    sliding_window,
    softcap,
    out,
    k_scale=None,
    v_scale=None,
    **index_tensors,
) -> tuple[torch.Tensor, Optional[_AttentionLaunch]]:
    """Device checks, the output tensor and the launch of an attention kernel whose arguments passed
    :func:`check_attention_args`. Returns ``(out, launch)``; launch is None for an empty batch
    (nothing to run). ``tile_config``: ``decode_tile_config`` or ``prefill_tile_config``;
    ``k_scale``/``v_scale``: the scales of an int8 cache (None for a float one)."""
    tensors = {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    if k_scale is not None:
        tensors.update(k_scale=k_scale, v_scale=v_scale)
    _check_device({**tensors, "seq_lens": seq_lens, **index_tensors})
    limits = _device_limits(query.device)
    check_device_dtype(query.dtype, limits, "query")
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out, None
    query = _last_dim_contiguous(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    block_d = next_power_of_2(head_dim)
    tile = tile_config(block_d, num_heads // num_kv_heads, query.dtype, limits)
    if k_scale is not None and tile_config is prefill_tile_config and tile.block_n > 32 and tile.rows >= 128:
        # The int8 tile's conversions and scale vectors cost registers: 128 x 64 tiles spilled on
        # sm_80 (triton_aot); 128 x 32 keeps them in registers.
        tile = dataclasses.replace(tile, block_n=32)
    target = out if out.stride(-1) == 1 else torch.empty_like(query)
    kernel_args = dict(
        out_ptr=target,
        query_ptr=query,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        # A float cache passes its own pools as the (unread) scale pointers.
        k_scale_ptr=k_cache if k_scale is None else k_scale,
        v_scale_ptr=v_cache if v_scale is None else v_scale,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        q_strides=query.stride()[:2],
        o_strides=target.stride()[:2],
        k_strides=k_cache.stride(),
        v_strides=v_cache.stride(),
        s_strides=(k_cache.stride()[:3] if k_scale is None else k_scale.stride()[:3]),
        stride_bt=block_tables.stride(0),
        qk_scale=float(scale),
        softcap=float(softcap or 0.0),
        sliding_window=int(sliding_window or 0),
        GROUP=num_heads // num_kv_heads,
        HEADS=tile.heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=tile.block_n,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        DOT_FP32=_dot_in_fp32(query.dtype),
        QUANT=k_scale is not None,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out, _AttentionLaunch(tile, out, target, kernel_args)


@functools.cache
def _cuda_limits(device_index: int) -> DeviceLimits:
    props = torch.cuda.get_device_properties(device_index)
    return DeviceLimits(
        f"{props.name} (sm_{props.major}{props.minor})",
        (props.major, props.minor),
        int(props.shared_memory_per_block_optin),
    )


def _device_limits(device: torch.device) -> DeviceLimits:
    """Limits of ``device``; under the interpreter (CPU tensors) those of sm_80, whose tiles the CPU
    tests then exercise (tests substitute other archs' limits to run their tiles)."""
    if device.type == "cuda":
        return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())
    return arch_limits(80)


def prefers_torch(device: torch.device) -> bool:
    """Whether ``attention_backend="auto"`` takes the torch path on ``device``: on CUDA devices below
    compute capability 8.0 (T4, RTX 20xx).

    Why (from the compiled code and the data sheets): Triton 3.9 lowers ``tl.dot`` for sm_75 to FMA
    instructions (no ``mma`` in the PTX ``triton_aot`` compiles), while the torch path (SDPA's
    memory-efficient kernel, cuBLAS) runs on the fp16 tensor cores, several times the FMA
    throughput: compute-bound prefill is much faster there. Memory-bound decode gains little from
    the kernels, since ``tl.dot`` pads a KV head's query heads to 16 rows, which reaches the FMA
    limit. ``attention_backend="triton"`` still runs the kernels there (tiles sized to fit 64 KiB).
    """
    return device.type == "cuda" and _device_limits(device).capability < (8, 0)


def unsupported_reason(
    device: torch.device,
    dtype: Optional[torch.dtype] = None,
    head_dim: Optional[int] = None,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    block_size: Optional[int] = None,
) -> Optional[str]:
    """Why the kernels cannot serve a cache of this shape on ``device`` (None when they can).

    Arguments left None are not checked. Covers dtype (and bfloat16 below sm_80), head size, block
    size, GQA group, and whether decode and prefill tiles fit the device's shared memory.
    """
    if not TRITON_AVAILABLE:
        return "triton is not installed"
    return unsupported_shape_reason(_device_limits(device), dtype, head_dim, num_heads, num_kv_heads, block_size)


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


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Write this step's keys and values into their cache slots, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, fp16/bf16/fp32; cast to the cache dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 (or int32) ``[T]``; token ``t`` goes to block ``slot // block_size``,
            row ``slot % block_size``. A negative slot marks a padding token and is skipped.
        k_scale, v_scale: for int8 caches, contiguous float32 ``[num_blocks, block_size,
            num_kv_heads, 1]``: each token-head row is quantized (``kv_quant``'s scheme: scale =
            absmax / 127, rounded half away from zero) and its scale written here.
    """
    _require_triton()
    check_store_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens = key.shape[0]
    tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    if k_scale is not None:
        if not (k_scale.is_contiguous() and v_scale.is_contiguous()):
            raise ValueError("`k_scale` and `v_scale` must be contiguous")
        tensors.update(k_scale=k_scale, v_scale=v_scale)
    _check_device(tensors)
    limits = _device_limits(k_cache.device)
    checked = (("key", key.dtype), ("value", value.dtype)) + ((("k_cache", k_cache.dtype),) if k_scale is None else ())
    for name, dtype in checked:
        check_device_dtype(dtype, limits, name)
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    strides = key.stride()[:2] + value.stride()[:2] + k_cache.stride()[:3] + v_cache.stride()[:3]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,
        *strides,
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1],
        QUANT=k_scale is not None,
    )


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
    _require_triton()
    check_attention_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        sliding_window,
        softcap,
        out,
        "[B, num_heads, head_dim]",
        k_scale,
        v_scale,
    )
    batch = query.shape[0]
    if seq_lens.shape[0] != batch:
        raise ValueError(f"`seq_lens` has {seq_lens.shape[0]} entries but `query` has {batch} tokens")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"`num_splits` must be None or a positive int, got {num_splits!r}")
    out, launch = _prepare_attention(
        decode_tile_config,
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
    _require_triton()
    check_attention_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        sliding_window,
        softcap,
        out,
        "[T, num_heads, head_dim]",
        k_scale,
        v_scale,
    )
    check_query_start_loc(query_start_loc, seq_lens)
    num_tokens = query.shape[0]
    if not isinstance(max_query_len, int) or max_query_len < 0 or max_query_len > num_tokens:
        raise ValueError(f"`max_query_len` must be an int in [0, T={num_tokens}], got {max_query_len!r}")
    out, launch = _prepare_attention(
        prefill_tile_config,
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


def paged_attention(
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
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention for one step's flattened batch: the decode kernel when every request has exactly
    one query token (``max_query_len == 1`` and ``T == B``), the prefill kernel otherwise.

    Shapes and dtypes as in :func:`paged_prefill_attention` (``k_scale``/``v_scale``: an int8
    cache's scales); returns ``[T, num_heads, head_dim]``.
    """
    check_query_start_loc(query_start_loc, seq_lens)
    if max_query_len == 1 and query.dim() == 3 and query.shape[0] == seq_lens.shape[0]:
        return paged_decode_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        scale,
        sliding_window,
        softcap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
