"""Greedy outputs equal transformers' generate, token for token, in float32 — also under
preemption and chunked prefill."""

from __future__ import annotations

import pytest

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

from conftest import build_model, random_prompts, reference_greedy

FAMILIES = ["llama", "llama-mqa", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"]
LENGTHS = [1, 5, 17, 33, 64, 40, 9]
NEW = 16


def _run(model, prompts, cfg, new=NEW):
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for p in prompts]
        outs = [h.result(timeout=600) for h in handles]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
        return outs, stats
    finally:
        eng.close()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate_with_roomy_pool(family):
    model = build_model(family)
    prompts = random_prompts(LENGTHS)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, stats = _run(model, prompts, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    assert [o.output_token_ids for o in outs] == refs
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_greedy_equals_generate_under_preemption_and_chunked_prefill(family):
    model = build_model(family)
    prompts = random_prompts(LENGTHS, seed=3)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    # 22 blocks of 4 tokens = 88 tokens for 7 requests of up to 80 tokens; 24-token budget forces chunks.
    # Mistral's layers all slide over 8 tokens: a request holds at most ceil((8 - 2 + 24) / 4) + 1 = 9
    # blocks (a prefill chunk) or 3 (a decode), so 8 blocks force preemption there.
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=8 if family == "mistral" else 22),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),
    )
    outs, stats = _run(model, prompts, cfg)
    assert [o.output_token_ids for o in outs] == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(600)
def test_finish_reasons_follow_eos_and_length(llama_model):
    prompts = random_prompts([6, 6], seed=5)
    ref = reference_greedy(llama_model, prompts[0], 8)
    eos = ref[3]  # pretend the 4th generated token is EOS
    eng = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(num_blocks=16)))
    try:
        h_eos = eng.submit(prompts[0], SamplingParams(max_new_tokens=8, eos_token_ids=(eos,)))
        h_len = eng.submit(prompts[1], SamplingParams(max_new_tokens=3))
        o_eos, o_len = h_eos.result(300), h_len.result(300)
    finally:
        eng.close()
    first = ref.index(eos)
    assert o_eos.output_token_ids == ref[: first + 1] and o_eos.finish_reason == "stop"
    assert len(o_len.output_token_ids) == 3 and o_len.finish_reason == "length"


@pytest.mark.timeout(600)
def test_step_positions_and_slot_mapping_follow_the_block_tables():
    """Every step's flattened positions are each request's ``num_computed_tokens + i`` and its
    slot mapping is ``table[p // block_size] * block_size + p % block_size`` (the definition),
    for decodes and for prefill chunks that start and end inside a block."""
    model = build_model("llama")
    prompts = random_prompts([13, 22, 9, 30], seed=8)
    refs = [reference_greedy(model, p, 6) for p in prompts]  # before the engine switches attention
    bs = 4
    cfg = EngineConfig(
        cache=CacheConfig(block_size=bs, num_blocks=40),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=10),  # chunks start mid-block
    )
    eng = LLMEngine(model, cfg)
    checked = {"steps": 0, "mid_block_chunks": 0}
    real = eng.runner.build_metadata

    def spy(plan):
        inputs = real(plan)
        want_pos, want_slots = [], []
        for s in plan.scheduled:
            table = eng.block_manager.get_block_table(s.request_id)
            start = eng.scheduler.request(s.request_id).num_computed_tokens  # the live request, not the plan
            if not s.is_decode and start % bs:
                checked["mid_block_chunks"] += 1
            for p in range(start, start + s.num_new_tokens):
                want_pos.append(p)
                want_slots.append(table[p // bs] * bs + p % bs)
        assert inputs.positions.tolist() == want_pos
        assert inputs.metadata.slot_mapping.tolist() == want_slots
        checked["steps"] += 1
        return inputs

    eng.runner.build_metadata = spy
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts]
        assert [h.result(timeout=300).output_token_ids for h in handles] == refs
    finally:
        eng.close()
    assert checked["steps"] > 10 and checked["mid_block_chunks"] > 0
