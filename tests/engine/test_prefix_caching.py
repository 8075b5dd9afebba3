"""Automatic prefix caching and parallel sampling (forks): block-manager rules, scheduler admission
with hits, and real tiny-model outputs equal to transformers' ``generate``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.scheduler import Scheduler
from hf_contbatch.request import Request

from conftest import build_model, random_prompts, reference_greedy
from runner_outputs import runner_output


def _cached_table(bm, key, tokens):
    """Allocate ``tokens`` for ``key`` through the prefix cache and register them as computed."""
    hashes: list[int] = []
    hits = bm.match_prefix(tokens, hashes)
    bm.allocate(key, len(tokens), prefix_blocks=hits)
    bm.cache_full_blocks(key, tokens, hashes, len(tokens))
    bm.check_invariants()
    return hits


# --- block manager ---------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_a_full_prompt_hit_still_leaves_one_token_to_recompute():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10, 18))  # exactly two full blocks
    assert _cached_table(bm, "a", prompt) == []
    hits = bm.match_prefix(prompt, [])
    assert len(hits) == 1  # (8 - 1) // 4: the block holding the last token is recomputed
    assert bm.match_prefix(prompt + [99], []) == bm.get_block_table("a")  # one more token: both blocks hit


@pytest.mark.timeout(150)
def test_hits_share_blocks_by_ref_count_and_chain_on_the_whole_prefix():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    system = list(range(20, 28))
    _cached_table(bm, "a", system + [1, 2, 3])
    hits = _cached_table(bm, "b", system + [4, 5, 6])
    assert hits == bm.get_block_table("a")[:2]
    assert [bm.ref_counts[b] for b in hits] == [2, 2]
    # Same second block of tokens after a different first block: the chained hash does not match.
    assert bm.match_prefix(list(range(30, 34)) + system[4:] + [7], []) == []


@pytest.mark.timeout(150)
def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    old, new = [3, 4, 5, 6, 7], [8, 9, 10, 11, 12]
    _cached_table(bm, "old", old)
    bm.free("old")
    _cached_table(bm, "new", new)
    bm.free("new")
    assert bm.num_cached_free_blocks == 4 and bm.num_free_blocks == 6
    assert len(bm.match_prefix(old, [])) == 2 and len(bm.match_prefix(new, [])) == 2
    # 3 blocks: the two holding no prefix go first, then the least recently freed, tail before head.
    bm.allocate("x", 3 * 2)
    bm.check_invariants()
    assert len(bm.match_prefix(old, [])) == 1 and len(bm.match_prefix(new, [])) == 2
    bm.allocate("x", 4 * 2)
    assert bm.match_prefix(old, []) == [] and len(bm.match_prefix(new, [])) == 2
    assert bm.num_evictions == 2 and bm.num_cached_free_blocks == 2
    bm.check_invariants()


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "grow", "free", "fork"]),
        st.integers(0, 5),
        st.lists(st.integers(3, 6), min_size=1, max_size=14),
        st.integers(0, 5),
    ),
    max_size=40,
)


@pytest.mark.timeout(300)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, num_blocks=st.integers(4, 24), bs=st.sampled_from([1, 2, 4]))
def test_hash_map_stays_consistent_and_hits_return_the_right_content(ops, num_blocks, bs):
    """Random allocate / grow / free / fork: invariants after every operation, and a hit's block
    always holds exactly the tokens the requester has at that position (tracked independently)."""
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=True)
    content: dict[int, tuple] = {}  # block -> tokens last written into it
    tokens_of: dict[int, list[int]] = {}

    def write(key, start):
        toks, table = tokens_of[key], bm.get_block_table(key)
        for i in range(start // bs, len(table)):
            content[table[i]] = tuple(toks[i * bs : (i + 1) * bs])

    for op, key, toks, other in ops:
        if op == "alloc" and key not in tokens_of:
            hashes: list[int] = []
            hits = bm.match_prefix(toks, hashes)
            for i, b in enumerate(hits):
                assert content[b] == tuple(toks[i * bs : (i + 1) * bs]), "a hit returned a block of other tokens"
            if bm.num_blocks_needed_with_prefix(hits, len(toks)) <= bm.num_free_blocks:
                bm.allocate(key, len(toks), prefix_blocks=hits)
                tokens_of[key] = list(toks)
                write(key, len(hits) * bs)
                bm.cache_full_blocks(key, toks, hashes, len(toks))
        elif op == "grow" and key in tokens_of:
            before = len(tokens_of[key])
            grown = tokens_of[key] + toks
            if bm.num_blocks_needed(key, len(grown)) <= bm.num_free_blocks:
                table = bm.get_block_table(key)
                if before % bs:  # the write starts inside the last block: it must be private
                    assert bm.ref_counts[table[before // bs]] == 1, "a partial block is shared"
                bm.allocate(key, len(grown))
                tokens_of[key] = grown
                write(key, before)
                bm.cache_full_blocks(key, grown, [], len(grown))
        elif op == "free" and key in tokens_of:
            bm.free(key)
            del tokens_of[key]
        elif op == "fork" and key in tokens_of and other not in tokens_of and bm.num_free_blocks > 0:
            n = len(tokens_of[key])
            copy = bm.fork(key, other, n)
            tokens_of[other] = list(tokens_of[key])
            if copy is not None:
                content[copy[1]] = content[copy[0]]
        bm.check_invariants()
    for key in list(tokens_of):
        bm.free(key)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks


@pytest.mark.timeout(150)
def test_admission_sets_num_computed_tokens_from_hits_and_counts_the_hit_rate():
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(watermark=0.0), bm)
    system = list(range(100, 116))  # 16 tokens: 4 full blocks
    first = Request(0, system + [1, 2], SamplingParams(max_new_tokens=2), arrival_time=0.0)
    sched.add_request(first)
    out = sched.schedule()
    sched.update_from_output(out.plan, runner_output({0: 7}))
    second = Request(1, system + [3, 4, 5], SamplingParams(max_new_tokens=2), arrival_time=1.0)
    sched.add_request(second)
    out = sched.schedule()
    assert second in out.report.admitted and second.num_computed_tokens == 16
    assert [(s.request_id, s.num_new_tokens) for s in out.plan.scheduled] == [(0, 1), (1, 3)]
    assert bm.get_block_table(1)[:4] == bm.get_block_table(0)[:4]
    assert out.report.num_prefix_hit_tokens == 16
    assert bm.prefix_hit_rate == pytest.approx(16 / (18 + 19))
    bm.check_invariants()


# --- real tiny model ----------------------------------------------------------------------------------
def _engine(model, **cache):
    cache.setdefault("block_size", 4)
    sched = cache.pop("scheduler", SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48))
    return LLMEngine(model, EngineConfig(cache=CacheConfig(**cache), scheduler=sched))


@pytest.mark.timeout(900)
def test_shared_system_prompt_is_computed_once_and_outputs_equal_generate():
    model = build_model("llama")
    system = random_prompts([24], seed=11)[0]  # 6 full blocks of 4
    prompts = [system + tail for tail in random_prompts([3, 5, 1, 6], seed=12)]
    refs = [reference_greedy(model, p, 10) for p in prompts]
    eng = _engine(model, num_blocks=64, enable_prefix_caching=True)
    try:
        first = eng.submit(prompts[0], SamplingParams(max_new_tokens=10)).result(300)
        rest = [h.result(300) for h in [eng.submit(p, SamplingParams(max_new_tokens=10)) for p in prompts[1:]]]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert [o.output_token_ids for o in [first, *rest]] == refs
    assert stats.prefix_cache_hit_tokens == 3 * 24  # every later request found the whole system prompt
    assert stats.prefix_cache_hit_rate == pytest.approx(72 / sum(len(p) for p in prompts))
    assert stats.num_free_blocks == 64 and stats.num_cached_blocks > 0


@pytest.mark.timeout(900)
def test_prefix_caching_under_recompute_preemption_equals_generate():
    model = build_model("llama")
    system = random_prompts([12], seed=21)[0]
    prompts = [system + tail for tail in random_prompts([5, 17, 9, 30, 2, 21], seed=22)]
    refs = [reference_greedy(model, p, 16) for p in prompts]
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, preemption_mode="recompute")
    eng = _engine(model, num_blocks=24, enable_prefix_caching=True, scheduler=sched)
    try:
        outs = [h.result(600) for h in [eng.submit(p, SamplingParams(max_new_tokens=16)) for p in prompts]]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert [o.output_token_ids for o in outs] == refs
    assert stats.num_preemptions_recompute > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.num_free_blocks == 24


@pytest.mark.timeout(900)
def test_forked_greedy_sequences_each_equal_generate():
    model = build_model("llama")
    prompts = random_prompts([13, 16, 1, 30], seed=31)  # 13: partial block copied; 16 + 1: none; 1: no fork
    refs = [reference_greedy(model, p, 8) for p in prompts]
    eng = _engine(model, num_blocks=64)
    try:
        groups = [eng.submit(p, SamplingParams(max_new_tokens=8), num_return_sequences=3) for p in prompts]
        outs = [[h.result(300).output_token_ids for h in g] for g in groups]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert outs == [[r] * 3 for r in refs]
    assert stats.num_forks == 6 and stats.num_fork_fallbacks == 0  # 3 prompts x 2 forks; the 1-token one cannot fork
    assert stats.num_free_blocks == 64


@pytest.mark.timeout(900)
def test_forked_sequences_sample_exactly_like_independent_seeded_requests():
    """Copy-on-write check: sampled sequences write different tokens after the fork; if a fork
    wrote into a block it shares, its siblings would read foreign KV and diverge from the same
    seeds run as independent requests."""
    model = build_model("llama")
    prompts = random_prompts([14, 21], seed=41)
    sp = SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.03, seed=1234)
    eng = _engine(model, num_blocks=64)
    try:
        groups = [eng.submit(p, sp, num_return_sequences=4) for p in prompts]
        forked = [[h.result(300).output_token_ids for h in g] for g in groups]
        assert eng.stats().num_forks == 6
        independent = [
            [
                eng.submit(p, SamplingParams(**{**sp.__dict__, "seed": 1234 + k})).result(300).output_token_ids
                for k in range(4)
            ]
            for p in prompts
        ]
        assert eng.wait_idle(10)
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert forked == independent
    assert all(len({tuple(o) for o in g}) > 1 for g in forked), "the sequences should differ (sampling)"


@pytest.mark.timeout(600)
def test_cancelling_a_not_yet_forked_sequence_resolves_it_and_keeps_its_siblings(llama_model):
    prompt = random_prompts([160], seed=51)[0]
    eng = _engine(llama_model, num_blocks=64, scheduler=SchedulerConfig(max_num_batched_tokens=8))
    try:
        handles = eng.submit(prompt, SamplingParams(max_new_tokens=6), num_return_sequences=3)
        handles[1].cancel()  # 160 prompt tokens at 8 per step: the fork is ~20 steps ahead
        outs = [h.result(300) for h in handles]
        assert eng.wait_idle(10)
        assert eng.stats().num_free_blocks == 64
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert [o.finish_reason for o in outs] == ["length", "cancelled", "length"]
    assert outs[0].output_token_ids == outs[2].output_token_ids == reference_greedy(llama_model, prompt, 6)
    assert outs[1].output_token_ids == outs[0].output_token_ids[: len(outs[1].output_token_ids)]


# --- the default ---------------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_by_default_a_prompt_sent_again_reuses_its_blocks_and_equals_generate(llama_model):
    prompt = random_prompts([37], seed=21)[0]  # block 16: two full blocks, the third recomputed
    ref = reference_greedy(llama_model, prompt, 8)
    eng = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(num_blocks=32)))
    try:
        outs = [eng.submit(prompt, SamplingParams(max_new_tokens=8)).result(300) for _ in range(2)]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
        long = eng.submit(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
        next(long.token_stream())  # closed below while it runs and holds blocks
    finally:
        eng.close()
    assert [o.output_token_ids for o in outs] == [ref, ref]
    assert stats.prefix_caching is True and stats.prefix_cache_hit_tokens == 2 * 16
    assert stats.num_used_blocks == 0 and stats.num_cached_blocks == (37 + 8) // 16  # its full blocks
    # close() freed the pool's memory: every block free, none said to hold a cached prefix.
    closed = eng.stats()
    assert closed.num_free_blocks == closed.num_blocks and closed.num_cached_blocks == 0
    eng.block_manager.check_invariants()


@pytest.mark.timeout(900)
def test_reset_prefix_cache_makes_the_next_pass_recompute_and_is_refused_while_a_request_runs(llama_model):
    prompt = random_prompts([37], seed=22)[0]
    ref = reference_greedy(llama_model, prompt, 8)
    eng = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(num_blocks=32)))
    try:
        first = eng.submit(prompt, SamplingParams(max_new_tokens=8)).result(300)
        assert eng.wait_idle(10) and eng.stats().num_cached_blocks > 0
        assert eng.reset_prefix_cache() is True
        assert eng.stats().num_cached_blocks == 0
        again = eng.submit(prompt, SamplingParams(max_new_tokens=8)).result(300)
        assert eng.stats().prefix_cache_hit_tokens == 0  # recomputed: nothing was left to hit
        long = eng.submit(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
        next(long.token_stream())  # it is running and holds blocks
        assert eng.reset_prefix_cache() is False
        long.cancel()
        assert eng.wait_idle(30)
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert first.output_token_ids == again.output_token_ids == ref


@pytest.mark.parametrize("value", ["False", 0, 1, None])
def test_enable_prefix_caching_takes_only_a_bool(value):
    with pytest.raises(ValueError, match=r"`enable_prefix_caching` must be True or False, got " + repr(value)):
        CacheConfig(enable_prefix_caching=value)
