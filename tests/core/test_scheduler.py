"""Scheduler specifications: the five phases in order, budgets, priorities, no leaks."""

from __future__ import annotations

import pytest

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.plan import StopDecision
from hf_contbatch.core.request_state import RequestState
from hf_contbatch.core.scheduler import PHASES, Scheduler
from hf_contbatch.request import Request, RequestStatus

from conftest import random_prompts
from runner_outputs import length_decisions, runner_output


def _fake_step(sched: Scheduler, out, token: int = 7) -> None:
    """Stand-in for the model: every sampling request gets ``token``; finish at max_new_tokens."""
    sampled = {s.request_id: token for s in out.plan.scheduled if s.samples}
    output = runner_output(sampled)
    sched.update_from_output(out.plan, output, length_decisions(sched, out.plan, output))


def _req(rid, n, new=4, priority=0, t=0.0):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_new_tokens=new), priority=priority, arrival_time=t)


@pytest.mark.timeout(300)
def test_engine_records_the_five_phases_in_order_every_iteration(llama_model):
    eng = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(num_blocks=32)))
    try:
        hs = [eng.submit(p, SamplingParams(max_new_tokens=5)) for p in random_prompts([4, 9, 30])]
        for h in hs:
            h.result(300)
        assert eng.wait_idle(10)
        log = list(eng.phase_log)
    finally:
        eng.close()
    assert log, "no iteration recorded"
    for _, phases in log:
        assert tuple(name for name, _ in phases) == PHASES
        assert all(seconds >= 0 for _, seconds in phases)


@pytest.mark.timeout(150)
def test_token_budget_splits_a_long_prompt_into_chunks():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, watermark=0.0), bm)
    sched.add_request(_req(0, 25))
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append([s.num_new_tokens for s in out.plan.scheduled])
        _fake_step(sched, out)
    # 25 prompt tokens under a 10-token budget: 10 + 10 + 5 (the last chunk samples the first token).
    assert chunks == [[10], [10], [5]]
    assert sched.running[0].output_token_ids == [7]


@pytest.mark.timeout(150)
def test_decodes_come_before_prefill_chunks_and_take_one_token_each():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, watermark=0.0), bm)
    sched.add_request(_req(0, 3, new=10, t=0))
    _fake_step(sched, sched.schedule())  # prefill of request 0
    sched.add_request(_req(1, 20, t=1))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.plan.scheduled] == [(0, 1), (1, 11)]


@pytest.mark.timeout(150)
def test_admission_follows_priority_then_arrival():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, watermark=0.0), bm)
    sched.add_request(_req(0, 4, priority=1, t=0))
    sched.add_request(_req(1, 4, priority=0, t=2))
    sched.add_request(_req(2, 4, priority=0, t=1))
    out = sched.schedule()
    assert [r.request_id for r in out.report.admitted] == [2, 1]


@pytest.mark.timeout(150)
def test_preemption_picks_lowest_priority_then_latest_and_keeps_its_tokens():
    bm = BlockManager(num_blocks=6, block_size=4)  # 24 tokens
    sched = Scheduler(SchedulerConfig(watermark=0.0), bm)
    for rid, prio, t in [(0, 0, 0), (1, 1, 1), (2, 0, 2)]:
        sched.add_request(_req(rid, 7, new=12, priority=prio, t=t))
    preempted = []
    for _ in range(12):
        out = sched.schedule()
        preempted += out.report.preempted
        bm.check_invariants()
        assert bm.num_free_blocks >= 0
        _fake_step(sched, out)
        if preempted:
            break
    assert preempted, "the pool of 6 blocks cannot hold three growing requests"
    victim = preempted[0]
    assert victim.request_id == 1  # lowest priority (largest value)
    assert victim.num_computed_tokens == 0 and len(victim.output_token_ids) > 0  # generated tokens kept
    assert victim in sched.waiting


@pytest.mark.timeout(150)
def test_all_blocks_free_after_everything_finishes():
    bm = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, watermark=0.0), bm)
    for rid, n in enumerate([3, 9, 14, 1, 6]):
        sched.add_request(_req(rid, n, new=6, t=rid))
    for _ in range(200):
        out = sched.schedule()
        bm.check_invariants()
        if not sched.has_work:
            break
        _fake_step(sched, out)
    assert not sched.has_work
    assert bm.num_free_blocks == bm.num_blocks


