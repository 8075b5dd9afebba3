"""``EngineStats.num_kv_tokens`` counts the tokens the device pool holds, each slot once: blocks
shared by ``num_return_sequences`` forks or by prefix-cache hits are not counted once per request
(that figure is ``num_logical_kv_tokens``). So tokens <= used blocks x block size <= capacity."""

from __future__ import annotations

import pytest

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.frontends.dashboard import format_stats

from conftest import random_prompts


def slots_holding_kv(engine) -> set[tuple[int, int]]:
    """Brute force: the (block, offset) of every computed position of every request in the pool."""
    computed = {r.request_id: r.num_computed_tokens for r in engine.scheduler.all_requests()}
    bm = engine.block_manager
    return {
        (table[p // bm.block_size], p % bm.block_size)
        for rid, table in bm.block_tables.items()
        for p in range(computed[rid])
    }


@pytest.mark.timeout(600)
def test_tokens_count_shared_blocks_once_with_forks_and_prefix_hits(llama_model):
    prompt = random_prompts([33], seed=61)[0]  # two full blocks of 16, and one token
    engine = LLMEngine(
        llama_model,
        EngineConfig(
            cache=CacheConfig(block_size=16, num_blocks=8, enable_prefix_caching=True),  # capacity 128 tokens
            scheduler=SchedulerConfig(max_num_batched_tokens=8),  # the prompt prefills over 4 steps
            linear_backend="torch",
        ),
    )
    sp = SamplingParams(max_new_tokens=6)
    hit: list = []  # the request with the same prompt, submitted once the forks exist
    marks = {}

    def check() -> None:
        stats = engine.stats()
        holders = [r for r in engine.scheduler.all_requests() if r.request_id in engine.block_manager.block_tables]
        assert stats.num_kv_tokens == len(slots_holding_kv(engine))
        assert stats.num_logical_kv_tokens == sum(r.num_computed_tokens for r in holders)
        assert stats.num_kv_tokens <= stats.num_used_blocks * stats.block_size <= stats.capacity_tokens
        if stats.num_forks == 2 and "fork" not in marks:
            marks["fork"] = stats
            hit.append(engine.submit(prompt, sp))  # hits the two full blocks the sequences share
        elif stats.prefix_cache_hit_tokens and "hit" not in marks:
            marks["hit"] = stats

    try:
        forked = engine.submit(prompt, sp, num_return_sequences=3)
        engine.driver.drive(lambda: all(h.done() for h in [*forked, *hit]), after_iteration=check)
        assert all(h.done() for h in [*forked, *hit])
        final = engine.stats()
    finally:
        engine.close()
    # The fork step: 32 prompt tokens in two shared blocks; each of the 3 sequences computed the
    # last prompt token into a block of its own.
    fork = marks["fork"]
    assert (fork.num_kv_tokens, fork.num_logical_kv_tokens, fork.num_used_blocks) == (32 + 3 * 1, 3 * 33, 5)
    # One step later the new request took the two shared blocks from the prefix cache and computed
    # its last prompt token; the sequences decoded one token each. As the requests see it, 135
    # tokens: more than the pool holds.
    at_hit = marks["hit"]
    assert at_hit.prefix_cache_hit_tokens == 32
    assert (at_hit.num_kv_tokens, at_hit.num_logical_kv_tokens, at_hit.num_used_blocks) == (
        32 + 3 * 2 + 1,
        3 * 34 + 33,
        6,
    )
    assert "39/128 tokens (135 logical: shared blocks once per request)" in format_stats(at_hit)
    assert (final.num_kv_tokens, final.num_logical_kv_tokens, final.num_used_blocks) == (0, 0, 0)
