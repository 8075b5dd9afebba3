"""Prompt-lookup speculative decoding inside the continuous batch: drafts change how many forwards a
request takes, never its tokens. Expected outputs come from transformers' ``generate`` (plain greedy,
and ``generate(prompt_lookup_num_tokens=k)``), the drafts from a brute-force search."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from hf_contbatch import (
    CacheConfig,
    ContinuousBatchingPipeline,
    EngineConfig,
    LLMEngine,
    SamplingParams,
    SchedulerConfig,
)
from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.plan import StopDecision
from hf_contbatch.core.prompt_lookup import NgramProposer
from hf_contbatch.core.scheduler import Scheduler
from hf_contbatch.default_model import default_model_path
from hf_contbatch.request import Request, RequestStatus

from conftest import random_prompts, reference_greedy
from runner_outputs import runner_output

PATH = default_model_path()


def brute_force_drafts(ids: list[int], k: int, max_n: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix (max_n down to 1)."""
    for n in range(min(max_n, len(ids) - 1), 0, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - 1, n - 1, -1):  # continuation start, latest first
            if ids[start - n : start] == suffix:
                return ids[start : start + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 4), min_size=0, max_size=40),
    k=st.integers(0, 6),
    max_n=st.integers(1, 4),
    grow=st.integers(1, 5),
)
def test_ngram_proposer_equals_a_brute_force_search_as_the_context_grows(ids, k, max_n, grow):
    proposer = NgramProposer()
    for end in list(range(0, len(ids), grow)) + [len(ids)]:
        prefix = ids[:end]
        want = brute_force_drafts(prefix, k, max_n) if k and len(prefix) >= 2 else []
        assert proposer.propose("r", prefix, k, max_n) == want
    proposer.forget("r")
    proposer.forget("never-seen")  # ignored


def _engine_outputs(model, prompts, cfg, new, waves=1, **sampling):
    """Greedy outputs of ``prompts`` through one engine; ``waves`` > 1 submits them in that many
    consecutive groups, each after the previous one finished (so later ones can hit its cache)."""
    eng = LLMEngine(model, cfg)
    try:
        outs = []
        size = -(-len(prompts) // waves)
        for i in range(0, len(prompts), size):
            sp = SamplingParams(max_new_tokens=new, ignore_eos=True, **sampling)
            handles = [eng.submit(p, sp) for p in prompts[i : i + size]]
            outs += [h.result(timeout=600).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        eng.block_manager.check_invariants()
        return outs, eng.stats()
    finally:
        eng.close()


CONFIGS = {
    "roomy": EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)),
    # 30 blocks of 4 for 7 requests of up to 112 tokens, a 24-token budget: preemption and chunks.
    "preempt+chunked": EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=30),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),
    ),
    "swap": EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=30, swap_space_gib=0.01),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, preemption_mode="swap"),
    ),
    "prefix-caching": EngineConfig(cache=CacheConfig(block_size=4, num_blocks=96, enable_prefix_caching=True)),
}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_with_drafts_equals_generate(llama_model, name):
    prompts = random_prompts([1, 5, 17, 33, 64, 40, 9])
    waves = 1
    if name == "prefix-caching":
        # The repeats come after the first prompts finished, so they hit the cache (a request that
        # is recomputed after preemption and finds its own blocks is no prefix hit).
        prompts, waves = prompts[:6] + [p[:] for p in prompts[2:5]] + prompts[6:], 2
    new = 48
    refs = [reference_greedy(llama_model, p, new) for p in prompts]
    cfg = CONFIGS[name]
    cfg = EngineConfig(cache=cfg.cache, scheduler=cfg.scheduler, prompt_lookup_num_tokens=4)
    outs, stats = _engine_outputs(llama_model, prompts, cfg, new, waves=waves)
    assert outs == refs
    # A random model's greedy text falls into loops, which prompt lookup predicts.
    assert stats.num_draft_tokens > 0 and stats.num_accepted_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    if name in ("preempt+chunked", "swap"):
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    if name == "swap":
        assert stats.num_preemptions_swap > 0
    if name == "prefix-caching":
        assert stats.prefix_cache_hit_tokens > 0