def _at_fork_point(cancel_parent: bool):
    """A parent of 6 prompt tokens with two pending forks, run to its fork point (5 tokens of KV)
    under a 2-token budget, which cannot hold its 3 fork tokens: the forks must detach."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2, watermark=0.0), bm)
    parent = _req(0, 6, new=3)
    children = [Request(rid, list(parent.prompt_token_ids), parent.sampling, parent_id=0) for rid in (1, 2)]
    parent.pending_forks = list(children)
    sched.add_request(parent)
    for _ in range(3):  # 2 + 2 + 1 prompt tokens: the fork point
        _fake_step(sched, sched.schedule())
    assert parent.at_fork_point
    parent.cancel_requested = cancel_parent
    return sched, bm, parent, children


@pytest.mark.timeout(150)
@pytest.mark.parametrize("cancel_parent", [False, True])
def test_budget_changes_no_queue_and_frees_no_block_admit_carries_out_a_detached_fork(cancel_parent):
    sched, bm, parent, children = _at_fork_point(cancel_parent)
    result = sched.begin_iteration()
    result.report.reaped = sched.reap()
    queues = [list(q) for q in (sched.running, sched.waiting, sched.swapped)]
    tables = {rid: list(t) for rid, t in bm.block_tables.items()}
    free = bm.num_free_blocks

    step = sched.budget(result.report)
    assert [list(q) for q in (sched.running, sched.waiting, sched.swapped)] == queues
    assert bm.block_tables == tables and bm.num_free_blocks == free
    assert parent.pending_forks == children and parent.status is RequestStatus.RUNNING
    assert step.detached_forks == [parent] and not step.forks
    # The parent goes on alone with its last prompt token, unless it was cancelled.
    assert [(s.request_id, s.num_new_tokens) for s in step.rows] == ([] if cancel_parent else [(0, 1)])

    sched.admit(result, step)
    assert parent.pending_forks == [] and sched.counters.num_fork_fallbacks == 2
    queued = [r.request_id for r in sched.waiting + result.report.admitted]
    assert sorted(queued) == [1, 2]  # independent requests now, admitted as the budget allows
    if cancel_parent:
        assert parent.status is RequestStatus.FINISHED_CANCELLED and 0 not in bm.block_tables
    sched.preempt(result, step)
    sched.finish_plan(result, step)
    bm.check_invariants()


@pytest.mark.timeout(150)
def test_drop_all_requests_empties_every_queue_and_frees_both_pools():
    bm, host = BlockManager(num_blocks=6, block_size=4), BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(watermark=0.0, preemption_mode="swap"), bm, host_block_manager=host)
    for rid, prio in [(0, 0), (1, 1), (2, 0)]:
        sched.add_request(_req(rid, 7, new=12, priority=prio, t=rid))
    for _ in range(20):  # three growing requests in 6 blocks: one is swapped out
        _fake_step(sched, sched.schedule())
        if sched.swapped:
            break
    assert sched.swapped and sched.running and host.num_used_blocks > 0
    parent = _req(3, 5, t=3)
    parent.pending_forks = [Request(4, list(parent.prompt_token_ids), parent.sampling, parent_id=3)]
    sched.add_request(parent)

    dropped = sched.drop_all_requests()
    assert sorted(r.request_id for r in dropped) == [0, 1, 2, 3, 4]
    assert dropped[-1].request_id == 4  # pending forks come last
    assert not (sched.running or sched.swapped or sched.waiting or sched.has_work)
    assert parent.pending_forks == []
    assert bm.num_free_blocks == 6 and host.num_free_blocks == 16
    bm.check_invariants()
    host.check_invariants()
    assert sched.drop_all_requests() == []


def test_a_stop_decision_finishes_the_request_and_the_tokens_come_once():
    bm = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, watermark=0.0), bm)
    req = _req(0, 9, new=6)
    sched.add_request(req)
    out = sched.schedule()  # the whole 9-token prompt in one step; its last row samples
    output = runner_output({0: 42})
    assert sched.proposed_tokens(out.plan, output) == {0: [42]} and req.output_token_ids == []
    appended = sched.update_from_output(out.plan, output, {0: StopDecision(1, RequestStatus.FINISHED_LENGTH)})
    assert appended == [(req, [42])] and req.output_token_ids == [42]
    assert (req.num_computed_tokens, req.status) == (9, RequestStatus.FINISHED_LENGTH)
    assert sched.proposed_tokens(out.plan, output) == {}  # finished: nothing more to propose
    assert [r.request_id for r in sched.reap()] == [0] and bm.num_free_blocks == 20
    finished, preempted = sched.state.take_departures()
    assert (finished, preempted) == ([0], [])  # the runner's batch drops its row with the next plan


def test_request_state_refuses_computed_tokens_the_request_does_not_have():
    req = _req(0, 9, new=6)
    state = RequestState()
    state.set_computed(req, 9)
    with pytest.raises(ValueError, match=r"num_computed_tokens must be in \[0, 9\]"):
        state.set_computed(req, 10)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        state.set_computed(req, -1)
    assert req.num_computed_tokens == 9


def test_the_host_pool_must_slide_over_the_device_pools_window():
    # A swapped request's host table mirrors its device table's null entries: one window for both.
    with pytest.raises(ValueError, match="host pool .* must match the device pool"):
        Scheduler(SchedulerConfig(), BlockManager(8, 4, sliding_window=6), host_block_manager=BlockManager(8, 4))
    sched = Scheduler(SchedulerConfig(), BlockManager(8, 4, sliding_window=6))
    assert sched.host_block_manager.sliding_window == 6 and sched.host_block_manager.num_blocks == 0
