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

Tiles and pipeline stages are sized per device (``_decode_config``, ``_prefill_config``) from its
compute capability and opt-in shared memory per block: ``torch.cuda.get_device_properties(i)
.shared_memory_per_block_optin`` on a device, the per-arch table ``ARCH_SHARED_MEMORY`` when
compiling ahead of time (``triton_aot``, which checks every variant for sm_75/80/86/90 without a
GPU). bfloat16 needs sm_80 or newer and is refused below.

The module imports without Triton; ``TRITON_AVAILABLE`` says whether the kernels exist. Kernels run
on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was imported.
Shapes, dtypes and devices are checked (ValueError naming the argument); the contents of the index
tensors (block ids in range, ``seq_lens`` within the block table) are the caller's contract, since
checking them would cost a device sync per call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch

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

SUPPORTED_HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # 16/32: the tiny test and default models
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)

# Query heads per KV head that one program can hold; also the row tile of the prefill kernel.
_MAX_GQA_GROUP = 64
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
    ):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:  # padding token: nothing to store
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads[:, None] * stride_kch + dims[None, :]
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads[:, None] * stride_vch + dims[None, :]
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _softcap_scores(s, softcap):
        # softcap * tanh(s / softcap), with tanh written through exp2 (no tanh in tl).
        x = s / softcap
        t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
        th = (1.0 - t) / (1.0 + t)
        return softcap * tl.where(x >= 0, th, -th)

    @triton.jit
    def _attend_tile(
        q,
        m_i,
        l_i,
        acc,
        k_cache_ptr,
        v_cache_ptr,
        block_table_row_ptr,
        stride_kcb,
        stride_kco,
        stride_kcd,
        stride_vcb,
        stride_vco,
        stride_vcd,
        kv_head_offset_k,
        kv_head_offset_v,
        start,
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
    ):
        """One online-softmax step (FlashAttention) over keys ``start .. start + BLOCK_N - 1``.

        ``row_pos`` / ``row_lo`` ([rows]) bound the keys each query row may see (causal + window).
        Scores and the running max are in the log2 domain (scaled by log2(e)) so exp2 can be used.
        Callers start the running max at -1e30, not -inf: a row with no visible key in a tile (a
        padding row, a window edge) then gets exp2(-inf - -1e30) = 0 rather than NaN.
        """
        keys = start + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        in_seq = keys < seq_len
        # Gather each key's physical block; entries past the sequence are never read.
        blocks = tl.load(block_table_row_ptr + keys // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        offsets = (keys % BLOCK_SIZE).to(tl.int64)
        kv_mask = in_seq[:, None] & (dims[None, :] < HEAD_DIM)
        k = tl.load(
            k_cache_ptr
            + kv_head_offset_k
            + blocks[:, None] * stride_kcb
            + offsets[:, None] * stride_kco
            + dims[None, :] * stride_kcd,
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + kv_head_offset_v
            + blocks[:, None] * stride_vcb
            + offsets[:, None] * stride_vco
            + dims[None, :] * stride_vcd,
            mask=kv_mask,
            other=0.0,
        )
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
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
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_kernel(
        out_ptr,
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        query_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        stride_qb,
        stride_qh,
        stride_ob,
        stride_oh,
        stride_kcb,
        stride_kco,
        stride_kch,
        stride_kcd,
        stride_vcb,
        stride_vco,
        stride_vch,
        stride_vcd,
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
    ):
        """Grid (B, num_kv_heads * cdiv(GROUP, HEADS), num_splits). One query token per request; rows
        = HEADS of the GROUP query heads sharing KV head ``kv_head`` (all of them unless the tile
        would not fit the device, see ``_decode_config``). With SPLIT, writes the unnormalised
        partial of context partition ``split`` (flash-decoding); otherwise writes the final output."""
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
        q = tl.load(
            query_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=q_mask,
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)
        row_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + pos
        row_lo = tl.zeros([BLOCK_G], dtype=tl.int32) + lo

        m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        for tile_start in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                bt_row,
                stride_kcb,
                stride_kco,
                stride_kcd,
                stride_vcb,
                stride_vco,
                stride_vcd,
                kv_head * stride_kch,
                kv_head * stride_vch,
                tile_start,
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
            )

        if SPLIT:
            # Partials are laid out [B, num_heads, num_splits(, HEAD_DIM)], contiguous.
            stat = (b * num_heads + heads).to(tl.int64) * num_splits + split
            tl.store(part_max_ptr + stat, m_i, mask=row_mask)
            tl.store(part_sum_ptr + stat, l_i, mask=row_mask)
            tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)
        else:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=q_mask,
            )

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
        block_tables_ptr,
        seq_lens_ptr,
        query_start_loc_ptr,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kcb,
        stride_kco,
        stride_kch,
        stride_kcd,
        stride_vcb,
        stride_vco,
        stride_vch,
        stride_vcd,
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
    ):
        """Grid (T // BLOCK_Q + B, num_kv_heads * cdiv(GROUP, HEADS)). A program owns BLOCK_Q query
        tokens of one request times HEADS of the GROUP query heads of one KV head (BLOCK_M rows,
        row r = token r // HEADS, head r % HEADS of chunk ``head_chunk``; HEADS == GROUP unless the
        tile would not fit the device, see ``_prefill_config``). Request b's tiles start at
        query_start_loc[b] // BLOCK_Q + b, which is increasing in b, so a binary search maps
        program -> request without a host-side table."""
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
        q = tl.load(
            query_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=q_mask,
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)
        row_pos = context_len + tok
        row_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        first_pos = context_len + q_tile * BLOCK_Q
        last_pos = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
        start = 0
        if USE_WINDOW:
            row_lo = tl.maximum(row_pos - sliding_window + 1, 0)
            start = (tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        for tile_start in range(start, last_pos + 1, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                k_cache_ptr,
                v_cache_ptr,
                bt_row,
                stride_kcb,
                stride_kco,
                stride_kcd,
                stride_vcb,
                stride_vco,
                stride_vcd,
                kv_head * stride_kch,
                kv_head * stride_vch,
                tile_start,
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
            )
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


# ----------------------------------------------------------------------------------------------
# Host side: validation, tile choice, launches.
# ----------------------------------------------------------------------------------------------


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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


def _check_index_tensor(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _INDEX_DTYPES or tensor.dim() != ndim:
        got = f"{tensor.dtype} with {tensor.dim()} dims" if isinstance(tensor, torch.Tensor) else type(tensor)
        raise ValueError(f"`{name}` must be a {ndim}-D int32 (or int64) tensor, got {got}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"`{name}` must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(cache.shape)}"
            )
        if cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"`{name}` dtype must be one of {SUPPORTED_DTYPES}, got {cache.dtype}")
        if cache.stride(-1) != 1:
            raise ValueError(f"`{name}` must be contiguous in its last (head_dim) dimension")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"`k_cache` and `v_cache` must have the same shape and dtype, got {tuple(k_cache.shape)} {k_cache.dtype} "
            f"and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"`block_size` (k_cache.shape[1]) must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")
    if head_dim not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"`head_dim` (k_cache.shape[3]) must be one of {SUPPORTED_HEAD_SIZES}, got {head_dim}")


