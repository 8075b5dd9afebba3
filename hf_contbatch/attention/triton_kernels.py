"""Triton kernels for attention over the paged KV cache.

The paged layout is owned by the engine (``hf_contbatch.kv.paged_cache``):

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
from memory once per KV head rather than once per query head.

The module imports without Triton; ``TRITON_AVAILABLE`` says whether the kernels exist. Kernels run
on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was imported.
Shapes, dtypes and devices are checked (ValueError naming the argument); the contents of the index
tensors (block ids in range, ``seq_lens`` within the block table) are the caller's contract, since
checking them would cost a device sync per call.
"""

from __future__ import annotations

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
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kco, stride_kch,
        stride_vcb, stride_vco, stride_vch,
        num_kv_heads,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
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
        q, m_i, l_i, acc,
        k_cache_ptr, v_cache_ptr, block_table_row_ptr,
        stride_kcb, stride_kco, stride_kcd, stride_vcb, stride_vco, stride_vcd,
        kv_head_offset_k, kv_head_offset_v,
        start, seq_len, row_pos, row_lo,
        qk_scale, softcap,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
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
            k_cache_ptr + kv_head_offset_k + blocks[:, None] * stride_kcb + offsets[:, None] * stride_kco
            + dims[None, :] * stride_kcd,
            mask=kv_mask, other=0.0,
        )
        v = tl.load(
            v_cache_ptr + kv_head_offset_v + blocks[:, None] * stride_vcb + offsets[:, None] * stride_vco
            + dims[None, :] * stride_vcd,
            mask=kv_mask, other=0.0,
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
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        stride_qb, stride_qh, stride_ob, stride_oh,
        stride_kcb, stride_kco, stride_kch, stride_kcd,
        stride_vcb, stride_vco, stride_vch, stride_vcd,
        stride_bt,
        num_heads, num_splits, partition_size,
        qk_scale, softcap, sliding_window,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        """Grid (B, num_kv_heads, num_splits). One query token per request; rows = the GROUP query
        heads sharing KV head ``kv_head``. With SPLIT, writes the unnormalised partial of context
        partition ``split`` (flash-decoding); otherwise writes the final output."""
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
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
        heads = kv_head * GROUP + g
        row_mask = g < GROUP
        q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
        q = tl.load(
            query_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=q_mask, other=0.0,
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
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row,
                stride_kcb, stride_kco, stride_kcd, stride_vcb, stride_vco, stride_vcd,
                kv_head * stride_kch, kv_head * stride_vch,
                tile_start, seq_len, row_pos, row_lo, qk_scale, softcap,
                BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_SIZE, USE_SOFTCAP, DOT_FP32,
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
                acc.to(out_ptr.dtype.element_ty), mask=q_mask,
            )

    @triton.jit
    def _decode_reduce_kernel(
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        stride_ob, stride_oh, num_heads, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
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
            mask=s_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0,
        )
        m_max = tl.max(m, axis=0)
        w = tl.exp2(m - m_max)
        total = tl.sum(l * w, axis=0)
        o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + dims,
            o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM,
        )

    @triton.jit
    def _paged_prefill_kernel(
        out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kcb, stride_kco, stride_kch, stride_kcd,
        stride_vcb, stride_vco, stride_vch, stride_vcd,
        stride_bt, num_seqs,
        qk_scale, softcap, sliding_window,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
    ):
        """Grid (T // BLOCK_Q + B, num_kv_heads). A program owns BLOCK_Q query tokens of one request
        times the GROUP query heads of one KV head (BLOCK_M rows, row r = token r // GROUP, head
        r % GROUP). Request b's tiles start at query_start_loc[b] // BLOCK_Q + b, which is
        increasing in b, so a binary search maps program -> request without a host-side table."""
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)

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
        tok = q_tile * BLOCK_Q + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        row_mask = (rows < BLOCK_Q * GROUP) & (tok < q_len)
        q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
        q_rows = (q_begin + tok).to(tl.int64)
        q = tl.load(
            query_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=q_mask, other=0.0,
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
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row,
                stride_kcb, stride_kco, stride_kcd, stride_vcb, stride_vco, stride_vcd,
                kv_head * stride_kch, kv_head * stride_vch,
                tile_start, seq_len, row_pos, row_lo, qk_scale, softcap,
                BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_SIZE, USE_SOFTCAP, DOT_FP32,
            )
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            acc.to(out_ptr.dtype.element_ty), mask=q_mask,
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
            "hf_contbatch.attention.triton_kernels needs the `triton` package, which is not installed; "
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
            "before importing hf_contbatch.attention.triton_kernels, or use the plain-torch attention path"
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


