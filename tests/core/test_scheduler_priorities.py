"""Scheduler specifications on CPU with a fake model: priorities (preemption for a seat,
FCFS, aging, escalation), the long-prefill threshold, swap preemption and its fallbacks, swapped
requests resuming first, cancellation of swapped requests, and the budget step's arithmetic."""

from __future__ import annotations

import pytest

from hf_contbatch.config import SchedulerConfig
from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.queues import Rank
from hf_contbatch.core.scheduler import Scheduler
from hf_contbatch.request import Request, RequestStatus, SamplingParams

from runner_outputs import length_decisions, runner_output


def _req(rid, n, new=4, priority=0, t=0.0):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_new_tokens=new), priority=priority, arrival_time=t)


def _sched(num_blocks=64, block_size=4, host_blocks=0, clock=None, **cfg):
    cfg.setdefault("watermark", 0.0)
    bm = BlockManager(num_blocks, block_size)
    kwargs = {"host_block_manager": BlockManager(host_blocks, block_size)}
    if clock is not None:
        kwargs["clock"] = clock
    return Scheduler(SchedulerConfig(**cfg), bm, **kwargs)


def _step(sched, token=7):
    """One iteration with a fake model: every sampling request gets ``token``; finish at max_new_tokens."""
    out = sched.schedule()
    sampled = {s.request_id: token for s in out.plan.scheduled if s.samples}
    output = runner_output(sampled)
    sched.update_from_output(out.plan, output, length_decisions(sched, out.plan, output))
    sched.block_manager.check_invariants()
    sched.host_block_manager.check_invariants()
    return out


# --- priorities ---------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_higher_priority_arrival_preempts_a_lower_one_when_max_num_seqs_is_the_limit():
    sched = _sched(max_num_seqs=1, aging_seconds=None)
    low = _req(0, 4, new=20, priority=2)
    sched.add_request(low)
    _step(sched)
    _step(sched)
    high = _req(1, 4, new=3, priority=0, t=1.0)
    sched.add_request(high)
    out = _step(sched)
    # Plenty of blocks: the seat was the limit, and the better priority took it.
    assert out.report.preempted == [low] and out.report.admitted == [high]
    assert low.output_token_ids == [7, 7] and low in sched.waiting  # its tokens are kept


@pytest.mark.timeout(150)
def test_same_priority_never_preempts_for_a_seat_first_come_first_served():
    sched = _sched(max_num_seqs=1, aging_seconds=None)
    first, second = _req(0, 4, new=6, t=0.0), _req(1, 4, new=2, t=1.0)
    sched.add_request(first)
    _step(sched)
    sched.add_request(second)
    admitted = []
    for _ in range(12):
        out = _step(sched)
        assert not out.report.preempted
        admitted += [r.request_id for r in out.report.admitted]
    assert admitted == [1] and first.status.is_finished and second.status.is_finished


@pytest.mark.timeout(150)
def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = _sched(max_num_seqs=1, aging_seconds=None)
    for rid, prio, t in [(0, 1, 0.0), (1, 0, 3.0), (2, 1, 1.0), (3, 0, 2.0)]:
        sched.add_request(_req(rid, 3, new=1, priority=prio, t=t))
    order = []
    for _ in range(10):
        order += [r.request_id for r in _step(sched).report.admitted]
    assert order == [3, 1, 0, 2]


@pytest.mark.timeout(150)
def test_aging_lets_a_long_waiting_low_priority_request_overtake_newer_high_priority_ones():
    now = [0.0]
    sched = _sched(max_num_seqs=1, aging_seconds=10.0, clock=lambda: now[0])
    blocker = _req(0, 3, new=30, priority=0, t=0.0)
    old_low = _req(1, 3, new=1, priority=2, t=0.0)
    sched.add_request(blocker)
    sched.add_request(old_low)
    order = []
    for i in range(60):
        now[0] = float(i)
        if i >= 21 and i % 2 == 0:  # a stream of priority-0 arrivals, each 21+ s younger than old_low
            sched.add_request(_req(100 + i, 3, new=1, priority=0, t=float(i)))
        order += [r.request_id for r in _step(sched).report.admitted]
    # 20 s of age is worth 2 levels: old_low (2 - 0/10) ranks with a priority-0 request that arrived
    # at t=20, so it goes before every arrival after t=20, though they have nominally higher priority.
    assert order.index(1) < order.index(122)
    without_aging = _sched(max_num_seqs=1, aging_seconds=None)
    assert without_aging.rank(_req(122, 3, priority=0, t=22.0)) < without_aging.rank(_req(1, 3, priority=2, t=0.0))


