"""Sliding-window KV cache groups end to end: a model whose layers all slide over W tokens keeps only
its window's blocks, so a request longer than the whole pool is served, and greedy outputs equal
transformers' generate (also with W below the prompt length, chunked prefill, preemption by
recompute and by swap, prefix caching, prompt-lookup drafts, an int8 cache). Which layers slide is
read from the config: checked against the window each family's forward really passes to attention.
"""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.engine import kv_pools
from hf_contbatch.engine.kv_groups import kv_cache_groups, layer_windows
from hf_contbatch.kernels.attention.triton_kernels import TRITON_AVAILABLE
from hf_contbatch.kernels.kv_spec import KVCacheSpec

from conftest import build_model, random_prompts, reference_greedy


def _serve(model, prompts, cfg, new, **sampling):
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=new, ignore_eos=True, **sampling)) for p in prompts]
        outs = [h.result(timeout=1500).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        eng.block_manager.check_invariants()
        eng.host_block_manager.check_invariants()
        return outs, eng.stats()
    finally:
        eng.close()


# --- the acceptance case ----------------------------------------------------------------------------
@pytest.mark.timeout(1500)
def test_a_request_longer_than_the_whole_pool_is_served_when_every_layer_slides():
    # A pool of 96 tokens (6 blocks of 16); a 24-token prompt + 120 new tokens = 144 tokens of context,
    # but every layer attends over 16 tokens only.
    model = build_model("mistral", sliding_window=16)
    prompt = random_prompts([24], seed=7)[0]
    ref = reference_greedy(model, prompt, 120)
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=6))
    (out,), stats = _serve(model, [prompt], cfg, 120)
    assert out == ref
    # The prefill holds ceil(24 / 16) = 2 blocks; a decode at position c then holds the blocks from
    # (c - 15) // 16 to c // 16: never more than 2 (block 0 goes when c reaches 31 and block 2 comes
    # at c = 32).
    assert stats.peak_used_blocks == 2 and stats.kv_sliding_window == 16
    assert stats.num_free_blocks == stats.num_blocks == 6, "blocks leaked"


@pytest.mark.timeout(600)
def test_peak_used_blocks_counts_the_blocks_a_chunk_holds_before_the_window_releases_them():
    # W = 4, blocks of 2, a 26-token prompt in chunks of 8. The second chunk (positions 8..15) reads
    # from position 8 - 3 = 5 on: the table holds blocks 2..7 while it runs, 6 blocks, though only
    # blocks 6 and 7 stay once it is computed (positions 13..15 are what a later query reads).
    model = build_model("mistral", sliding_window=4)
    prompt = random_prompts([26], seed=5)[0]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=2, num_blocks=40, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=8),
    )
    (out,), stats = _serve(model, [prompt], cfg, 1)
    assert out == reference_greedy(model, prompt, 1)
    assert stats.peak_used_blocks == 6


@pytest.mark.timeout(600)
def test_the_same_request_is_still_refused_under_full_attention():
    model = build_model("llama")
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=6)))
    try:
        with pytest.raises(ValueError, match="the whole pool holds 96 tokens"):
            eng.submit(random_prompts([24], seed=7)[0], SamplingParams(max_new_tokens=120))
    finally:
        eng.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "window, block_size, num_blocks, prompt_len, new_tokens, pool_says, blocks_needed",
    [
        # 6 blocks of 16 = 96 tokens cannot hold a 90-token window and a step's 16 tokens' blocks
        # (ceil((90 - 2 + 1) / 16) + 1 = 7 blocks): the window frees nothing in this pool.
        (90, 16, 6, 24, 120, r"the whole pool holds 96 tokens .*window of 90", 7),
        # 5 blocks of 2 hold 10 tokens, fewer than the window of 30: the window and a step need
        # ceil((30 - 2 + 1) / 2) + 1 = 16 blocks (the message said the pool held "more than its window").
        (30, 2, 5, 8, 22, r"the whole pool holds 10 tokens \(5 blocks of 2\)", 16),
    ],
)
def test_a_window_wider_than_the_pool_is_refused_with_the_blocks_it_needs(
    window, block_size, num_blocks, prompt_len, new_tokens, pool_says, blocks_needed
):
    model = build_model("mistral", sliding_window=window)
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks)))
    try:
        with pytest.raises(ValueError, match=pool_says) as info:
            eng.submit(random_prompts([prompt_len], seed=7)[0], SamplingParams(max_new_tokens=new_tokens))
        assert f"its window of {window} tokens and a step need {blocks_needed} blocks" in str(info.value)
        assert "more than its window" not in str(info.value)
    finally:
        eng.close()


