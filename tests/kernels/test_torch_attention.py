"""The plain-torch paged attention (the CPU path) against the naive reference, on batches that mix
many decodes of very different context lengths (several length buckets) with prefill chunks."""

from __future__ import annotations

import random

import pytest
import torch

from hf_contbatch.kernels.attention.torch_paged import torch_paged_attention
from hf_contbatch.kernels.paged_cache import AttentionMetadata

from reference_attention import reference_paged_attention


def _batch(decode_lens, prefill, block_size=4, kvh=2, heads=4, dim=8, seed=0):
    """``prefill``: list of (query_len, seq_len). Blocks are shuffled across the pool."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    reqs = [(1, n) for n in decode_lens] + list(prefill)
    need = sum(-(-s // block_size) for _, s in reqs)
    num_blocks = need + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, k = [], 0
    for _, s in reqs:
        nb = -(-s // block_size)
        tables.append(ids[k : k + nb])
        k += nb
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [q for q, _ in reqs]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    k_pool = torch.randn(num_blocks, block_size, kvh, dim, generator=g)
    v_pool = torch.randn(num_blocks, block_size, kvh, dim, generator=g)
    query = torch.randn(qsl[-1], heads, dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32),
        block_tables=block_tables,
        num_decodes=len(decode_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(s for _, s in reqs),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[s for _, s in reqs],
        block_size=block_size,
        num_kv_heads=kvh,
    )
    return query, k_pool, v_pool, meta


def reference_for(query, k_pool, v_pool, meta, scale, **kwargs):
    """The naive reference over the batch ``meta`` describes (``sliding_window``, ``softcap``)."""
    return reference_paged_attention(
        query, k_pool, v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, **kwargs
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (5, None), (None, 20.0), (7, 30.0)])
def test_mixed_decode_buckets_and_prefill_chunks_match_reference(sliding_window, softcap):
    decode_lens = [1, 2, 3, 4, 4, 5, 8, 9, 12, 16, 17, 30, 33, 40, 41, 64, 65, 66, 70, 90, 100, 101, 120, 3, 2]
    prefill = [(5, 5), (3, 20), (16, 16), (1, 9)]  # fresh prompt, chunk after a cached prefix, ...
    query, k_pool, v_pool, meta = _batch(decode_lens, prefill)
    scale = 0.3
    got = torch_paged_attention(query, k_pool, v_pool, meta, scale, sliding_window=sliding_window, softcap=softcap)
    want = reference_for(query, k_pool, v_pool, meta, scale, sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk_size", [1, 4, 6, 16])
def test_chunked_local_attention_matches_reference(chunk_size):
    """Llama 4's chunked layers: each query sees its own chunk's earlier keys only, in decode rows
    (several length buckets, queries on and just past chunk starts) and in prefill chunks that start
    mid-chunk after a cached prefix; one whole-context chunk (read from the step's own K/V)."""
    decode_lens = [1, 4, 5, 6, 7, 12, 13, 16, 17, 33, 40, 64, 65, 97, 2]
    prefill = [(5, 5), (3, 20), (16, 16), (1, 9), (11, 29)]
    query, k_pool, v_pool, meta = _batch(decode_lens, prefill, seed=3)
    scale = 0.3
    got = torch_paged_attention(query, k_pool, v_pool, meta, scale, chunk_size=chunk_size)
    want = reference_for(query, k_pool, v_pool, meta, scale, chunk_size=chunk_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The whole-context prefill reading the step's own K/V (no gather) masks the chunk too.
    query, k_pool, v_pool, meta = _batch([], [(13, 13)], seed=4)
    flat_k, flat_v = k_pool.view(-1, 2, 8), v_pool.view(-1, 2, 8)
    table = meta.block_tables[0].long()
    slots = (table.unsqueeze(-1) * 4 + torch.arange(4)).reshape(-1)[:13]
    key, value = flat_k[slots].transpose(0, 1), flat_v[slots].transpose(0, 1)
    got = torch_paged_attention(query, k_pool, v_pool, meta, scale, key=key, value=value, chunk_size=chunk_size)
    want = reference_for(query, k_pool, v_pool, meta, scale, chunk_size=chunk_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_only_prefill_and_only_decode_batches_match_reference():
    for decode_lens, prefill in [([], [(7, 7), (2, 11)]), ([3, 50, 9], [])]:
        query, k_pool, v_pool, meta = _batch(decode_lens, prefill, seed=4)
        got = torch_paged_attention(query, k_pool, v_pool, meta, 0.5)
        want = reference_for(query, k_pool, v_pool, meta, 0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "head_maps",
    [((0, 1), (1, 0)), ((0, 1, 0, 1), (0, 1, 0, 1)), ((0, 1), (0, 0))],
    ids=["values-swapped", "repeated-per-expert", "one-value-head"],
)
def test_head_maps_read_the_picked_pool_heads(head_maps):
    """Attention over heads picked from the pool (DiffLlama's tiled halves of V, JetMoE's per-expert
    repeat) equals the reference over pools holding those heads, in decode and prefill rows."""
    decode_lens = [1, 5, 12, 17, 40, 3]
    prefill = [(5, 5), (3, 20), (1, 9)]
    heads = 2 * len(head_maps[0])  # two query heads per picked KV head
    query, k_pool, v_pool, meta = _batch(decode_lens, prefill, heads=heads, seed=5)
    scale = 0.3
    got = torch_paged_attention(query, k_pool, v_pool, meta, scale, head_maps=head_maps)
    picked_k, picked_v = k_pool[:, :, list(head_maps[0])], v_pool[:, :, list(head_maps[1])]
    want = reference_for(query, picked_k, picked_v, meta, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("request_shape", [(7, 7), (3, 20), (1, 9), (1, 1)], ids=["prompt", "chunk", "decode", "first"])
def test_a_position_bias_over_one_requests_context_matches_reference(request_shape, sliding_window):
    """A model's own additive bias (Inkling's relative position bias, ``[H, T, S]``) over a step of
    one request: added to each row's scaled scores of the visible keys, in a prompt, a chunk after a
    cached prefix, a decode row (which then takes the per-request path) and a one-token context."""
    decode = request_shape[0] == 1 and request_shape[1] > 1
    query, k_pool, v_pool, meta = _batch(
        [request_shape[1]] if decode else [], [] if decode else [request_shape], seed=6
    )
    heads, q_len, seq_len = query.shape[1], request_shape[0], request_shape[1]
    bias = torch.randn(heads, q_len, seq_len, generator=torch.Generator().manual_seed(7))
    scale = 0.3
    got = torch_paged_attention(query, k_pool, v_pool, meta, scale, sliding_window, position_bias=bias)
    want = reference_for(query, k_pool, v_pool, meta, scale, sliding_window=sliding_window, position_bias=bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    without = reference_for(query, k_pool, v_pool, meta, scale, sliding_window=sliding_window)
    assert not torch.allclose(got, without, atol=1e-3) or seq_len == 1  # the bias did change the output


@pytest.mark.timeout(300)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("request_shape", [(7, 7), (3, 20), (1, 9)], ids=["prompt", "chunk", "decode"])
def test_per_row_sinks_over_one_requests_context_match_reference(request_shape, with_bias):
    """Inkling 2's attention sinks, one logit per query row and head (``[T, H]``), alone and with
    its position bias, in a prompt, a chunk after a cached prefix and a decode row."""
    decode = request_shape[0] == 1
    query, k_pool, v_pool, meta = _batch(
        [request_shape[1]] if decode else [], [] if decode else [request_shape], seed=9
    )
    heads, q_len, seq_len = query.shape[1], request_shape[0], request_shape[1]
    g = torch.Generator().manual_seed(10)
    sinks = torch.randn(q_len, heads, generator=g) * 2
    bias = torch.randn(heads, q_len, seq_len, generator=g) if with_bias else None
    got = torch_paged_attention(query, k_pool, v_pool, meta, 0.3, sinks=sinks, position_bias=bias)
    want = reference_for(query, k_pool, v_pool, meta, 0.3, position_bias=bias, row_sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, reference_for(query, k_pool, v_pool, meta, 0.3, position_bias=bias), atol=1e-3)


@pytest.mark.timeout(60)
def test_a_position_bias_over_a_step_of_several_requests_is_refused():
    """A dense ``[H, T, S]`` bias aligns with one request's context only: a step of two is refused
    rather than biasing a request's keys with another's positions."""
    query, k_pool, v_pool, meta = _batch([4], [(5, 5)], seed=8)
    bias = torch.zeros(query.shape[1], query.shape[0], 5)
    with pytest.raises(ValueError, match="one request's"):
        torch_paged_attention(query, k_pool, v_pool, meta, 0.3, position_bias=bias)
    with pytest.raises(ValueError, match="one request's"):  # per-row sinks likewise
        torch_paged_attention(query, k_pool, v_pool, meta, 0.3, sinks=torch.zeros(query.shape[0], query.shape[1]))