@pytest.mark.timeout(600)
def test_drafts_never_pass_max_new_tokens_or_the_context(llama_model):
    prompts = random_prompts([3, 12, 20])
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64), prompt_lookup_num_tokens=8)
    for new in (1, 2, 3, 9):
        outs, stats = _engine_outputs(llama_model, prompts, cfg, new)
        assert outs == [reference_greedy(llama_model, p, new) for p in prompts]
    # The model's context (max_position_embeddings) ends the request at "length", drafts or not.
    ctx = llama_model.config.max_position_embeddings
    prompt = random_prompts([ctx - 6])[0]
    ref = reference_greedy(llama_model, prompt, 6)  # before the engine switches the model's attention
    eng = LLMEngine(
        llama_model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=40), prompt_lookup_num_tokens=8)
    )
    try:
        out = eng.submit(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True)).result(600)
        assert len(prompt) + len(out.output_token_ids) == ctx and out.finish_reason == "length"
        assert out.output_token_ids == ref
    finally:
        eng.close()


def _sched(num_blocks: int, bs: int = 4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(watermark=0.0, **cfg), BlockManager(num_blocks, bs))


def _decoding(sched: Scheduler, rid: int, prompt: list[int], first_token: int, k: int = 3) -> Request:
    """A request admitted, prefilled, and holding its first output token."""
    req = Request(rid, prompt, SamplingParams(max_new_tokens=10, prompt_lookup_num_tokens=k))
    sched.add_request(req)
    out = sched.schedule()
    assert [sched.request(s.request_id) for s in out.plan.scheduled] == [req]
    sched.update_from_output(out.plan, runner_output({rid: first_token}))
    return req


def test_drafts_only_take_blocks_that_are_free_so_nobody_is_preempted_for_one():
    # 7 prompt tokens + 1 output = 2 blocks of 4; the lookup proposes 3 drafts (positions 8-10),
    # which would need a third block.
    with_room = _sched(3)
    _decoding(with_room, 0, [3, 4, 5, 3, 4, 5, 3], 4)
    out = with_room.schedule()
    assert out.plan.scheduled[0].draft_token_ids == (5, 3, 4) and out.plan.num_batched_tokens == 4
    tight = _sched(2)
    req = _decoding(tight, 0, [3, 4, 5, 3, 4, 5, 3], 4)
    out = tight.schedule()
    assert not out.report.preempted and out.plan.scheduled[0].draft_token_ids == () and out.plan.num_batched_tokens == 1
    assert tight.block_manager.get_block_table(req.request_id) == tight.block_manager.get_block_table(0)
    assert len(tight.block_manager.get_block_table(0)) == 2


def test_drafts_give_way_to_an_admission_and_rejected_drafts_free_their_blocks():
    sched = _sched(4, max_num_batched_tokens=16)
    req = _decoding(sched, 0, [3, 4, 5, 3, 4, 5, 3], 4)  # 2 blocks; drafts would take a third
    waiting = Request(1, [9, 9, 9, 9, 9, 9, 9], SamplingParams(max_new_tokens=1))  # needs 2 blocks
    sched.add_request(waiting)
    out = sched.schedule()
    assert waiting in out.report.admitted and not out.report.preempted
    assert all(not s.draft_token_ids for s in out.plan.scheduled)
    sched.update_from_output(out.plan, runner_output({0: 5, 1: 6}))
    waiting.status = waiting.status.FINISHED_LENGTH
    # Next step: drafts [3, 4, 5] (3 blocks in all); the model agrees with the first one only.
    out = sched.schedule()
    (s,) = out.plan.scheduled
    assert s.draft_token_ids == (3, 4, 5) and len(sched.block_manager.get_block_table(0)) == 3
    before = req.num_computed_tokens
    sched.update_from_output(out.plan, runner_output({0: [3, 9, 9, 9]}))
    assert req.output_token_ids[-3:] == [5, 3, 9]  # the accepted draft, then the model's token
    assert req.num_computed_tokens == before + 2 and req.num_tokens == req.num_computed_tokens + 1
    assert len(sched.block_manager.get_block_table(0)) == sched.block_manager.blocks_for_tokens(req.num_computed_tokens)
    assert sched.counters.num_draft_tokens == 3 and sched.counters.num_accepted_draft_tokens == 1