def _check_attention_args(
    query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, out, query_name
) -> None:
    if query.dim() != 3:
        raise ValueError(f"`query` must be {query_name}, got shape {tuple(query.shape)}")
    _check_cache(k_cache, v_cache)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"`head_dim` (query.shape[2]) must be one of {SUPPORTED_HEAD_SIZES}, got {head_dim}")
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"`query` head_dim {head_dim} differs from the cache's head_dim {k_cache.shape[3]}")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"`query` dtype {query.dtype} must equal the cache dtype {k_cache.dtype}")
    if num_heads % num_kv_heads != 0 or num_heads // num_kv_heads > _MAX_GQA_GROUP:
        raise ValueError(
            f"`num_heads` (query.shape[1]={num_heads}) must be a multiple of num_kv_heads "
            f"(k_cache.shape[2]={num_kv_heads}) with at most {_MAX_GQA_GROUP} query heads per KV head"
        )
    _check_index_tensor("block_tables", block_tables, 2)
    _check_index_tensor("seq_lens", seq_lens, 1)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"`block_tables` has {block_tables.shape[0]} rows but `seq_lens` has {seq_lens.shape[0]} entries"
        )
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"`scale` must be a positive float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"`sliding_window` must be None or a positive int, got {sliding_window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"`softcap` must be None or a positive float, got {softcap!r}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(
            f"`out` must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 must not silently drop to tf32; and Triton's interpreter multiplies bf16 operands of
    # tl.dot as raw uint16 bit patterns, so under the interpreter bf16 tiles are upcast first.
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _is_interpreted())


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A kernel launch shape: ``rows`` per program (decode: BLOCK_G query heads; prefill: BLOCK_M =
    BLOCK_Q tokens x ``heads``), ``block_n`` keys per tile, ``heads`` query heads per program (the
    whole GQA group unless it had to be split), ``num_warps``, ``num_stages``, and ``shared_bytes``,
    the shared-memory estimate it was admitted with."""

    rows: int
    block_n: int
    heads: int
    num_warps: int
    num_stages: int
    shared_bytes: int


# Shared memory the compiler may add to the estimate below (reduction scratch, barriers).
_SHARED_MARGIN = 1024


def _shared_estimate(rows: int, block_n: int, block_d: int, elem_bytes: int, num_stages: int) -> int:
    """Bytes of shared memory a tile needs, an upper bound fitted to Triton 3.9's allocations for these
    kernels (``triton_aot`` measures the real figure): the K and V tiles once per pipeline stage plus
    the query tile (what the pipelined tensor-core and sm_75 paths allocate), or K, V, query and
    score tiles side by side (the unpipelined fp32 path), whichever is larger."""
    kv = 2 * block_n * block_d * elem_bytes
    q = rows * block_d * elem_bytes
    return max(num_stages * kv + q, kv + q + rows * block_n * elem_bytes)


def _tensor_cores(dtype: torch.dtype, limits: "DeviceLimits") -> bool:
    """Whether Triton lowers this dtype's ``tl.dot`` to tensor-core instructions (mma/wgmma): fp16 and
    bf16 from sm_80 on. fp32 runs in IEEE precision (never tf32) on FMA units, and on sm_75 Triton
    3.9 emits FMA for fp16 as well (checked in the PTX by ``triton_aot``)."""
    return dtype != torch.float32 and limits.capability >= (8, 0)


def _elem_bytes(dtype: torch.dtype) -> int:
    # fp32 tiles stay fp32; the interpreter's bf16 upcast is not a GPU concern.
    return torch.finfo(dtype).bits // 8


def _first_fitting(candidates, block_d: int, elem_bytes: int, limits: "DeviceLimits", what: str) -> TileConfig:
    for rows, block_n, heads, num_warps, num_stages in candidates:
        shared = _shared_estimate(rows, block_n, block_d, elem_bytes, num_stages)
        if shared + _SHARED_MARGIN <= limits.shared_memory_per_block:
            return TileConfig(rows, block_n, heads, num_warps, num_stages, shared)
    raise ValueError(
        f"no {what} tile fits the {limits.shared_memory_per_block // 1024} KiB of shared memory per block of "
        f"{limits.name}; use attention_backend='torch'"
    )


def _halvings(start: int, stop: int):
    n = start
    while n >= stop:
        yield n
        n //= 2


def _decode_config(block_d: int, group: int, dtype: torch.dtype, limits: "DeviceLimits") -> TileConfig:
    """Launch shape of the decode kernel for ``group`` query heads per KV head.

    Tensor-core path: 64 keys per tile up to 128-wide rows (32 for 256), up to 8192 / block_d heads
    per program and rows x keys <= 2048 (64 heads at head size 256, or 64 heads x 64 keys at head
    size 32, spilled 8-64 bytes per thread on sm_80/86). FMA path (fp32; everything on sm_75): at
    most 2048 / block_d keys, 4096 / block_d heads and rows x keys <= 1024 per program, so the
    score and accumulator tiles stay in registers (measured with ``triton_aot``: 64 heads x 64 keys
    spilled 276-536 bytes per thread in fp16 on sm_75). Then keys per tile, pipeline stages and heads
    per program are halved until the shared-memory estimate fits the device. ``tl.dot`` needs at
    least 16 rows, so BLOCK_G is at least 16.
    """
    if _tensor_cores(dtype, limits):
        max_n, max_heads, score_budget = (64 if block_d <= 128 else 32), min(_MAX_GQA_GROUP, 8192 // block_d), 2048
    else:
        max_n, max_heads, score_budget = max(16, min(64, 2048 // block_d)), max(16, 4096 // block_d), 1024
    heads0 = min(group, max_heads)
    candidates = []
    for h in _halvings(heads0, 1):
        rows = max(16, _next_power_of_2(h))
        for stages in (2, 1):
            for n in _halvings(max(16, min(max_n, score_budget // rows)), 16):
                candidates.append((rows, n, h, 4, stages))
    return _first_fitting(candidates, block_d, _elem_bytes(dtype), limits, "decode")


def _prefill_config(block_d: int, group: int, dtype: torch.dtype, limits: "DeviceLimits") -> TileConfig:
    """Launch shape of the prefill kernel for ``group`` query heads per KV head.

    Tensor-core path: the FlashAttention-2 shapes, 128 rows x 64 keys with 8 warps up to 128-wide
    rows, 64 x 32 with 8 warps for 256 (4 warps spilled on sm_86). FMA path (fp32; everything on sm_75): rows x block_d <= 4096,
    rows x keys <= 512 and keys x block_d <= 2048 per 4 warps, so accumulator and scores stay in registers (wider tiles
    measured 16 KB of spill stores per thread at head size 64). A group wider than the rows is
    split over programs. Then keys, stages, heads per program and rows are halved until the
    shared-memory estimate fits the device.
    """
    tensor = _tensor_cores(dtype, limits)

    def warps(rows: int) -> int:
        # 64 x 256 tensor-core tiles spilled 120-128 bytes per thread with 4 warps on sm_86, none with 8.
        return 8 if rows >= 128 or (tensor and block_d >= 256 and rows >= 64) else 4

    if tensor:
        max_rows, max_n = (128, 64) if block_d <= 128 else (64, 32)
    else:
        max_rows = max(16, min(64, 4096 // block_d))
        max_n = max(16, min(64, 512 // max_rows, 2048 // block_d))
    heads0 = min(group, max_rows)
    candidates = []
    for rows in _halvings(max_rows, 16):
        for h in _halvings(min(heads0, rows), 1):
            for stages in (2, 1):
                for n in _halvings(max_n, 16):
                    candidates.append((max(rows, _next_power_of_2(h)), n, h, warps(rows), stages))
    return _first_fitting(candidates, block_d, _elem_bytes(dtype), limits, "prefill")


def check_device_dtype(dtype: torch.dtype, limits: "DeviceLimits", name: str = "dtype") -> None:
    """Raise ValueError if the kernels cannot run ``dtype`` on the device: bfloat16 needs compute
    capability 8.0 (ptxas rejects bf16 conversions for sm_75)."""
    if dtype == torch.bfloat16 and limits.capability < (8, 0):
        raise ValueError(
            f"`{name}` is torch.bfloat16, which the Triton kernels cannot run on {limits.name}: bfloat16 needs "
            f"compute capability 8.0 (Ampere) or newer. Use torch.float16 (load the model with "
            f"torch_dtype=torch.float16, or CacheConfig(dtype='float16')), or attention_backend='torch'."
        )


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What the launchers size tiles from: ``capability`` (major, minor), ``shared_memory_per_block``
    (bytes, the opt-in per-block maximum a kernel may request), ``name`` for messages."""

    name: str
    capability: tuple
    shared_memory_per_block: int