# --- greedy equals generate -------------------------------------------------------------------------
LENGTHS = [1, 5, 17, 33, 40, 9]
NEW = 24


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("bs", [4, 16])
def test_greedy_equals_generate_with_a_window_below_the_prompt_under_chunked_prefill(bs, backend):
    model = build_model("mistral", sliding_window=5)
    prompts = random_prompts(LENGTHS, seed=11)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=bs, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
        attention_backend=backend,
    )
    outs, stats = _serve(model, prompts, cfg, NEW)
    assert outs == refs
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("bs", [1, 4])
def test_a_window_of_one_token_equals_generate_without_a_cache(bs):
    # W = 1: each query reads its own key only, so a token's successor depends on that token alone.
    # transformers' cached generate is no reference here: its sliding cache keeps keys[-W + 1:],
    # which for W = 1 is the whole cache (a [-0:] slice); its uncached generate runs the full
    # forward with the window's mask each step.
    model = build_model("mistral", sliding_window=1)
    prompts = random_prompts([1, 6, 24], seed=2)
    with torch.no_grad():
        refs = [
            model.generate(
                torch.tensor([p]),
                max_new_tokens=10,
                do_sample=False,
                use_cache=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=bs, num_blocks=16), scheduler=SchedulerConfig(max_num_batched_tokens=8)
    )
    outs, stats = _serve(model, prompts, cfg, 10)
    assert outs == refs
    assert stats.kv_sliding_window == 1 and stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed on this platform")
def test_greedy_equals_generate_with_the_triton_kernels_reading_past_null_entries():
    # Interpreted on CPU. Prefill tiles start at a tile boundary before the window: they read (and
    # mask) the null block where the window moved on, which must hold zeros, not garbage.
    model = build_model("mistral", sliding_window=5)
    prompts = random_prompts([13, 21], seed=17)
    refs = [reference_greedy(model, p, 8) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=8),  # the Triton kernels' smallest block
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2),
        attention_backend="triton",
    )
    outs, stats = _serve(model, prompts, cfg, 8)
    assert outs == refs
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_generate_under_preemption(mode):
    model = build_model("mistral", sliding_window=5)
    prompts = random_prompts(LENGTHS, seed=12)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    # 7 blocks of 4: a 16-token chunk and the 4 positions before it span up to ceil(19 / 4) + 1 = 6
    # blocks, a decode 2; four requests at once do not fit.
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=7, swap_space_gib=0.01 if mode == "swap" else None),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=16, preemption_mode=mode, swap_cost_per_block=0.0, watermark=0.0
        ),
    )
    outs, stats = _serve(model, prompts, cfg, NEW)
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    if mode == "swap":
        assert stats.num_preemptions_swap > 0 and stats.num_blocks_swapped_in == stats.num_blocks_swapped_out > 0
        assert stats.num_swapped_blocks == 0
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(1500)
def test_greedy_equals_generate_with_prefix_caching():
    model = build_model("mistral", sliding_window=6)
    system = random_prompts([21], seed=13)[0]
    prompts = [system + tail for tail in random_prompts([3, 9, 1], seed=14)]
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=40, enable_prefix_caching=True))
    eng = LLMEngine(model, cfg)
    try:
        outs = []
        for p in prompts:  # one after the other: each later prompt finds the shared prefix cached
            outs.append(
                eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(1500).output_token_ids
            )
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert outs == refs
    # The 21-token prefix's 5 full blocks were released as the window moved on, but kept their hashes:
    # the two later prompts hit all 5 (20 tokens each).
    assert stats.prefix_cache_hit_tokens == 2 * 20
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(1500)
def test_a_prefix_hit_survives_the_eviction_of_the_blocks_its_window_does_not_read():
    # 14 blocks of 4: the filler evicts the least recently freed cached blocks, the shared prefix's
    # first ones (released first, as the window left them). A 5-block hit (20 tokens) reads from
    # position 20 - 6 + 1 = 15 on, blocks 3 and 4: those are still cached, so the third prompt hits.
    model = build_model("mistral", sliding_window=6)
    system = random_prompts([21], seed=13)[0]
    prompts = [system + [5, 6, 7], random_prompts([30], seed=18)[0], system + [9, 10]]
    refs = [reference_greedy(model, p, 8) for p in prompts]
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=14, enable_prefix_caching=True))
    eng = LLMEngine(model, cfg)
    try:
        outs = [
            eng.submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True)).result(1500).output_token_ids
            for p in prompts
        ]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert outs == refs
    assert stats.num_prefix_evictions > 0 and stats.prefix_cache_hit_tokens == 20