def test_rank_names_its_fields_escalation_tier_aged_level_arrival_and_id():
    sched = _sched(aging_seconds=4.0, max_preemptions=2, clock=lambda: 10.0)  # aging counts from t=10
    req = _req(7, 3, priority=2, t=16.0)
    rank = sched.rank(req)
    assert rank == Rank(tier=1, level=2 + (16.0 - 10.0) / 4.0, arrival=16.0, request_id=7)
    assert (rank.level, rank.escalated) == (3.5, False)
    req.num_preemptions = 2  # max_preemptions reached: ahead of any priority level
    escalated = sched.rank(req)
    assert escalated.tier == 0 and escalated.escalated
    assert escalated < sched.rank(_req(8, 3, priority=0, t=0.0))


@pytest.mark.timeout(150)
def test_max_preemptions_escalates_a_request_ahead_of_everything_and_out_of_victim_choice():
    sched = _sched(max_num_seqs=1, max_preemptions=1, aging_seconds=None)
    low = _req(0, 4, new=20, priority=5)
    sched.add_request(low)
    _step(sched)
    sched.add_request(_req(1, 4, new=3, priority=0, t=1.0))
    assert _step(sched).report.preempted == [low]  # first preemption: it escalates now
    assert low.num_preemptions == 1
    high2 = _req(2, 4, new=3, priority=0, t=2.0)
    sched.add_request(high2)
    assert sched.waiting[0] is low, "an escalated request ranks before any priority"
    for _ in range(30):
        out = _step(sched)
        assert low not in out.report.preempted, "an escalated request was preempted again"
    assert low.status is RequestStatus.FINISHED_LENGTH and low.output_token_ids == [7] * 20


@pytest.mark.timeout(150)
def test_long_prefill_token_threshold_caps_a_long_prompt_so_short_ones_run_in_the_same_step():
    sched = _sched(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    sched.add_request(_req(0, 100, t=0.0))
    for rid in (1, 2):
        sched.add_request(_req(rid, 5, t=float(rid)))
    out = _step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.plan.scheduled] == [(0, 8), (1, 5), (2, 5)]
    out = _step(sched)
    assert dict((s.request_id, s.num_new_tokens) for s in out.plan.scheduled)[0] == 8
    unlimited = _sched(max_num_batched_tokens=32)
    unlimited.add_request(_req(0, 100, t=0.0))
    unlimited.add_request(_req(1, 5, t=1.0))
    assert [(s.request_id, s.num_new_tokens) for s in _step(unlimited).plan.scheduled] == [(0, 32)]


# --- swap preemption ------------------------------------------------------------------------------
def _pressure(mode, host_blocks, **cfg):
    """Three requests in a 6-block pool: they cannot all grow; returns (scheduler, requests)."""
    sched = _sched(num_blocks=6, host_blocks=host_blocks, preemption_mode=mode, aging_seconds=None, **cfg)
    reqs = [_req(rid, 7, new=12, priority=prio, t=float(rid)) for rid, prio in [(0, 0), (1, 1), (2, 0)]]
    for r in reqs:
        sched.add_request(r)
    return sched, reqs