# --- through the pipeline, on the embedded (trained) model -------------------------------------


@pytest.fixture(scope="module")
def pipe():
    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)
    p = ContinuousBatchingPipeline(model, PATH, engine_config=EngineConfig(cache=CacheConfig(num_blocks=256)))
    yield p
    p.close()


CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
GROUNDED = [CODE + "Repeat the code above:\n" + CODE[:20], "A list is a list. A list is a", "The for statement"]


def _generate(model, tok, prompt, **kw):
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.timeout(1200)
def test_pipeline_prompt_lookup_equals_generate_with_and_without_it(pipe, ref_model, tok):
    before = pipe.engine.stats()
    got = pipe(GROUNDED, do_sample=False, max_new_tokens=40, prompt_lookup_num_tokens=4, return_full_text=False)
    stats = pipe.engine.stats()
    for prompt, rec in zip(GROUNDED, got):
        plain = _generate(ref_model, tok, prompt, max_new_tokens=40)
        assert rec[0]["generated_text"] == plain
        assert _generate(ref_model, tok, prompt, max_new_tokens=40, prompt_lookup_num_tokens=4) == plain
    assert stats.num_accepted_draft_tokens > before.num_accepted_draft_tokens
    # A stop string inside a run of accepted drafts ends the text where generate ends it.
    text = _generate(ref_model, tok, GROUNDED[0], max_new_tokens=40)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    (rec,) = pipe(GROUNDED[0], do_sample=False, max_new_tokens=40, prompt_lookup_num_tokens=6, stop_strings=[stop])
    assert rec["generated_text"][len(GROUNDED[0]) :] == _generate(
        ref_model, tok, GROUNDED[0], max_new_tokens=40, stop_strings=[stop], tokenizer=tok
    )