@pytest.mark.timeout(1500)
def test_forked_greedy_sequences_share_the_window_and_each_equal_generate():
    # 13 and 30 tokens: the fork point (prompt - 1) lies past the window, so the forks share null
    # entries, the parent's live full blocks, and a copy of its partial block.
    model = build_model("mistral", sliding_window=5)
    prompts = random_prompts([13, 30], seed=19)
    refs = [reference_greedy(model, p, 8) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=24)))
    try:
        groups = [eng.submit(p, SamplingParams(max_new_tokens=8), num_return_sequences=3) for p in prompts]
        outs = [[h.result(1500).output_token_ids for h in g] for g in groups]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert outs == [[r] * 3 for r in refs]
    assert stats.num_forks == 4 and stats.num_free_blocks == 24


@pytest.mark.timeout(1500)
def test_greedy_equals_generate_with_prompt_lookup_drafts():
    model = build_model("mistral", sliding_window=6)
    base = random_prompts([6], seed=15)[0]
    prompts = [base * 4, base * 3 + [7, 9]]  # repetitive: the proposer finds n-grams
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=24))
    outs, stats = _serve(model, prompts, cfg, NEW, prompt_lookup_num_tokens=3)
    assert outs == refs
    assert stats.num_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(1500)
def test_an_int8_cache_gives_the_same_tokens_whether_the_window_releases_blocks_or_not(monkeypatch):
    # int8 K/V are not exact, so the reference is the same int8 engine with the model's windows hidden
    # from the pools (one full-attention group: every block kept, the kernels still mask by window):
    # releasing blocks, and reading the null block's zero scales in masked lanes, must change nothing.
    model = build_model("mistral", sliding_window=5)
    prompts = random_prompts([17, 33], seed=16)
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=24, dtype="int8"))
    windowed, stats = _serve(model, prompts, cfg, NEW)
    assert stats.kv_sliding_window == 5 and stats.num_free_blocks == stats.num_blocks
    monkeypatch.setattr(kv_pools, "layer_windows", lambda config: [None] * config.num_hidden_layers)
    kept, full_stats = _serve(model, prompts, cfg, NEW)
    assert full_stats.kv_sliding_window is None
    assert windowed == kept
    assert stats.peak_used_blocks < full_stats.peak_used_blocks


# --- which layers slide -----------------------------------------------------------------------------
def _windows_passed_to_attention(model) -> list:
    """The ``sliding_window`` keyword each layer's attention receives in one forward (recorded by an
    attention function that otherwise runs the family's own eager attention)."""
    import sys

    from transformers import AttentionInterface

    seen: dict = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = kwargs.get("sliding_window")
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("hf_contbatch_test_record_windows", recording)
    model.set_attn_implementation("hf_contbatch_test_record_windows")
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8]]))
    return [seen[i] for i in range(len(seen))]


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("mistral", {}),
        ("mistral", {"sliding_window": None}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 8}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0, "num_hidden_layers": 3}),
        ("gemma2", {"num_hidden_layers": 3}),
        ("phi3", {"sliding_window": 8}),
        ("llama", {}),
        ("gemma", {}),
    ],
)
def test_layer_windows_from_the_config_are_the_windows_the_forward_passes(family, overrides):
    model = build_model(family, **overrides)
    assert layer_windows(model.config) == _windows_passed_to_attention(model)


def _spec(num_layers):
    return KVCacheSpec(num_layers=num_layers, block_size=4, num_kv_heads=2, head_size=16, dtype=torch.float32)


def test_every_layer_sliding_over_one_window_makes_one_sliding_group():
    (group,) = kv_cache_groups(_spec(3), [8, 8, 8])
    assert group.layers == (0, 1, 2) and group.spec.sliding_window == 8 and group.spec.num_null_blocks == 1


@pytest.mark.parametrize("windows", [[None, 8, 8], [8, 4, 8], [None, None, None]])
def test_mixed_or_full_models_are_one_full_attention_group(windows):
    (group,) = kv_cache_groups(_spec(3), windows)
    assert group.layers == (0, 1, 2) and group.spec.sliding_window is None and group.spec.num_null_blocks == 0
    with pytest.raises(ValueError, match="2 layer windows for a spec of 3 layers"):
        kv_cache_groups(_spec(3), windows[:2])
