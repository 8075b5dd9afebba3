"""``torch_paged.key_biased_attention`` (Doge's dynamic mask over the paged pool) against the masks
transformers' own ``DogeAttention.prepare_dynamic_mask`` builds for the rows ``generate`` lays out,
applied by plain eager attention: a prompt's rows in one prefill mask the prompt long, a generated
token's row over the keys its cache returns. Biases drawn from three values, so they tie at the cut."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.doge.modeling_doge import DogeAttention

from hf_contbatch.kernels.attention.torch_paged import key_biased_attention
from hf_contbatch.kernels.paged_cache import AttentionMetadata

KVH, HEADS, DIM, BLOCK = 2, 4, 8, 4


def _step(entries, seed=0):
    """A paged step: ``entries`` (query_len, seq_len, prompt_len), decodes first. Returns query, pools
    (K, V, bias: biases from {0.5, 1, 2}), metadata, prompt lengths and each entry's slots."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-s // BLOCK) for _, s, _ in entries)
    ids = list(range(need + 2))
    rng.shuffle(ids)
    tables, k = [], 0
    for _, s, _ in entries:
        nb = -(-s // BLOCK)
        tables.append(ids[k : k + nb])
        k += nb
    width = max(len(t) for t in tables)
    qsl = [0]
    for q, _, _ in entries:
        qsl.append(qsl[-1] + q)
    n = need + 2
    k_pool = torch.randn(n, BLOCK, KVH, DIM, generator=g)
    v_pool = torch.randn(n, BLOCK, KVH, DIM, generator=g)
    bias_pool = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (n, BLOCK, KVH), generator=g)]
    query = torch.randn(qsl[-1], HEADS, DIM, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s, _ in entries], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=sum(q == 1 for q, _, _ in entries),
        max_query_len=max(q for q, _, _ in entries),
        max_seq_len=max(s for _, s, _ in entries),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[s for _, s, _ in entries],
        block_size=BLOCK,
        num_kv_heads=KVH,
    )
    slots = [
        torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(s)]) for t, (_, s, _) in zip(tables, entries)
    ]
    return query, k_pool, v_pool, bias_pool, meta, [p for _, _, p in entries], slots


def _eager(q, k, v, mask, scale):
    """q ``[H, Lq, D]`` over k/v ``[KVH, L, D]`` plus ``mask`` ``[KVH, Lq, L]`` (repeated per head)."""
    groups = HEADS // KVH
    k, v, mask = (x.repeat_interleave(groups, dim=0) for x in (k, v, mask))
    return torch.softmax(q @ k.transpose(-1, -2) * scale + mask, dim=-1) @ v


def _reference_row(query_row, k, v, bias, position, prompt_len, keep, window, scale):
    """One query row at ``position`` as ``generate`` computes it: ``k``/``v`` ``[KVH, S, D]`` and
    ``bias`` ``[KVH, S]`` the request's whole context; transformers builds the mask."""
    if position < prompt_len:  # the prompt's prefill: rows the prompt long, masked past each query
        length = prompt_len
        q_pos = torch.arange(length).unsqueeze(1)
        k_pos = torch.arange(length).unsqueeze(0)
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        lo, row = 0, position
    else:  # a generated token: the keys its cache returns, none masked
        lo = 0 if window is None else max(0, position - window + 1)
        length = position + 1 - lo
        allowed = torch.ones(1, length, dtype=torch.bool)
        row = 0
    # A chunk of a prompt has fewer keys stored than the prompt's length: generate's row has the
    # later ones too, masked (their biases, here 7.0, never count).
    dt = torch.full((bias.shape[0], length), 7.0)
    stored = min(length, bias.shape[1] - lo)
    dt[:, :stored] = bias[:, lo : lo + stored]
    hidden = torch.empty(1, allowed.shape[0], 1)
    mask = DogeAttention.prepare_dynamic_mask(None, hidden, dt[None], keep, allowed[None, None])[0]  # [KVH, Lq, L]
    keys = slice(lo, lo + stored)
    out = _eager(query_row.unsqueeze(1), k[:, keys], v[:, keys], mask[:, row : row + 1, :stored], scale)
    return out[:, 0]  # [H, D]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("keep", [1, 3, 5])
def test_rows_keep_and_bias_the_keys_generates_masks_keep(keep, window):
    entries = [
        (1, 9, 5),  # a decode past its prompt
        (1, 17, 17),  # a prompt's last token alone (its chunk of one): a prompt row
        (1, 30, 12),
        (7, 7, 7),  # a whole prompt
        (4, 13, 20),  # a chunk of a prompt, the rest to come
        (6, 16, 11),  # a request recomputed after preemption: the prompt's end and generated tokens
    ]
    query, k_pool, v_pool, bias_pool, meta, prompt_lens, slots = _step(entries)
    scale = DIM**-0.5
    got = key_biased_attention(
        query, k_pool, v_pool, bias_pool, meta, scale, keep, prompt_lens, torch.float32, sliding_window=window
    )
    flat_k, flat_v, flat_b = k_pool.view(-1, KVH, DIM), v_pool.view(-1, KVH, DIM), bias_pool.view(-1, KVH)
    for i, (q_len, seq_len, prompt_len) in enumerate(entries):
        k = flat_k[slots[i]].transpose(0, 1)
        v = flat_v[slots[i]].transpose(0, 1)
        bias = flat_b[slots[i]].transpose(0, 1)
        start = meta.query_start_loc_cpu[i]
        for r in range(q_len):
            position = seq_len - q_len + r
            want = _reference_row(query[start + r], k, v, bias, position, prompt_len, keep, window, scale)
            torch.testing.assert_close(got[start + r], want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused():
    query, k_pool, v_pool, bias_pool, meta, prompt_lens, _ = _step([(3, 3, 3)])
    with pytest.raises(ValueError, match="keep=0"):
        key_biased_attention(query, k_pool, v_pool, bias_pool, meta, 1.0, 0, prompt_lens, torch.float32)
    with pytest.raises(ValueError, match="prompt lengths"):
        key_biased_attention(query, k_pool, v_pool, bias_pool, meta, 1.0, 2, [3, 3], torch.float32)


def test_an_int8_pool_reads_as_its_dequantized_values():
    """An int8 KV cache (``kv_quant``: a float32 scale per token and KV head) reads its keys and values
    dequantized: the same output as a float pool holding those dequantized values."""
    from hf_contbatch.kernels.attention.kv_quant import dequantize_kv, quantize_kv

    entries = [(1, 9, 5), (5, 12, 12), (3, 10, 7)]
    query, k_pool, v_pool, bias_pool, meta, prompt_lens, _ = _step(entries, seed=1)
    (kq, ks), (vq, vs) = quantize_kv(k_pool), quantize_kv(v_pool)
    args = (bias_pool, meta, DIM**-0.5, 3, prompt_lens, torch.float32)
    got = key_biased_attention(query, kq, vq, *args, k_scale=ks, v_scale=vs)
    want = key_biased_attention(query, dequantize_kv(kq, ks), dequantize_kv(vq, vs), *args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