def _keys_per_tile(block_d: int, dtype: torch.dtype) -> int:
    """BLOCK_N: K and V tiles, double-buffered (num_stages=2), stay within 64 KiB of shared memory."""
    row_bytes = block_d * torch.finfo(dtype).bits // 8
    return max(16, min(64, (64 * 1024) // (4 * row_bytes)))


def _prefill_rows_and_warps(block_d: int, dtype: torch.dtype) -> tuple:
    """(BLOCK_M query rows per prefill program, num_warps): the FlashAttention-2 shapes for <= 128
    bf16/fp16 dims, smaller for wider rows (head_dim 256, fp32) so shared memory stays under ~100 KiB."""
    row_bytes = block_d * torch.finfo(dtype).bits // 8
    if row_bytes <= 256:
        return 128, 8
    return (64, 4) if row_bytes <= 512 else (32, 4)


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
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=_next_power_of_2(head_dim), BLOCK_H=_next_power_of_2(num_kv_heads),
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
        query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, out,
        "[B, num_heads, head_dim]",
    )
    batch = query.shape[0]
    if seq_lens.shape[0] != batch:
        raise ValueError(f"`seq_lens` has {seq_lens.shape[0]} entries but `query` has {batch} tokens")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"`num_splits` must be None or a positive int, got {num_splits!r}")
    _check_device({"query": query, "k_cache": k_cache, "v_cache": v_cache,
                   "block_tables": block_tables, "seq_lens": seq_lens})
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out

    query = _last_dim_contiguous(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = _next_power_of_2(head_dim)
    block_n = _keys_per_tile(block_d, query.dtype)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_seq_len, query.device)
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
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        target, part_acc, part_max, part_sum,
        query, k_cache, v_cache, block_tables, seq_lens,
        query.stride(0), query.stride(1), target.stride(0), target.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        num_heads, num_splits, partition_size,
        float(scale), float(softcap or 0.0), int(sliding_window or 0),
        GROUP=group, BLOCK_G=max(16, _next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None, SPLIT=split,
        DOT_FP32=_dot_in_fp32(query.dtype),
        num_warps=4, num_stages=2,
    )
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            target, part_acc, part_max, part_sum,
            target.stride(0), target.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=_next_power_of_2(num_splits),
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
        query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, out,
        "[T, num_heads, head_dim]",
    )
    _check_index_tensor("query_start_loc", query_start_loc, 1)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"`query_start_loc` must have B + 1 = {batch + 1} entries, got {query_start_loc.shape[0]}"
        )
    num_tokens = query.shape[0]
    if not isinstance(max_query_len, int) or max_query_len < 0 or max_query_len > num_tokens:
        raise ValueError(f"`max_query_len` must be an int in [0, T={num_tokens}], got {max_query_len!r}")
    _check_device({"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
                   "seq_lens": seq_lens, "query_start_loc": query_start_loc})
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or batch == 0:
        return out

    query = _last_dim_contiguous(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = _next_power_of_2(head_dim)
    block_n = _keys_per_tile(block_d, query.dtype)
    block_m, num_warps = _prefill_rows_and_warps(block_d, query.dtype)
    block_m = max(block_m, _next_power_of_2(group))
    block_q = block_m // group
    target = out if out.stride(-1) == 1 else torch.empty_like(query)
    grid = (num_tokens // block_q + batch, num_kv_heads)
    _paged_prefill_kernel[grid](
        target, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        query.stride(0), query.stride(1), target.stride(0), target.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), batch,
        float(scale), float(softcap or 0.0), int(sliding_window or 0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
        DOT_FP32=_dot_in_fp32(query.dtype),
        num_warps=num_warps, num_stages=2,
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
            query, k_cache, v_cache, block_tables, seq_lens, scale,
            sliding_window=sliding_window, softcap=softcap,
        )
    return paged_prefill_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
        sliding_window=sliding_window, softcap=softcap,
    )
