"""LongRoPE factors per request (issue 48, item 8): a Phi-3-style model with ``rope_type:
"longrope"`` (``original_max_position_embeddings`` 32, short and long factors far apart). Every
expected token list is the prompt's own greedy ``model.generate`` (transformers' choice of factors:
the prompt's length at prefill, ``p + 1`` at the decode step of position ``p``), whatever the engine
batches, chunks or finds in its prefix cache."""

from __future__ import annotations

import pytest

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

from conftest import build_model, enqueue_at_once, random_prompts, reference_greedy

NEW = 8
# Long factors far from the short ones: a row rotated with the wrong set changes the greedy tokens.
ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 32,
    "factor": 4.0,
    "short_factor": [1.0] * 8,
    "long_factor": [0.05, 0.1, 0.2, 0.5, 16.0, 64.0, 128.0, 256.0],
}
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build_model(
        "phi3",
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        rope_parameters=ROPE,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def prompts():
    p10, p60, p28 = random_prompts([10, 60, 28], seed=3)
    return {
        "short": p10,
        "long": p60,
        "crosses in decode": p28,  # 28 + 8 tokens: the factors switch at the decode of position 32
        "shares 16 with long": p60[:16] + random_prompts([4], seed=5)[0],
        "shares 48 with long": p60[:48] + random_prompts([14], seed=6)[0],
        "shares 16 with crossing": p28[:16] + random_prompts([6], seed=7)[0],
    }


@pytest.fixture(scope="module")
def expected(model, prompts):
    return {name: reference_greedy(model, p, NEW) for name, p in prompts.items()}


def _engine(model, **scheduler):
    return LLMEngine(
        model, EngineConfig(cache=CacheConfig(num_blocks=64, block_size=16), scheduler=SchedulerConfig(**scheduler))
    )


def test_the_factors_matter_here(model, prompts):
    """The test model is sensitive to the factors: the short prompt's last logits under the long
    factors differ from those under its own (short) ones."""
    import torch

    rotary = model.model.rotary_emb
    p = prompts["short"]
    with torch.no_grad():
        # transformers chooses from the forward's largest position: 40 more tokens after the prompt
        # make the forward take the long factors; causal attention keeps them out of its rows.
        ids = torch.tensor([p + [p[-1]] * 40])
        long_logits = model(ids).logits[0, len(p) - 1]
        own = model(torch.tensor([p])).logits[0, -1]
    assert int(long_logits.argmax()) != int(own.argmax())
    assert "forward" not in rotary.__dict__


@pytest.mark.timeout(600)
def test_batched_requests_each_decode_with_their_own_factors(model, prompts, expected):
    names = ["short", "long", "crosses in decode"]
    engine = _engine(model)
    try:
        handles = enqueue_at_once(engine, [prompts[n] for n in names], GREEDY)
        got = [h.result(timeout=300).output_token_ids for h in handles]
    finally:
        engine.close()
    assert got == [expected[n] for n in names]
    assert "forward" not in model.model.rotary_emb.__dict__  # the class's forward again after close


@pytest.mark.timeout(600)
def test_chunked_prefill_equals_one_pass(model, prompts, expected):
    names = ["long", "crosses in decode", "short"]
    engine = _engine(model, max_num_batched_tokens=16)  # 60 tokens: four chunks of at most 16
    try:
        handles = enqueue_at_once(engine, [prompts[n] for n in names], GREEDY)
        got = [h.result(timeout=300).output_token_ids for h in handles]
    finally:
        engine.close()
    assert got == [expected[n] for n in names]


@pytest.mark.timeout(600)
def test_the_prefix_cache_shares_blocks_only_between_prompts_with_the_same_factors(model, prompts, expected):
    engine = _engine(model)
    try:
        first = engine.submit(prompts["long"], GREEDY)
        assert first.result(timeout=300).output_token_ids == expected["long"]
        # 20 tokens: short factors; the 60-token prompt's first block was computed with the long ones.
        short = engine.submit(prompts["shares 16 with long"], GREEDY)
        assert short.result(timeout=300).output_token_ids == expected["shares 16 with long"]
        assert short.request.num_cached_prompt_tokens == 0
        # 62 tokens: long factors like the 60-token prompt: its three full shared blocks are hits.
        long = engine.submit(prompts["shares 48 with long"], GREEDY)
        assert long.result(timeout=300).output_token_ids == expected["shares 48 with long"]
        assert long.request.num_cached_prompt_tokens == 48
        # The crossing request computed its first block with the short factors, then all again with
        # the long ones: a 22-token prompt (short factors) still finds the short block.
        crossing = engine.submit(prompts["crosses in decode"], GREEDY)
        assert crossing.result(timeout=300).output_token_ids == expected["crosses in decode"]
        after = engine.submit(prompts["shares 16 with crossing"], GREEDY)
        assert after.result(timeout=300).output_token_ids == expected["shares 16 with crossing"]
        assert after.request.num_cached_prompt_tokens == 16
    finally:
        engine.close()


def test_drafts_are_refused_only_for_a_request_that_crosses_the_switch(model, prompts, expected):
    engine = _engine(model)
    try:
        drafting = SamplingParams(max_new_tokens=NEW, ignore_eos=True, prompt_lookup_num_tokens=3)
        with pytest.raises(ValueError, match="rope_type 'longrope'.*prompt_lookup_num_tokens=0"):
            engine.submit(prompts["crosses in decode"], drafting)
        got = [engine.submit(prompts[n], drafting).result(timeout=300).output_token_ids for n in ("short", "long")]
        assert got == [expected["short"], expected["long"]]
    finally:
        engine.close()


def test_compile_model_is_refused_naming_the_rope_type(model):
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=16), compile_model=True))
    assert "forward" not in model.model.rotary_emb.__dict__
    assert "_hf_contbatch_rotary_variants" not in model.__dict__


