"""The Triton JIT functions the attention kernels share, and the KV store kernel.

``_attend_context`` is the tile loop of both the decode (:mod:`.triton_decode`) and the prefill
(:mod:`.triton_prefill`) kernel: the online softmax of FlashAttention over one request's keys read
through its block table row. The small helpers around it (softcapping, a K/V tile load, the
normalized store) and ``_quantize_rows`` (the int8 KV scheme of :mod:`.kv_quant`, used by
``_store_kv_kernel``) are written once here. The paged layout is described in
:mod:`.triton_kernels`. The module imports without Triton; ``TRITON_AVAILABLE`` says whether the
functions exist.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    TRITON_AVAILABLE = False


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