@pytest.mark.timeout(150)
def test_swap_preemption_moves_kv_to_the_host_and_keeps_num_computed_tokens():
    sched, reqs = _pressure("swap", host_blocks=16)
    for _ in range(20):
        out = _step(sched)
        if out.report.swapped_out:
            break
    victim = out.report.swapped_out[0]
    assert victim is reqs[1]  # lowest priority
    assert victim.status is RequestStatus.SWAPPED and victim in sched.swapped
    assert victim.num_computed_tokens > 0 and victim.output_token_ids  # nothing to recompute, tokens kept
    host_table = sched.host_block_manager.get_block_table(victim.request_id)
    assert [h for _, h in out.plan.blocks_to_swap_out] == host_table
    assert len(host_table) == -(-victim.num_computed_tokens // 4)
    assert victim.request_id not in sched.block_manager.block_tables
    computed = victim.num_computed_tokens
    for _ in range(60):
        out = _step(sched)
        if victim in out.report.swapped_in:
            break
    device_table = sched.block_manager.get_block_table(victim.request_id)
    assert victim.num_computed_tokens == computed + 1  # resumed where it stopped: only its pending token ran
    assert set(zip(host_table, device_table)) <= set(out.plan.blocks_to_swap_in)
    assert sched.counters.num_recompute_preemptions == 0
    for _ in range(60):
        _step(sched)
    assert all(r.output_token_ids == [7] * 12 for r in reqs)
    assert sched.block_manager.num_free_blocks == 6 and sched.host_block_manager.num_free_blocks == 16


@pytest.mark.timeout(150)
def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    sched, reqs = _pressure("swap", host_blocks=1)
    for _ in range(20):
        out = _step(sched)
        if out.report.preempted:
            break
    assert out.report.preempted and not out.report.swapped_out
    assert out.report.preempted[0].num_computed_tokens == 0 and sched.counters.num_swap_fallbacks == 1


@pytest.mark.timeout(150)
@pytest.mark.parametrize("cost, expected", [(0.0, "swap"), (1000.0, "recompute")])
def test_auto_mode_swaps_when_moving_blocks_is_cheaper_than_recomputing_tokens(cost, expected):
    sched, _ = _pressure("auto", host_blocks=16, swap_cost_per_block=cost)
    for _ in range(20):
        out = _step(sched)
        if out.report.preempted:
            break
    assert out.report.preempted
    assert (sched.counters.num_swap_preemptions, sched.counters.num_recompute_preemptions) == (
        (1, 0) if expected == "swap" else (0, 1)
    )


@pytest.mark.timeout(150)
def test_swapped_request_resumes_before_a_newer_arrival_of_the_same_priority():
    sched = _sched(num_blocks=8, host_blocks=16, preemption_mode="swap", aging_seconds=None)
    a, b = _req(0, 12, new=12, t=0.0), _req(1, 12, new=12, t=1.0)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(30):
        if _step(sched).report.swapped_out:
            break
    assert b.status is RequestStatus.SWAPPED
    late = _req(2, 4, new=2, t=5.0)
    sched.add_request(late)
    order = []
    for _ in range(40):
        out = _step(sched)
        order += [r.request_id for r in out.report.swapped_in + out.report.admitted]
        # While b waits on the host, the newer request never takes blocks ahead of it.
        assert not (late.status is RequestStatus.RUNNING and b.status is RequestStatus.SWAPPED)
    assert order.index(1) < order.index(2)


@pytest.mark.timeout(150)
def test_cancelling_a_swapped_request_frees_its_host_blocks_at_the_next_reap():
    sched, reqs = _pressure("swap", host_blocks=16)
    for _ in range(20):
        if _step(sched).report.swapped_out:
            break
    victim = sched.swapped[0]
    partial = list(victim.output_token_ids)
    victim.cancel_requested = True
    out = _step(sched)
    assert victim in out.report.reaped and victim.status is RequestStatus.FINISHED_CANCELLED
    assert victim.output_token_ids == partial  # the partial output stays with the handle
    assert sched.host_block_manager.num_free_blocks == 16 and not sched.swapped


# --- the budget step ---------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_budget_is_free_blocks_minus_running_reservations_minus_watermark():
    sched = _sched(num_blocks=40, block_size=4, watermark=0.1)  # watermark: 4 blocks
    a, b = _req(0, 8, new=10), _req(1, 6, new=10, t=1.0)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched)  # a: 8 tokens in 2 blocks (full), b: 6 tokens in 2 blocks
    out = sched.schedule()
    # This step a writes its 9th token (a new block), b its 7th (fits): reservation 1 block.
    assert out.report.reserved_blocks == 1
    assert out.report.budget_blocks == (40 - 4) - 1 - 4