@pytest.mark.timeout(600)
def test_recompute_preemption_in_a_small_pool_keeps_each_request_s_factors(model, prompts, expected):
    """Five requests in a pool of 8 blocks of 16 tokens (room for about two): they preempt one
    another (recompute), and the crossing one may be preempted before or after its switch."""
    names = ["long", "crosses in decode", "short", "shares 48 with long", "shares 16 with crossing"]
    engine = LLMEngine(
        model,
        EngineConfig(
            cache=CacheConfig(num_blocks=8, block_size=16), scheduler=SchedulerConfig(max_num_batched_tokens=32)
        ),
    )
    try:
        handles = enqueue_at_once(engine, [prompts[n] for n in names], GREEDY)
        got = [h.result(timeout=300).output_token_ids for h in handles]
        preemptions = engine.stats().num_preemptions
    finally:
        engine.close()
    assert got == [expected[n] for n in names]
    assert preemptions > 0  # the pool was too small for all of them: the case under test happened


@pytest.mark.timeout(600)
def test_dynamic_ntk_needs_nothing_within_the_context():
    """transformers' "dynamic" rotary changes its frequencies only for a forward longer than
    ``max_position_embeddings``; the engine keeps every request within it, so batched, chunked
    requests of several lengths each equal their own generate with the rotary left as it is."""
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    model = build_model("llama", max_position_embeddings=64, rope_parameters=rope, initializer_range=0.2)
    batch = random_prompts([6, 56, 30], seed=11)
    want = [reference_greedy(model, p, 8) for p in batch]
    engine = _engine(model, max_num_batched_tokens=16)
    try:
        got = [h.result(timeout=300).output_token_ids for h in enqueue_at_once(engine, batch, GREEDY)]
        assert "_hf_contbatch_rotary_variants" not in model.__dict__
    finally:
        engine.close()
    assert got == want


@pytest.mark.timeout(600)
def test_the_model_s_own_generate_while_the_engine_serves_keeps_transformers_choice(model, prompts, expected):
    """The per-row choice applies to the engine thread's forwards only: ``model.generate`` in the
    caller's thread meanwhile takes transformers' own path (and its result)."""
    names = ["long", "crosses in decode", "short"]
    engine = _engine(model, max_num_batched_tokens=16)
    try:
        handles = enqueue_at_once(engine, [prompts[n] for n in names] * 2, GREEDY)
        mine = [reference_greedy(model, prompts[n], NEW) for n in ("short", "crosses in decode")]
        got = [h.result(timeout=300).output_token_ids for h in handles]
    finally:
        engine.close()
    assert mine == [expected["short"], expected["crosses in decode"]]
    assert got == [expected[n] for n in names] * 2