# Opt-in shared memory per block (bytes) by compute capability (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"); used when compiling ahead of time. On a device the
# launchers read torch.cuda.get_device_properties(i).shared_memory_per_block_optin instead.
ARCH_SHARED_MEMORY = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_ARCH_NAMES = {
    75: "T4 / RTX 20xx",
    80: "A100",
    86: "A10 / RTX 30xx",
    87: "Jetson Orin",
    89: "L4 / RTX 40xx",
    90: "H100 / H200",
}


def arch_limits(arch: int) -> DeviceLimits:
    """The :class:`DeviceLimits` of compute capability ``arch`` (e.g. 75, 80, 86, 90) from the table."""
    known = [a for a in ARCH_SHARED_MEMORY if a <= arch]
    if not known:
        raise ValueError(f"`arch` must be a compute capability >= 75 (sm_75), got {arch!r}")
    return DeviceLimits(
        f"sm_{arch} ({_ARCH_NAMES.get(arch, 'unknown GPU')})", divmod(arch, 10), ARCH_SHARED_MEMORY[max(known)]
    )


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

    Reasoning (no sm_75 device was available to measure; from the compiled code and the T4's data
    sheet): Triton 3.9 lowers ``tl.dot`` for sm_75 to FMA instructions - the PTX ``triton_aot``
    compiles for sm_75 has no ``mma`` - so the kernels run at most at the T4's 8.1 TFLOPS of fp32 FMA,
    while the torch path (SDPA's memory-efficient kernel, which supports sm_75, and cuBLAS) uses its
    65 TFLOPS of fp16 tensor cores. Prefill attention is compute-bound, so the torch path has up to
    8x the throughput there. Decode is memory-bound, where the kernels read each cached byte once and
    the torch path about three times (gather, write, SDPA read); but ``tl.dot`` pads the query
    heads of a KV head to 16 rows, so the FMA decode performs ~16 FLOPs per cached byte, which at the
    T4's 320 GB/s is ~5 TFLOPS - at the FMA limit, leaving the kernels little or no margin over
    the torch path. Up to 8x slower prefill against an at best marginal decode gain decides for
    torch. ``attention_backend="triton"`` still runs the kernels there (tiles sized to fit 64 KiB).
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
    limits = _device_limits(device)
    if dtype is not None:
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not one of {SUPPORTED_DTYPES}"
        try:
            check_device_dtype(dtype, limits)
        except ValueError as e:
            return str(e)
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_SIZES:
        return f"head size {head_dim} is not one of {SUPPORTED_HEAD_SIZES}"
    if block_size is not None and block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block size {block_size} is not one of {SUPPORTED_BLOCK_SIZES}"
    group = None
    if num_heads is not None and num_kv_heads is not None:
        if num_heads % num_kv_heads or num_heads // num_kv_heads > _MAX_GQA_GROUP:
            return (
                f"{num_heads} query heads over {num_kv_heads} KV heads is not a GQA group of at most "
                f"{_MAX_GQA_GROUP} query heads per KV head"
            )
        group = num_heads // num_kv_heads
    if dtype is not None and head_dim is not None:
        try:
            for g in (group,) if group else (1, _MAX_GQA_GROUP):
                _decode_config(_next_power_of_2(head_dim), g, dtype, limits)
                _prefill_config(_next_power_of_2(head_dim), g, dtype, limits)
        except ValueError as e:
            return str(e)
    return None


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
) -> None:
    """Write this step's keys and values into their cache slots, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, fp16/bf16/fp32; cast to the cache dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 (or int32) ``[T]``; token ``t`` goes to block ``slot // block_size``,
            row ``slot % block_size``. A negative slot marks a padding token and is skipped.
    """
    _require_triton()
    _check_cache(k_cache, v_cache)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != tuple(k_cache.shape[2:]):
            raise ValueError(
                f"`{name}` must be [T, num_kv_heads={k_cache.shape[2]}, head_dim={k_cache.shape[3]}], "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"`{name}` dtype must be one of {SUPPORTED_DTYPES}, got {t.dtype}")
    _check_index_tensor("slot_mapping", slot_mapping, 1)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"`key`, `value` and `slot_mapping` must have the same number of tokens, got "
            f"{key.shape[0]}, {value.shape[0]}, {slot_mapping.shape[0]}"
        )
    _check_device({"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping})
    limits = _device_limits(k_cache.device)
    for name, dtype in (("key", key.dtype), ("value", value.dtype), ("k_cache", k_cache.dtype)):
        check_device_dtype(dtype, limits, name)
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=_next_power_of_2(head_dim),
        BLOCK_H=_next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1],
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

    Returns:
        ``[B, num_heads, head_dim]`` in the query dtype (``out`` when given).
    """
    _require_triton()
    _check_attention_args(
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
    )
    batch = query.shape[0]
    if seq_lens.shape[0] != batch:
        raise ValueError(f"`seq_lens` has {seq_lens.shape[0]} entries but `query` has {batch} tokens")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"`num_splits` must be None or a positive int, got {num_splits!r}")
    _check_device(
        {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    )
    limits = _device_limits(query.device)
    check_device_dtype(query.dtype, limits, "query")
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out

    query = _last_dim_contiguous(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = _next_power_of_2(head_dim)
    cfg = _decode_config(block_d, group, query.dtype, limits)
    block_n = cfg.block_n
    head_programs = num_kv_heads * triton.cdiv(group, cfg.heads)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = decode_num_splits(batch, head_programs, max_seq_len, query.device)
    partition_size = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_seq_len, partition_size))
    split = num_splits > 1

    target = out if out.stride(-1) == 1 else torch.empty_like(query)
    if split:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = target  # unused by the kernel
    _paged_decode_kernel[(batch, head_programs, num_splits)](
        target,
        part_acc,
        part_max,
        part_sum,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query.stride(0),
        query.stride(1),
        target.stride(0),
        target.stride(1),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        num_heads,
        num_splits,
        partition_size,
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        GROUP=group,
        HEADS=cfg.heads,
        BLOCK_G=cfg.rows,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        SPLIT=split,
        DOT_FP32=_dot_in_fp32(query.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            target,
            part_acc,
            part_max,
            part_sum,
            target.stride(0),
            target.stride(1),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=_next_power_of_2(num_splits),
        )
    if target is not out:
        out.copy_(target)
    return out


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
        scale, sliding_window, softcap, out: as in :func:`paged_decode_attention`.

    Returns:
        ``[T, num_heads, head_dim]`` in the query dtype (``out`` when given).
    """
    _require_triton()
    _check_attention_args(
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
    )
    _check_index_tensor("query_start_loc", query_start_loc, 1)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"`query_start_loc` must have B + 1 = {batch + 1} entries, got {query_start_loc.shape[0]}")
    num_tokens = query.shape[0]
    if not isinstance(max_query_len, int) or max_query_len < 0 or max_query_len > num_tokens:
        raise ValueError(f"`max_query_len` must be an int in [0, T={num_tokens}], got {max_query_len!r}")
    _check_device(
        {
            "query": query,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "query_start_loc": query_start_loc,
        }
    )
    limits = _device_limits(query.device)
    check_device_dtype(query.dtype, limits, "query")
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or batch == 0:
        return out

    query = _last_dim_contiguous(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = _next_power_of_2(head_dim)
    cfg = _prefill_config(block_d, group, query.dtype, limits)
    block_m = cfg.rows
    block_q = block_m // cfg.heads
    target = out if out.stride(-1) == 1 else torch.empty_like(query)
    grid = (num_tokens // block_q + batch, num_kv_heads * triton.cdiv(group, cfg.heads))
    _paged_prefill_kernel[grid](
        target,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        query.stride(0),
        query.stride(1),
        target.stride(0),
        target.stride(1),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        batch,
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        GROUP=group,
        HEADS=cfg.heads,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        DOT_FP32=_dot_in_fp32(query.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if target is not out:
        out.copy_(target)
    return out


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
) -> torch.Tensor:
    """Attention for one step's flattened batch: the decode kernel when every request has exactly
    one query token (``max_query_len == 1`` and ``T == B``), the prefill kernel otherwise.

    Shapes and dtypes as in :func:`paged_prefill_attention`; returns ``[T, num_heads, head_dim]``.
    """
    _check_index_tensor("query_start_loc", query_start_loc, 1)
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"`query_start_loc` must have B + 1 = {seq_lens.shape[0] + 1} entries, got {query_start_loc.shape[0]}"
        )
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
        sliding_window=sliding_window,
        softcap=softcap,
    )
