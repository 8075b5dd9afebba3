"""Plain-torch paged attention over a flattened, unpadded batch (the CPU path and the reference
the Triton kernels slot in beside).

Decode requests (one query token) are served in batches of similar context length: scores by one
matmul over their gathered keys, the weighted sum of values by ``F.embedding_bag`` reading the value
pages in place; prefill chunks (variable length, with a cached prefix) are served one
request at a time with a bottom-right-aligned causal mask. Masks and gather indices are built once
per step and shared by all layers through ``AttentionMetadata.derived``.

K and V heads may differ in size (``Dk`` channels per K head, ``Dv`` per V head: MiMo-V2-Flash):
scores read ``Dk``, the output has ``Dv`` channels. :func:`context_attention` serves layers whose
model expands each request's whole context itself (multi-head latent attention as transformers
computes it: ``kernels.paged_cache.PagedCacheStep.update`` returns the stored latents).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def _with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None, head_shape: tuple) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores`` ``[B, *head_shape-ish, L]`` with one more logit
    per head, ``sinks`` ``[H]`` viewed as ``head_shape`` (``(H, 1)`` for ``[B, H, Lq, L]``, ``(KVH,
    G)`` for decode's ``[b, KVH, G, L]``): gpt-oss's attention sinks, which take probability mass
    and contribute no value, so their column is dropped after the softmax. Plain softmax where
    ``sinks`` is None. ``sinks`` of more than one dimension are per query row too (Inkling 2's),
    already shaped to broadcast against ``scores[..., :1]`` (``head_shape`` unused)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    shaped = sinks if sinks.dim() > 1 else sinks.view(*head_shape, 1)
    sink = shaped.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _attend(q, k, v, mask, scale: float, softcap: float | None, is_causal: bool = False, sinks=None, bias=None):
    """q ``[B, H, Lq, D]``, k/v ``[B, KVH, Lk, D]``, mask bool broadcastable to ``[B, H, Lq, Lk]``;
    ``sinks`` ``[H]``, ``[B, H, Lq, 1]`` or None (see :func:`_with_sinks`); ``bias`` float
    ``[B, H, Lq, Lk]`` added to the scaled (and soft-capped) scores of the visible keys, or None."""
    if bias is not None and softcap is None and sinks is None:
        # The call transformers' SDPA attention makes for a model passing ``position_bias``: K/V
        # heads repeated, the bias where keys are visible and the dtype's minimum elsewhere, as one
        # additive mask.
        if mask is None and is_causal:
            lq, lk = q.shape[-2], k.shape[-2]
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        bias = bias.to(q.dtype)
        additive = bias if mask is None else torch.where(mask, bias, torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            scale=scale,
            is_causal=is_causal and mask is None,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif is_causal:
        lq, lk = scores.shape[-2:]
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        scores = scores.masked_fill(~causal, float("-inf"))
    probs = _with_sinks(scores, sinks, (q.shape[1], 1)).to(v.dtype)
    return torch.matmul(probs, v)


def _decode_probs(q, k, bias, scale: float, softcap: float | None, sinks=None):
    """One query token per request: q ``[b, H, D]``, k ``[b, KVH, L, D]`` (gathered keys), bias
    ``[b, 1, 1, L]`` additive (or None). Returns the float32 softmax weights ``[b, KVH, G, L]``.

    Scores are plain matmuls with the query heads of a KV group stacked as rows (no K repeat for
    GQA); on CPU this is faster than ``scaled_dot_product_attention`` with a mask at one query
    token, which takes a slow masked path.
    """
    b, num_heads, head_dim = q.shape
    kvh = k.shape[1]
    qg = q.view(b, kvh, num_heads // kvh, head_dim).to(k.dtype).contiguous()
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(scale)  # [b, KVH, G, L]
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if bias is not None:
        scores.add_(bias)
    return _with_sinks(scores, sinks, (kvh, num_heads // kvh))


def _gather_rows(rows: torch.Tensor, row_scales: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype):
    """Rows ``index`` of a pool viewed as ``[n, ...]``, in ``dtype``; an int8 pool's rows times their
    scales (``row_scales`` viewed likewise, ``[n, ..., 1]``), dequantized in float32 first."""
    picked = rows.index_select(0, index)
    if row_scales is not None:
        picked = picked.to(torch.float32) * row_scales.index_select(0, index)
    return picked.to(dtype)


def _decode_buckets(
    meta: AttentionMetadata,
    sliding_window: int | None,
    groups: int,
    kvh: int,
    chunk_size: int | None = None,
    head_maps: tuple | None = None,
):
    """Gather plans for the decode requests, grouped by context length to bound padding; keys before
    the query's chunk (``chunk_size``, see :func:`torch_paged_attention`) or window are masked.

    Returns a list of ``(rows, head_index, value_index, bag_index, bag_offsets, mask, length)``:
    ``rows`` the decode rows of the bucket, ``head_index`` ``[b * KVH * L]`` indices into the pool
    viewed as ``[slots * KVH, D]`` in ``[b, KVH, L]`` order (so one ``index_select`` yields the
    contiguous ``[b, KVH, L, D]`` keys), ``value_index`` the same for the values (``head_index``
    itself unless ``head_maps`` differ), ``bag_index`` the value rows repeated for the ``groups``
    query heads of each KV head (``[b * KVH * groups * L]``, the value rows of each (request, query
    head) bag), ``bag_offsets`` the start of each bag, ``mask`` ``[b, 1, 1, L]`` additive (None
    when no key is masked). With ``head_maps`` (see :func:`torch_paged_attention`) KVH is the
    number of heads the maps list.
    """
    nd = meta.num_decodes
    lens = meta.seq_lens_cpu[:nd]
    order = sorted(range(nd), key=lens.__getitem__)
    buckets: list[list[int]] = []
    for i in order:
        # Start a new bucket when this context is much longer than the bucket's shortest: padding
        # then stays under about half of the gathered keys; tiny buckets are not worth a call.
        if buckets and not (lens[i] > 2 * lens[buckets[-1][0]] and len(buckets[-1]) >= 8 and len(buckets) < 4):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    if len(buckets) == 1:
        buckets = [list(range(nd))]  # keep batch order so the caller can skip the scatter
    plans = []
    device = meta.block_tables.device
    offsets = torch.arange(meta.block_size, device=device)
    if head_maps is None:
        key_heads = value_heads = torch.arange(kvh, device=device).view(1, kvh, 1)
    else:
        key_heads, value_heads = (torch.tensor(m, device=device).view(1, len(m), 1) for m in head_maps)
    num_heads = key_heads.shape[1]
    for rows in buckets:
        max_len = max(lens[i] for i in rows)
        num_blocks = -(-max_len // meta.block_size)
        rows_t = torch.tensor(rows, device=device)
        tables = meta.block_tables.index_select(0, rows_t)[:, :num_blocks].to(torch.long)
        slots = (tables.unsqueeze(-1) * meta.block_size + offsets).reshape(len(rows), -1)[:, :max_len]
        head_index = slots.unsqueeze(1) * kvh + key_heads  # [b, KVH, L]
        value_index = head_index if head_maps is None else slots.unsqueeze(1) * kvh + value_heads
        bag_index = value_index.unsqueeze(2).expand(len(rows), num_heads, groups, max_len).reshape(-1)
        bag_offsets = torch.arange(0, bag_index.numel(), max_len, device=device)
        head_index, value_index = head_index.reshape(-1), value_index.reshape(-1)
        seq = torch.tensor([lens[i] for i in rows], device=device).unsqueeze(1)
        pos = torch.arange(max_len, device=device).unsqueeze(0)
        mask = pos < seq
        if sliding_window is not None:
            mask &= pos > seq - 1 - sliding_window
        if chunk_size is not None:  # the query sits at position seq - 1
            mask &= pos >= (seq - 1) // chunk_size * chunk_size
        # Additive float mask, broadcast over [b, KVH, G, L] scores.
        bias = None if bool(mask.all()) else torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
        plans.append(
            (
                rows_t,
                head_index,
                value_index,
                bag_index,
                bag_offsets,
                None if bias is None else bias[:, None, None, :],
                max_len,
            )
        )
    return plans


def _prefill_gather(meta: AttentionMetadata, i: int, sliding_window: int | None, chunk_size: int | None = None):
    """Slot indices ``[S]`` of request ``i``'s context and its mask ``[Lq, S]`` (None = plain causal)."""
    seq_len = meta.seq_lens_cpu[i]
    q_len = meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
    num_blocks = -(-seq_len // meta.block_size)
    table = meta.block_tables[i, :num_blocks].to(torch.long)
    offsets = torch.arange(meta.block_size, device=table.device)
    slots = (table.unsqueeze(-1) * meta.block_size + offsets).reshape(-1)[:seq_len]
    if sliding_window is None and chunk_size is None and q_len == seq_len:
        return slots, None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=table.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=table.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if chunk_size is not None:
        mask &= k_pos >= torch.div(q_pos, chunk_size, rounding_mode="floor") * chunk_size
    return slots, mask


def torch_paged_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    decode_kernel=None,
    prefill_kernel=None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    head_maps: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    position_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query token over its request's paged context.

    Args:
        query: ``[T, H, Dk]``, this step's query rows (decodes first, then prefill chunks).
        k_pool, v_pool: ``[num_blocks, block_size, KVH, Dk]`` and ``[num_blocks, block_size, KVH,
            Dv]`` (already holding this step's K/V); ``Dv`` may differ from ``Dk``.
        meta: the step's metadata.
        scale: softmax scale (usually ``D ** -0.5``).
        sliding_window: keys further than this many positions back are masked (Mistral, Gemma 2).
        softcap: logit soft-capping ``softcap * tanh(s / softcap)`` (Gemma 2).
        key, value: optional ``[KVH, T, Dk]`` and ``[KVH, T, Dv]``, this step's K/V rows (as stored;
            with ``head_maps``, the heads the maps pick); a prefill chunk that is its request's
            whole context reads them instead of gathering from the pool.
        decode_kernel: a ``cpu_kernel.CPUDecodeKernel``; where it can serve (float32 or bf16 pools, built), the
            decode rows read the pool in place through it instead of the gather path below.
        prefill_kernel: a ``cpu_prefill.CPUPrefillKernel``; where it can serve, it computes the
            prefill rows (reading the pool in place) instead of the per-request loop below.

        k_scale, v_scale: float32 ``[num_blocks, block_size, KVH, 1]`` for int8 pools
            (``kv_quant``): the keys and values each request reads are gathered and dequantized
            (``q * scale``, then the query's dtype) before the same math as a float pool; every
            row, this step's too, reads the stored (quantized) K/V, so chunking and recompute
            see the same values. ``decode_kernel`` and ``prefill_kernel`` serve them where their
            ``can_serve_int8`` says they can (each dequantizes as it reads: ``q * scale`` in float32).
        sinks: ``[H]`` attention-sink logits (gpt-oss's ``s_aux``): one more softmax logit per head
            that takes probability mass and adds no value; or ``[T, H]``, one per query row and head
            (Inkling 2 computes them from each token's hidden state), for a step of one request (as
            ``position_bias``; its rows then take the per-request path). The CPU kernels have
            none: with sinks every row takes the torch path.
        chunk_size: chunked local attention (Llama 4's ``attention_chunk_size``): a query at
            position ``p`` sees only the keys of its own chunk, positions ``p // chunk_size *
            chunk_size .. p``. The CPU kernels have no such mask: with a chunk every row takes the
            torch path.
        head_maps: ``(key_heads, value_heads)``, two equally long tuples of pool KV head indices,
            for a model that attends over heads picked from the ones it stored (DiffLlama's halves
            of V tiled, JetMoE's K/V repeated per expert): attention then runs over
            ``len(key_heads)`` KV heads, the ``j``-th reading pool head ``key_heads[j]`` for its
            keys and ``value_heads[j]`` for its values. The CPU kernels have no maps: with them
            every row takes the torch path.
        position_bias: float ``[H, T, S]``, a model's own bias added to the scaled scores (Inkling's
            relative position bias), for a step of one request whose ``T`` rows attend over its
            context of ``S`` tokens (positions ``0..S-1``); its rows, decodes included, are then
            computed as transformers' SDPA attention computes them with a ``position_bias``
            (``_attend``). The CPU kernels have none: with one every row takes the torch path.

    Returns:
        ``[T, H, Dv]`` in the query dtype.

    Raises:
        ValueError: ``position_bias`` or per-row ``sinks`` with a step of more than one request,
            or of another shape.
    """
    num_tokens, num_heads, head_dim = query.shape
    kvh, v_dim = k_pool.shape[2], v_pool.shape[3]
    # The KV heads attention runs over: the pool's, or those the head maps pick from it.
    heads = kvh if head_maps is None else len(head_maps[0])
    nd = meta.num_decodes
    quantized = k_scale is not None
    scales = {"k_scale": k_scale, "v_scale": v_scale} if quantized else {}

    if position_bias is not None and (
        meta.num_requests != 1 or tuple(position_bias.shape) != (num_heads, num_tokens, meta.seq_lens_cpu[0])
    ):
        raise ValueError(
            f"a position bias of shape {tuple(position_bias.shape)} for a step of {meta.num_requests} requests "
            f"({num_tokens} query rows, {num_heads} heads): one request's [H, T, S] is served"
        )

    row_sinks = sinks is not None and sinks.dim() > 1
    if row_sinks and (meta.num_requests != 1 or tuple(sinks.shape) != (num_tokens, num_heads)):
        raise ValueError(
            f"per-row attention sinks of shape {tuple(sinks.shape)} for a step of {meta.num_requests} requests "
            f"({num_tokens} query rows, {num_heads} heads): one request's [T, H] are served"
        )

    def serves(kernel) -> bool:
        return (
            kernel is not None
            and sinks is None
            and position_bias is None
            and chunk_size is None
            and head_maps is None
            and (kernel.can_serve_int8 if quantized else kernel.can_serve)(query, k_pool, v_pool)
        )

    in_kernel = bool(nd) and serves(decode_kernel)
    if in_kernel:
        # The decode rows' tables and lengths, as the kernel reads them: once a step, not per layer.
        tables, lens = meta.derived(
            ("decode_kernel",),
            lambda: (meta.block_tables[:nd].to(torch.int32).contiguous(), meta.seq_lens[:nd].to(torch.int32)),
        )
        decoded = decode_kernel(query[:nd], k_pool, v_pool, tables, lens, scale, softcap, sliding_window, **scales)
        if nd == num_tokens:  # a decode-only step (most steps): the kernel's output is the result
            return decoded
        out = query.new_empty((num_tokens, num_heads, v_dim))
        out[:nd] = decoded
    else:
        out = query.new_empty((num_tokens, num_heads, v_dim))
    # With a position bias or per-row sinks the one request's rows, a decode's too, take the loop below.
    per_request = position_bias is not None or row_sinks
    first = 0 if per_request else nd
    if nd and not in_kernel and not per_request:
        groups = num_heads // heads
        plans = meta.derived(
            ("decode", sliding_window, kvh, groups, chunk_size, head_maps),
            lambda: _decode_buckets(meta, sliding_window, groups, kvh, chunk_size, head_maps),
        )
        rows_k, rows_v = k_pool.view(-1, head_dim), v_pool.view(-1, v_dim)
        rows_ks, rows_vs = (k_scale.view(-1, 1), v_scale.view(-1, 1)) if quantized else (None, None)
        # int8 keys and values are dequantized to float32 and the math stays there.
        compute = torch.float32 if quantized else query.dtype
        single = len(plans) == 1
        for rows, head_index, value_index, bag_index, bag_offsets, bias, max_len in plans:
            b = rows.numel()
            k = _gather_rows(rows_k, rows_ks, head_index, compute).view(b, heads, max_len, head_dim)
            q = query[:nd] if single else query.index_select(0, rows)  # [b, H, D]
            probs = _decode_probs(q, k, bias, scale, softcap, sinks)
            if quantized:
                v = _gather_rows(rows_v, rows_vs, value_index, compute).view(b, heads, max_len, v_dim)
                o = torch.matmul(probs, v)  # [b, KVH, G, D]
            else:
                # The probability-weighted sum of values as ``F.embedding_bag`` (mode "sum" with
                # ``per_sample_weights``): one bag per (request, query head) over ``bag_index`` rows of
                # the pool, so values are never copied out of their pages (faster than gather + matmul).
                weights = probs.reshape(-1).to(rows_v.dtype)
                o = F.embedding_bag(bag_index, rows_v, bag_offsets, mode="sum", per_sample_weights=weights)
            o = o.reshape(b, num_heads, v_dim).to(query.dtype)
            if single:
                out[:nd] = o
            else:
                out.index_copy_(0, rows, o)
    if meta.num_requests > nd and serves(prefill_kernel):
        return prefill_kernel(query, k_pool, v_pool, meta, scale, softcap, sliding_window, out=out, **scales)
    flat_k, flat_v = k_pool.view(-1, kvh, head_dim), v_pool.view(-1, kvh, v_dim)
    flat_ks, flat_vs = (k_scale.view(-1, kvh, 1), v_scale.view(-1, kvh, 1)) if quantized else (None, None)
    for i in range(first, meta.num_requests):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        slots, mask = meta.derived(
            ("prefill", i, sliding_window, chunk_size), lambda i=i: _prefill_gather(meta, i, sliding_window, chunk_size)
        )
        if key is not None and not quantized and end - start == meta.seq_lens_cpu[i]:
            # The whole context is this step's chunk: attend to the step's own K/V, no gather (an int8
            # cache never does: every row reads what the cache holds).
            k = key[:, start:end].unsqueeze(0).to(query.dtype)
            v = value[:, start:end].unsqueeze(0).to(query.dtype)
        else:
            k = _gather_rows(flat_k, flat_ks, slots, query.dtype)  # [S, KVH, D]
            v = _gather_rows(flat_v, flat_vs, slots, query.dtype)
            if head_maps is not None:
                k, v = (x.index_select(1, torch.tensor(m, device=x.device)) for x, m in zip((k, v), head_maps))
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        bias = None if position_bias is None else position_bias[:, start:end].unsqueeze(0)
        # Per-row sinks [T, H] as [1, H, Lq, 1], beside the scores' key dimension.
        row = sinks[start:end].transpose(0, 1).unsqueeze(0).unsqueeze(-1) if row_sinks else sinks
        o = _attend(q, k, v, mask, scale, softcap, is_causal=mask is None, sinks=row, bias=bias)
        out[start:end] = o[0].transpose(0, 1)
    return out


def context_slots(meta: AttentionMetadata) -> torch.Tensor:
    """int64 ``[sum(seq_lens)]``: the pool slots of every request's context, requests in the step's
    order, each request's positions ascending (what :func:`gather_contexts` reads)."""
    bs = meta.block_size
    offsets = torch.arange(bs, device=meta.block_tables.device)
    parts = []
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        table = meta.block_tables[i, : -(-seq_len // bs)].to(torch.long)
        parts.append((table.unsqueeze(-1) * bs + offsets).reshape(-1)[:seq_len])
    return torch.cat(parts)


def gather_contexts(pool: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype):
    """Rows ``slots`` of ``pool`` ``[num_blocks, block_size, KVH, D]`` as ``[1, KVH, S, D]`` in
    ``dtype`` (an int8 pool's rows dequantized with ``scales`` ``[num_blocks, block_size, KVH, 1]``):
    the stored context a latent layer's ``cache.update`` returns."""
    kvh, d = pool.shape[2], pool.shape[3]
    flat_scales = scales.view(-1, kvh, 1) if scales is not None else None
    rows = _gather_rows(pool.view(-1, kvh, d), flat_scales, slots, dtype)  # [S, KVH, D]
    return rows.transpose(0, 1).unsqueeze(0)


def context_mask(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """bool ``[T, S]`` (``S = sum(meta.seq_lens_cpu)``, contexts laid out as :func:`context_slots`):
    True where query row ``t`` may see context key ``s``: a key of its own request at a position up
    to the query's. The causal mask transformers gives a sparse-attention indexer, for the step's
    flattened requests at once (each request's block of it is ``generate``'s mask for that request)."""
    total = sum(meta.seq_lens_cpu)
    starts = meta.query_start_loc_cpu
    num_tokens = starts[len(meta.seq_lens_cpu)]
    mask = torch.zeros((num_tokens, total), dtype=torch.bool, device=device)
    ctx = 0
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
        mask[start:end, ctx : ctx + seq_len] = k_pos <= q_pos
        ctx += seq_len
    return mask


def context_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query row over its request's context given densely: the layers whose
    model expands the stored context itself (multi-head latent attention, ``KVLayerShape.latent``).

    Args:
        query: ``[T, H, Dk]``, this step's query rows (decodes first, then prefill chunks).
        key: ``[KVH, S, Dk]`` and value ``[KVH, S, Dv]`` with ``S = sum(meta.seq_lens_cpu)``: every
            request's whole context (this step's tokens last), requests in the step's order (as
            :func:`context_slots` lays them out); ``Dv`` may differ from ``Dk``.
        meta: the step's metadata (its host-side lists are read).
        scale, sliding_window, softcap, sinks: as :func:`torch_paged_attention`.
        selected: int ``[T, k]``, the keys each query row may see as positions in the ``S``
            context rows (a sparse-attention indexer's top-k; repeats allowed), or None for every
            causally visible key. A pick outside the row's own request, or past its position, is
            ignored; each row must keep at least one (the indexer's best pick always is one).

    Returns:
        ``[T, H, Dv]`` in the query dtype; a query at position ``p`` sees its request's keys
        ``0..p`` (the last ``sliding_window`` of them under a window; those of them ``selected``).

    Raises:
        ValueError: ``key``'s length is not the sum of the context lengths, or ``selected`` given
            with a ``sliding_window``.
    """
    total = sum(meta.seq_lens_cpu)
    if key.shape[1] != total or value.shape[1] != total:
        raise ValueError(f"context_attention: {key.shape[1]} key rows for contexts of {total} tokens")
    if selected is not None and sliding_window is not None:
        raise ValueError("context_attention: an indexer's selection under a sliding window is not served")
    num_tokens, num_heads, _ = query.shape
    out = query.new_empty((num_tokens, num_heads, value.shape[-1]))
    ctx = 0
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        k = key[:, ctx : ctx + seq_len].unsqueeze(0).to(query.dtype)
        v = value[:, ctx : ctx + seq_len].unsqueeze(0).to(query.dtype)
        ctx += seq_len
        q_len = end - start
        if selected is not None:
            # This request's rows over its own keys: the picks in its context (the others land in
            # a spare last column, dropped), and only up to each row's position.
            picks = selected[start:end].to(torch.long) - (ctx - seq_len)
            picks = torch.where((picks >= 0) & (picks < seq_len), picks, seq_len)
            mask = torch.zeros((q_len, seq_len + 1), dtype=torch.bool, device=query.device)
            mask = mask.scatter_(1, picks, True)[:, :seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            mask &= torch.arange(seq_len, device=query.device).unsqueeze(0) <= q_pos
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, Dk]
            out[start:end] = _attend(q, k, v, mask, scale, softcap, sinks=sinks)[0].transpose(0, 1)
            continue
        if q_len == 1:
            # A decode row: plain matmuls over the context's strided views (as the paged decode
            # path; scaled_dot_product_attention took about twice as long on them at one query).
            bias = None
            if sliding_window is not None and seq_len > sliding_window:
                bias = torch.zeros(seq_len, device=query.device)
                bias[: seq_len - sliding_window] = float("-inf")
                bias = bias.view(1, 1, 1, -1)
            probs = _decode_probs(query[start:end], k, bias, scale, softcap, sinks)  # [1, KVH, G, L]
            out[start] = torch.matmul(probs.to(v.dtype), v).reshape(num_heads, -1).to(query.dtype)
            continue
        mask = None
        if sliding_window is not None or q_len != seq_len:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, Dk]
        out[start:end] = _attend(q, k, v, mask, scale, softcap, is_causal=mask is None, sinks=sinks)[0].transpose(0, 1)
    return out


def _kept_keys(
    bias: torch.Tensor, q_pos: torch.Tensor, prompt_len: int, keep: int, sliding_window: int | None, low: float
) -> torch.Tensor:
    """bool ``[C, Lq, S]``: the keys each query row of one request attends to under a per-key bias
    ``bias`` ``[C, S]`` (its context's biases, in the model's dtype) that keeps the ``keep`` keys of
    largest bias, as transformers' Doge builds the mask in ``generate`` (``prepare_dynamic_mask``):
    the causal (and sliding-window) mask first, masked entries set to ``low`` (the dtype's
    minimum), then ``torch.topk`` over the row when it is longer than ``keep``.

    Where biases tie at the cut, which key ``topk`` keeps depends on the row it is given, so each
    row is laid out as ``generate``'s: a prompt token's (``q_pos < prompt_len``) is the prompt long,
    the keys past the query (or before its window) masked; a generated token's is the keys its
    cache returns, positions ``max(0, p - sliding_window + 1) .. p``, none masked. A row with no
    more visible keys than ``keep`` keeps them all (``topk`` ranks every visible key above the
    masked ones), so only rows past ``keep`` visible keys call it."""
    c, seq_len = bias.shape
    device = bias.device
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    q_col = q_pos.unsqueeze(1)
    visible = k_pos <= q_col
    if sliding_window is not None:
        visible &= k_pos > q_col - sliding_window
    kept = visible.unsqueeze(0).expand(c, -1, -1).clone()
    counts = visible.sum(1).tolist()
    positions = q_pos.tolist()
    prompt_rows = [r for r, p in enumerate(positions) if p < prompt_len and counts[r] > keep]
    if prompt_rows and prompt_len > keep:
        # A prompt row's visible keys all lie in the prompt; the context may be shorter (a chunk
        # of it) or longer (a request recomputed after preemption, its generated tokens after it).
        m = min(seq_len, prompt_len)
        rows = torch.tensor(prompt_rows, device=device)
        row_visible = torch.zeros((len(prompt_rows), prompt_len), dtype=torch.bool, device=device)
        row_visible[:, :m] = visible.index_select(0, rows)[:, :m]
        values = torch.full((c, len(prompt_rows), prompt_len), low, dtype=bias.dtype, device=device)
        values[:, :, :m] = bias[:, None, :m]
        values = values.masked_fill(~row_visible, low)
        picks = torch.topk(values, keep, dim=-1, largest=True, sorted=False).indices
        picked = torch.zeros_like(values, dtype=torch.bool).scatter_(-1, picks, True)
        # A pick among the masked entries (the top-k took it for want of visible ones) stays masked.
        kept[:, rows, :m] = picked[:, :, :m] & row_visible[:, :m]
    for r, p in enumerate(positions):
        if p < prompt_len or counts[r] <= keep:
            continue
        lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
        picks = torch.topk(bias[:, lo : p + 1], keep, dim=-1, largest=True, sorted=False).indices
        kept[:, r] = False
        kept[:, r].scatter_(-1, picks + lo, True)
    return kept


def key_biased_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    bias_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    keep: int,
    prompt_lens: list[int],
    bias_dtype: torch.dtype,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with a cached additive bias per key and a top-k over it (Doge's dynamic mask
    attention), one request at a time over its paged context.

    A query row at position ``p`` sees its request's keys ``0..p`` (the last ``sliding_window`` of
    them under a window); of those it keeps, per KV head, the ``keep`` of largest bias (all of them
    where there are no more than ``keep``; ties cut as ``generate``'s ``torch.topk`` cuts them, see
    :func:`_kept_keys`) and adds each kept key's bias to its score. Query head ``h`` reads bias
    channel ``h // (H // C)`` (the model repeats the bias per query head as it repeats K/V).

    Args:
        query: ``[T, H, Dk]``, this step's query rows.
        k_pool, v_pool: the layer's pools (this step's K/V stored), as :func:`torch_paged_attention`.
        bias_pool: float ``[num_blocks, block_size, C]``, each stored key's bias per channel (C
            divides H), this step's stored.
        meta: the step's metadata.
        scale: softmax scale.
        keep: keys kept per row (Doge's ``keep_window_size``), at least 1.
        prompt_lens: each metadata entry's prompt length (tokens): the rows ``generate`` built.
        bias_dtype: the dtype the model computed the bias in: the top-k runs over it in that dtype,
            masked entries at its minimum, as the model's does.
        sliding_window, softcap, k_scale, v_scale: as :func:`torch_paged_attention`.

    Returns:
        ``[T, H, Dv]`` in the query dtype.

    Raises:
        ValueError: ``keep`` below 1, a bias whose channels do not divide the query heads, or
            ``prompt_lens`` not one per metadata entry.
    """
    num_tokens, num_heads, head_dim = query.shape
    kvh, v_dim = k_pool.shape[2], v_pool.shape[3]
    channels = bias_pool.shape[-1]
    if keep < 1 or num_heads % channels:
        raise ValueError(f"key_biased_attention: keep={keep}, {channels} bias channels for {num_heads} heads")
    if len(prompt_lens) != meta.num_requests:
        raise ValueError(f"key_biased_attention: {len(prompt_lens)} prompt lengths for {meta.num_requests} entries")
    quantized = k_scale is not None
    flat_k, flat_v = k_pool.view(-1, kvh, head_dim), v_pool.view(-1, kvh, v_dim)
    flat_ks, flat_vs = (k_scale.view(-1, kvh, 1), v_scale.view(-1, kvh, 1)) if quantized else (None, None)
    flat_b = bias_pool.view(-1, channels)
    low = torch.finfo(bias_dtype).min
    out = query.new_empty((num_tokens, num_heads, v_dim))
    bs = meta.block_size
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]

        def slots_of(i=i, seq_len=seq_len):
            table = meta.block_tables[i, : -(-seq_len // bs)].to(torch.long)
            return (table.unsqueeze(-1) * bs + torch.arange(bs, device=table.device)).reshape(-1)[:seq_len]

        slots = meta.derived(("key_bias_slots", i), slots_of)
        k = _gather_rows(flat_k, flat_ks, slots, query.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, S, Dk]
        v = _gather_rows(flat_v, flat_vs, slots, query.dtype).transpose(0, 1).unsqueeze(0)
        bias = flat_b.index_select(0, slots).to(bias_dtype).transpose(0, 1)  # [C, S]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        kept = _kept_keys(bias, q_pos, prompt_lens[i], keep, sliding_window, low)  # [C, Lq, S]
        add = bias.unsqueeze(1).masked_fill(~kept, float("-inf")).to(query.dtype)
        add = add.repeat_interleave(num_heads // channels, dim=0).unsqueeze(0)  # [1, H, Lq, S]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, Dk]
        if softcap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=add, scale=scale, enable_gqa=num_heads != kvh)
        else:
            groups = num_heads // kvh
            kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = torch.matmul(q, kk.transpose(-1, -2)).float() * scale
            scores = softcap * torch.tanh(scores / softcap) + add
            o = torch.matmul(torch.softmax(scores, dim=-1).to(vv.dtype), vv)
        out[start:end] = o[0].transpose(0, 1)
    return out
