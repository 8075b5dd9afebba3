"""K/V shapes that are not one (KV heads, head size) for K and V in every layer: per-layer shapes in
one block-id space, V heads of another size than K heads, and multi-head latent attention's
whole-context attention. Bytes are worked out by hand; attention is checked against the naive
reference (``tests/reference_attention.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_int8_kv import reference_dequantized
from test_torch_attention import _batch, reference_for

from hf_contbatch.kernels.attention.backends import (
    CPUKernelAttentionBackend,
    Int8TorchAttentionBackend,
    TorchAttentionBackend,
)
from hf_contbatch.kernels.attention.kv_quant import store_quantized
from hf_contbatch.kernels.attention.torch_paged import (
    context_attention,
    context_mask,
    context_slots,
    torch_paged_attention,
)
from hf_contbatch.kernels.kv_spec import KVCacheSpec, KVLayerShape
from hf_contbatch.kernels.paged_cache import PagedKVCache

from reference_attention import reference_paged_attention

DECODES = [1, 3, 9, 17, 40, 41, 2]
PREFILLS = [(5, 5), (3, 20), (16, 16), (1, 9)]  # fresh prompt, chunk after a cached prefix, ...


def _with_value_dim(v_dim, **kwargs):
    """A mixed decode/prefill batch (``test_torch_attention._batch``) whose V pool has heads of
    ``v_dim`` channels."""
    query, k_pool, v_pool, meta = _batch(DECODES, PREFILLS, **kwargs)
    g = torch.Generator().manual_seed(11)
    v_pool = torch.randn(*v_pool.shape[:3], v_dim, generator=g)
    return query, k_pool, v_pool, meta


def test_per_layer_shapes_count_each_layers_bytes():
    # Gemma 4-like: a sliding layer of 2 KV heads x 16 channels, a global layer of 1 x 512; and a
    # MiMo-like layer whose V heads are 8 channels beside 16-channel K heads.
    shapes = [KVLayerShape(2, 16, 16), KVLayerShape(1, 512, 512), KVLayerShape(4, 16, 8)]
    spec = KVCacheSpec.for_layers(shapes, block_size=4, dtype=torch.float32)
    # per block: 4 tokens x 4 bytes x (2 x (16 + 16) + 1 x (512 + 512) + 4 x (16 + 8))
    assert [spec.layer_block_bytes(i) for i in range(3)] == [4 * 4 * 64, 4 * 4 * 1024, 4 * 4 * 96]
    assert spec.bytes_per_block == 4 * 4 * (64 + 1024 + 96)
    assert spec.layer_bytes_per_block == 4 * 4 * 1024  # the largest layer's
    assert (spec.num_kv_heads, spec.head_size) == (2, 16)
    assert spec.layer_shape(7, 1) == (7, 4, 1, 512) and spec.value_shape(7, 2) == (7, 4, 4, 8)
    assert not spec.uniform


def test_int8_per_layer_shapes_count_their_scales():
    shapes = [KVLayerShape(1, 16, 8, latent=True), KVLayerShape(2, 16, 16)]
    spec = KVCacheSpec.for_layers(
        shapes, block_size=2, dtype=torch.int8, scale_dtype=torch.float32, scales_per_token_head=1
    )
    # layer 0: 2 tokens x 1 head x (16 + 8) int8 + 2 x 2 tokens x 1 head x 4-byte scales
    assert spec.layer_block_bytes(0) == 2 * 24 + 2 * 2 * 4
    assert spec.layer_block_bytes(1) == 2 * 2 * 32 + 2 * 2 * 2 * 4
    assert spec.scale_shape(3, 1) == (3, 2, 2, 1)


def test_plain_shapes_give_the_spec_of_one_shape():
    plain = KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    built = KVCacheSpec.for_layers([KVLayerShape(2, 8, 8)] * 3, block_size=16, dtype=torch.float32)
    assert built == plain and built.uniform and built.layer(2) == KVLayerShape(2, 8, 8)


@pytest.mark.parametrize(
    "shapes",
    [
        [KVLayerShape(2, 8, 8)] * 2,  # two shapes for three layers
        [KVLayerShape(1, 8, 8)] * 3,  # layer 0 disagrees with num_kv_heads
    ],
)
def test_inconsistent_layer_shapes_are_rejected(shapes):
    with pytest.raises(ValueError):
        KVCacheSpec(
            num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32, layer_shapes=tuple(shapes)
        )
    with pytest.raises(ValueError):
        KVLayerShape(2, 8, 0)


def test_paged_cache_gives_each_layer_its_shape_and_swaps_them_back():
    shapes = [KVLayerShape(2, 8, 8), KVLayerShape(4, 16, 8), KVLayerShape(1, 12, 4, latent=True)]
    spec = KVCacheSpec.for_layers(shapes, block_size=4, dtype=torch.float32)
    cache = PagedKVCache(spec, 5, [torch.device("cpu")] * 3, TorchAttentionBackend(), num_swap_blocks=3)
    assert [tuple(k.shape) for k in cache.key_cache] == [(5, 4, 2, 8), (5, 4, 4, 16), (5, 4, 1, 12)]
    assert [tuple(v.shape) for v in cache.value_cache] == [(5, 4, 2, 8), (5, 4, 4, 8), (5, 4, 1, 4)]
    assert cache.latent_layers == {2}
    assert cache.nbytes == 5 * spec.bytes_per_block
    g = torch.Generator().manual_seed(0)
    for pool in cache.key_cache + cache.value_cache:
        pool.copy_(torch.randn(pool.shape, generator=g))
    before = [p[[1, 3]].clone() for p in cache.key_cache + cache.value_cache]
    cache.swap_out([(1, 0), (3, 2)])
    for pool in cache.key_cache + cache.value_cache:
        pool.zero_()
    cache.swap_in([(0, 4), (2, 0)])
    after = [p[[4, 0]] for p in cache.key_cache + cache.value_cache]
    for b, a in zip(before, after):
        assert torch.equal(a, b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (5, None), (None, 20.0)])
def test_torch_path_with_v_heads_narrower_than_k_heads_matches_reference(sliding_window, softcap):
    query, k_pool, v_pool, meta = _with_value_dim(5)
    got = torch_paged_attention(query, k_pool, v_pool, meta, 0.3, sliding_window=sliding_window, softcap=softcap)
    assert got.shape == (query.shape[0], query.shape[1], 5)
    want = reference_for(query, k_pool, v_pool, meta, 0.3, sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_int8_torch_path_with_v_heads_of_their_own_size_matches_reference_over_dequantized_pools():
    query, k_float, v_float, meta = _with_value_dim(12)
    nb, bs, kvh, _ = k_float.shape
    k_pool = torch.zeros(k_float.shape, dtype=torch.int8)
    v_pool = torch.zeros(v_float.shape, dtype=torch.int8)
    k_scale, v_scale = torch.zeros(nb, bs, kvh, 1), torch.zeros(nb, bs, kvh, 1)
    slots = torch.arange(nb * bs)
    key, value = k_float.reshape(-1, kvh, k_float.shape[-1]), v_float.reshape(-1, kvh, 12)
    store_quantized(key, value, k_pool, v_pool, k_scale, v_scale, slots)
    got = torch_paged_attention(query, k_pool, v_pool, meta, 0.3, k_scale=k_scale, v_scale=v_scale)
    want = reference_for(query, reference_dequantized(k_float), reference_dequantized(v_float), meta, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(300)
def test_cpu_kernel_backend_steps_aside_for_v_heads_of_their_own_size():
    """The C kernels read K and V pools of one shape: a layer whose V heads differ takes the torch
    path (store and attention) and still matches the reference."""
    query, k_float, v_float, meta = _with_value_dim(4, dim=16)
    nb, bs, kvh, dk = k_float.shape
    backend = CPUKernelAttentionBackend()
    k_pool, v_pool = torch.zeros_like(k_float), torch.zeros_like(v_float)
    meta.slot_mapping = torch.arange(nb * bs)
    backend.store_kv(k_float.reshape(-1, kvh, dk), v_float.reshape(-1, kvh, 4), k_pool, v_pool, meta)
    assert torch.equal(k_pool, k_float) and torch.equal(v_pool, v_float)
    got = backend.attend(query, k_pool, v_pool, meta, 0.25, sliding_window=7)
    want = reference_for(query, k_float, v_float, meta, 0.25, sliding_window=7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _dense_contexts(meta, heads, dk, dv, seed=0):
    """Every request's whole context as ``[H, S, D]`` tensors, requests in the step's order."""
    g = torch.Generator().manual_seed(seed)
    total = sum(meta.seq_lens_cpu)
    return torch.randn(heads, total, dk, generator=g), torch.randn(heads, total, dv, generator=g)


def _as_identity_pool(contexts: torch.Tensor, meta, block_size: int):
    """``contexts`` ``[H, S, D]`` laid into a fresh pool request by request, and the block tables
    that read them back: the reference then reads each request's context through its table."""
    heads, _, d = contexts.shape
    tables, rows, start = [], [], 0
    for seq_len in meta.seq_lens_cpu:
        nb = -(-seq_len // block_size)
        first = len(rows)
        part = contexts[:, start : start + seq_len].transpose(0, 1)  # [seq_len, H, D]
        padded = torch.zeros(nb * block_size, heads, d)
        padded[:seq_len] = part
        rows.extend(padded.view(nb, block_size, heads, d))
        tables.append(list(range(first, first + nb)))
        start += seq_len
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return torch.stack(rows), block_tables


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (6, None), (None, 15.0)])
def test_context_attention_of_latent_layers_matches_reference(sliding_window, softcap):
    """MLA as transformers computes it: 24-channel K heads (nope + rope), 16-channel V heads, every
    request's whole context given densely; a query sees its own request's positions up to its own."""
    query, _, _, meta = _batch(DECODES, PREFILLS, kvh=4, heads=4, dim=24)
    key, value = _dense_contexts(meta, 4, 24, 16)
    got = context_attention(query, key, value, meta, 0.2, sliding_window, softcap)
    k_pool, tables = _as_identity_pool(key, meta, 4)
    v_pool, _ = _as_identity_pool(value, meta, 4)
    want = reference_paged_attention(
        query, k_pool, v_pool, tables, meta.seq_lens, meta.query_start_loc, 0.2, sliding_window, softcap
    )
    assert got.shape == (query.shape[0], 4, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_context_slots_follow_each_requests_block_table():
    _, _, _, meta = _batch([3], [(2, 6)], block_size=4)
    want = []
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        want += [int(meta.block_tables[i, p // 4]) * 4 + p % 4 for p in range(seq_len)]
    assert context_slots(meta).tolist() == want


def test_context_attention_refuses_contexts_of_another_length():
    query, _, _, meta = _batch([3], [(2, 6)], kvh=2, heads=2, dim=8)
    key, value = _dense_contexts(meta, 2, 8, 8)
    with pytest.raises(ValueError, match="key rows"):
        context_attention(query, key[:, 1:], value[:, 1:], meta, 1.0)


def _latent_step(dtype, scales):
    """A cache of one latent layer (16-channel K latent, 8-channel V rotary key) with two requests:
    request 0 decodes its 6th token over 5 stored ones, request 1 prefills 3 tokens."""
    spec = KVCacheSpec.for_layers([KVLayerShape(1, 16, 8, latent=True)], block_size=4, dtype=dtype, **scales)
    backend = Int8TorchAttentionBackend() if dtype == torch.int8 else TorchAttentionBackend()
    cache = PagedKVCache(spec, 6, [torch.device("cpu")], backend)
    tables = torch.tensor([[4, 1], [2, 0]], dtype=torch.int32)
    meta = backend.build_metadata(
        slot_mapping=torch.tensor([1 * 4 + 1, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2]),
        block_tables=tables,
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3], dtype=torch.int32),
        query_start_loc_cpu=[0, 1, 4],
        seq_lens_cpu=[6, 3],
        num_decodes=1,
        block_size=4,
        num_kv_heads=1,
        device=torch.device("cpu"),
    )
    return cache, meta


@pytest.mark.parametrize("quantized", [False, True])
def test_a_latent_layers_update_returns_each_requests_stored_context(quantized):
    scales = dict(scale_dtype=torch.float32, scales_per_token_head=1) if quantized else {}
    cache, meta = _latent_step(torch.int8 if quantized else torch.float32, scales)
    g = torch.Generator().manual_seed(3)
    past_k, past_v = torch.randn(5, 1, 16, generator=g), torch.randn(5, 1, 8, generator=g)
    # Request 0's first 5 tokens, stored by an earlier step: block 4 then block 1.
    earlier = [4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 1 * 4 + 0]
    meta_earlier = dataclasses.replace(meta, slot_mapping=torch.tensor(earlier), _derived={})
    cache.backend.store_kv(past_k, past_v, cache.key_cache[0], cache.value_cache[0], meta_earlier, **cache.scales(0))
    new_k, new_v = torch.randn(1, 1, 4, 16, generator=g), torch.randn(1, 1, 4, 8, generator=g)
    key, value = cache.for_step(meta).update(new_k, new_v, 0)
    # [request 0: 5 stored + its new token, request 1: its 3 new tokens], one latent "head".
    want_k = torch.cat([past_k[:, 0], new_k[0, 0, :1], new_k[0, 0, 1:]])
    want_v = torch.cat([past_v[:, 0], new_v[0, 0, :1], new_v[0, 0, 1:]])
    if quantized:  # every row reads what the int8 cache holds
        want_k, want_v = reference_dequantized(want_k), reference_dequantized(want_v)
    assert key.shape == (1, 1, 9, 16) and value.shape == (1, 1, 9, 8)
    torch.testing.assert_close(key[0, 0], want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(value[0, 0], want_v, rtol=1e-6, atol=1e-6)


# --- sparse attention's indexer (DeepSeek V3.2's DSA and kin) --------------------------------------
def test_indexer_keys_count_in_their_layers_bytes():
    shapes = [KVLayerShape(1, 16, 8, latent=True, indexer_head_size=12), KVLayerShape(1, 16, 8, latent=True)]
    spec = KVCacheSpec.for_layers(shapes, block_size=4, dtype=torch.float32)
    # layer 0: 4 tokens x 4 bytes x (16 + 8) latents + 4 tokens x 12 indexer channels x 4 bytes
    assert [spec.layer_block_bytes(i) for i in range(2)] == [4 * 4 * 24 + 4 * 12 * 4, 4 * 4 * 24]
    assert spec.indexer_shape(7, 0) == (7, 4, 12) and spec.indexer_shape(7, 1) is None
    # An int8 layout keeps the indexer keys in float32 (4 bytes), beside int8 latents and their scales.
    int8 = KVCacheSpec.for_layers(
        shapes, block_size=2, dtype=torch.int8, scale_dtype=torch.float32, scales_per_token_head=1
    )
    assert int8.indexer_dtype == torch.float32
    assert int8.layer_block_bytes(0) == 2 * 24 + 2 * 2 * 4 + 2 * 12 * 4
    with pytest.raises(ValueError):
        KVLayerShape(1, 16, 8, latent=True, indexer_head_size=-1)


def _indexed_step():
    """``_latent_step``'s two requests (request 0 decodes its 6th token over 5 stored ones, request 1
    prefills 3) over a latent layer whose indexer caches 6 channels per token, with a swap pool."""
    spec = KVCacheSpec.for_layers(
        [KVLayerShape(1, 16, 8, latent=True, indexer_head_size=6)], block_size=4, dtype=torch.float32
    )
    cache = PagedKVCache(spec, 6, [torch.device("cpu")], TorchAttentionBackend(), num_swap_blocks=2)
    _, meta = _latent_step(torch.float32, {})
    return cache, meta


def test_update_indexer_returns_each_requests_stored_indexer_keys():
    cache, meta = _indexed_step()
    assert cache.indexer_layers == {0} and cache.indexer_keys[0].shape == (6, 4, 6)
    assert cache.nbytes == 6 * (4 * 4 * 24 + 4 * 6 * 4)
    g = torch.Generator().manual_seed(5)
    past = torch.randn(1, 5, 6, generator=g)
    earlier = [4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 1 * 4 + 0]  # request 0's first 5: block 4, then 1
    meta_earlier = dataclasses.replace(meta, slot_mapping=torch.tensor(earlier), _derived={})
    cache.for_step(meta_earlier).update_indexer(past, 0)
    new = torch.randn(1, 4, 6, generator=g)
    keys = cache.for_step(meta).update_indexer(new, 0)
    # [request 0: 5 stored + its new key, request 1: its 3 new keys], as DynamicIndexedLayer concatenates.
    want = torch.cat([past[0], new[0, :1], new[0, 1:]])
    assert keys.shape == (1, 9, 6)
    assert torch.equal(keys[0], want)


def test_request_indexer_keys_store_the_rows_and_pad_the_requests_keys_to_the_row_length():
    cache, meta = _indexed_step()
    g = torch.Generator().manual_seed(7)
    step = cache.for_step(meta)
    new = torch.randn(1, 4, 6, generator=g)
    # Request 1 prefills its 3 tokens (step rows 1..3) over a prompt-long row of 5 (generate's row).
    keys = step.request_indexer_keys(new[:, 1:], 0, 1, torch.tensor([1, 2, 3]), 3, 5)
    assert keys.shape == (1, 5, 6)
    assert torch.equal(keys[0, :3], new[0, 1:]) and torch.equal(keys[0, 3:], torch.zeros(2, 6))
    # Their slots (block 2, offsets 0..2) hold them.
    assert torch.equal(cache.indexer_keys[0][2, :3], new[0, 1:])
    with pytest.raises(ValueError, match="do not fit"):
        step.request_indexer_keys(new[:, 1:], 0, 1, torch.tensor([1, 2, 3]), 3, 2)


def test_indexer_keys_move_with_their_blocks():
    cache, _ = _indexed_step()
    pool = cache.indexer_keys[0]
    pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(6)))
    before = pool[[1, 3]].clone()
    cache.swap_out([(1, 0), (3, 1)])
    pool.zero_()
    cache.swap_in([(0, 5), (1, 2)])
    assert torch.equal(pool[[5, 2]], before)
    cache.copy_blocks([(5, 0)])  # copy-on-write of a forked block
    assert torch.equal(pool[0], before[0])


def test_context_mask_is_each_requests_causal_block():
    _, _, _, meta = _batch(DECODES, PREFILLS)
    got = context_mask(meta, torch.device("cpu"))
    total, rows = sum(meta.seq_lens_cpu), meta.query_start_loc_cpu[-1]
    want = torch.zeros(rows, total, dtype=torch.bool)
    ctx = 0
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        for r in range(start, end):
            position = seq_len - (end - start) + (r - start)  # this step's tokens are the context's last
            for p in range(position + 1):
                want[r, ctx + p] = True
        ctx += seq_len
    assert torch.equal(got, want)


@pytest.mark.timeout(300)
def test_context_attention_over_an_indexers_selection_matches_a_naive_reference():
    """Each query attends over the keys an indexer picked (a random subset of its causal keys,
    never empty): softmax over those keys only, computed naively per query row."""
    query, _, _, meta = _batch(DECODES, PREFILLS, kvh=2, heads=4, dim=24)
    key, value = _dense_contexts(meta, 2, 24, 16)
    causal = context_mask(meta, torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    allowed = causal & (torch.rand(causal.shape, generator=g) < 0.4)
    allowed |= causal & ~causal.cumsum(-1).gt(1)  # each row keeps its first visible key at least
    # As top-k positions: each row's picks, then keys it may not see (another request's, or past its
    # position: what a top-k takes for want of visible keys), to be ignored; rows padded with repeats.
    width = int(allowed.sum(-1).max()) + 2
    selected = torch.empty(allowed.shape[0], width, dtype=torch.int32)
    for t in range(allowed.shape[0]):
        hidden = (~causal[t]).nonzero()[:, 0][:2].tolist()
        row = allowed[t].nonzero()[:, 0].tolist() + hidden
        selected[t] = torch.tensor(row + [row[0]] * (width - len(row)))
    got = context_attention(query, key, value, meta, 0.2, selected=selected)
    want = torch.empty_like(got)
    for t in range(query.shape[0]):
        picked = allowed[t].nonzero()[:, 0]
        for h in range(query.shape[1]):
            k, v = key[h // 2, picked], value[h // 2, picked]  # 2 query heads per KV head
            scores = (query[t, h] * k).sum(-1) * 0.2
            probs = torch.exp(scores - scores.max())
            want[t, h] = (probs[:, None] * v).sum(0) / probs.sum()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sliding window"):
        context_attention(query, key, value, meta, 0.2, sliding_window=4, selected=selected)