@pytest.mark.timeout(1200)
def test_requests_that_cannot_verify_by_argmax_do_not_draft(pipe, ref_model, tok):
    before = pipe.engine.stats().num_draft_tokens
    (rec,) = pipe(GROUNDED[1], do_sample=False, max_new_tokens=20, repetition_penalty=1.3, prompt_lookup_num_tokens=4)
    assert rec["generated_text"][len(GROUNDED[1]) :] == _generate(
        ref_model, tok, GROUNDED[1], max_new_tokens=20, repetition_penalty=1.3
    )
    pipe(GROUNDED[1], do_sample=True, seed=3, max_new_tokens=20, prompt_lookup_num_tokens=4)
    assert pipe.engine.stats().num_draft_tokens == before


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompt_lookup_num_tokens": -1}, "prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": 2.5}, "prompt_lookup_num_tokens"),
        ({"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 0}, "max_matching_ngram_size"),
    ],
)
def test_bad_prompt_lookup_values_are_rejected_and_the_pipeline_keeps_serving(pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipe("A list is", do_sample=False, max_new_tokens=3, **kwargs)
    (rec,) = pipe("A list is", do_sample=False, max_new_tokens=3)
    assert rec["generated_text"].startswith("A list is")
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        EngineConfig(prompt_lookup_num_tokens=-2)


REPEATING = [1, 2, 3, 4, 5, 6, 7, 8] * 4  # a context whose lookup always finds a continuation


def _next_of(req: Request) -> int:
    return REPEATING[len(req.all_token_ids) % 8]


def _step_accepting_every_draft(sched: Scheduler):
    """A fake model that agrees with every draft (the most budget drafts can ever take)."""
    out = sched.schedule()
    sampled = {}
    for s in out.plan.scheduled:
        if s.draft_token_ids:
            sampled[s.request_id] = [*s.draft_token_ids, _next_of(sched.request(s.request_id))]
        elif s.samples:
            sampled[s.request_id] = _next_of(sched.request(s.request_id))
    sched.update_from_output(out.plan, runner_output(sampled))
    return out


def test_drafts_only_take_the_token_budget_nothing_else_needs():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, watermark=0.0), BlockManager(64, 4))
    drafter = Request(0, REPEATING[:16], SamplingParams(max_new_tokens=50, prompt_lookup_num_tokens=10))
    other = Request(1, REPEATING[:16], SamplingParams(max_new_tokens=50), arrival_time=drafter.arrival_time + 1)
    sched.add_request(drafter)
    sched.add_request(other)
    late = None
    for it in range(12):
        if it == 6:
            late = Request(2, REPEATING[:5], SamplingParams(max_new_tokens=5))
            sched.add_request(late)
        out = _step_accepting_every_draft(sched)
        planned = {s.request_id: s for s in out.plan.scheduled}
        if it >= 2:  # once the drafter's prompt is in, the other one gets tokens every step
            assert 1 in planned, f"iteration {it}: drafts took the budget of a running request"
        if it == 6:
            assert late in out.report.admitted, "drafts kept a waiting request out"
    assert sched.counters.num_draft_tokens > 0


def test_a_priority_admission_preempts_no_more_than_without_drafts():
    def preempted(lookup: int) -> list[int]:
        sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, watermark=0.0), BlockManager(20, 4)
        )
        sp = SamplingParams(max_new_tokens=40, prompt_lookup_num_tokens=lookup)
        reqs = [Request(0, REPEATING[:16], sp, priority=5)]
        reqs += [
            Request(i, [20 * i + j for j in range(8)], SamplingParams(max_new_tokens=40), priority=5) for i in (1, 2)
        ]
        for r in reqs:
            sched.add_request(r)
        sched.update_from_output(sched.schedule().plan, runner_output({0: 1, 1: 9, 2: 9}))
        sched.add_request(Request(3, list(range(100, 144)), SamplingParams(max_new_tokens=2), priority=0))
        return [r.request_id for r in sched.schedule().report.preempted]

    assert preempted(8) == preempted(0) and len(preempted(0)) == 1


def test_accepted_drafts_after_a_stop_are_not_counted():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(64, 4))
    req = Request(0, REPEATING[:16], SamplingParams(max_new_tokens=40, prompt_lookup_num_tokens=5, eos_token_ids=(2,)))
    sched.add_request(req)
    sched.update_from_output(sched.schedule().plan, runner_output({0: 1}))
    out = sched.schedule()
    assert out.plan.scheduled[0].draft_token_ids == (2, 3, 4, 5, 6)

    output = runner_output({0: [2, 3, 4, 5, 6, 7]})
    # All five drafts equal the greedy tokens; the engine's EOS check stops at the first one (2).
    assert sched.proposed_tokens(out.plan, output) == {0: [2, 3, 4, 5, 6, 7]}
    sched.update_from_output(out.plan, output, {0: StopDecision(1, RequestStatus.FINISHED_STOPPED)})
    assert req.output_token_ids == [1, 2] and req.status is RequestStatus.FINISHED_STOPPED
    assert (sched.counters.num_accepted_draft_tokens, sched.counters.num_draft_tokens) == (1, 5)
    # KV of the last token (1) and the kept draft (2): 16 prompt tokens + 2; blocks past it freed.
    assert req.num_computed_tokens == 18
    assert len(sched.block_manager.get_block_table(0)) == sched.block_manager.blocks_for_tokens(18)
