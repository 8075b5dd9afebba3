"""Property-based specifications of the scheduler and block manager, driven by a fake model.

The fake model stands in for the engine's step five. It keeps, for every device and host KV slot, the
``(position, token)`` whose KV the slot holds; executes the plan's swap and copy mappings in the
engine's order; checks that every scheduled request's whole context reads back its own tokens through
its block table; and "samples" a token that is a fixed function of the request's tokens and id. The
expected outputs are therefore computable without the scheduler (``expected_output``): a lost,
duplicated or corrupted token, in the KV or in the output, shows up as a mismatch.

Some workloads run a sliding-window pool (window W): the fake model then reads, for a query at
position ``q``, only positions ``q - W + 1 .. q`` and samples from those alone, as a sliding-window
layer does; positions the window left behind may hold anything (their blocks are reused), and a
request never holds more blocks than its window and the step's tokens span.

After EVERY iteration: the phases ran in order; the block bookkeeping is consistent (ref counts,
free queue, prefix hash map) in both pools; no scheduled token is written into a shared block; the
token budget and ``max_num_seqs`` hold; reservations are never negative; admissions respect the
watermark; every table belongs to a live request of the right state. At the end every request has
finished (or was rejected at submit) within a bound on iterations, and every block is free.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_contbatch.config import SchedulerConfig
from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.plan import RunnerOutput, StepPlan, StepResult, StopDecision
from hf_contbatch.core.scheduler import PHASES, Scheduler
from hf_contbatch.request import Request, RequestStatus, SamplingParams

VOCAB = 40
EOS_TOKENS = (7, 11)


def fake_next_token(tokens: list[int], salt: int) -> int:
    """The fake model's 'sampled' token: depends on the request's tokens (through its KV) and id.
    Two times in three it copies the token that followed the last token's previous occurrence (as
    text often repeats itself), so prompt-lookup drafts are sometimes right and sometimes wrong."""
    h = hash((tuple(tokens[-6:]), len(tokens), salt))
    if h % 3:
        for j in range(len(tokens) - 2, -1, -1):
            if tokens[j] == tokens[-1]:
                return tokens[j + 1]
    return h % (VOCAB - 3) + 3


def expected_output(prompt: list[int], request_id: int, max_new: int, eos: tuple, window=None) -> list[int]:
    """What the request must produce, computed without any scheduler (``window``: the tokens a
    query sees, itself included; None: all)."""
    tokens, out = list(prompt), []
    while len(out) < max_new:
        t = fake_next_token(tokens[-window:] if window else tokens, request_id)
        out.append(t)
        tokens.append(t)
        if t in eos:
            break
    return out


class FakeModel:
    """Slot contents of both pools; moves blocks as the engine does and checks every context read."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, window=None) -> None:
        self.bs = block_size
        self.window = window
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]

    def move_blocks(self, plan: StepPlan) -> None:
        # LLMEngine._move_blocks order: swap in, swap out, copy (sources read before writes).
        for h, d in plan.blocks_to_swap_in:
            self.device[d] = list(self.host[h])
        for d, h in plan.blocks_to_swap_out:
            self.host[h] = list(self.device[d])
        copies = [list(self.device[s]) for s, _ in plan.blocks_to_copy]
        for (_, d), content in zip(plan.blocks_to_copy, copies):
            self.device[d] = content

    def forward(self, plan: StepPlan, request_of) -> RunnerOutput:
        """From the plan alone, as the model runner works: each row's token ids, first position and
        block table; the context is read back from the KV pool (never from the live request)."""
        bs = self.bs
        # Like a real forward: every layer stores this step's K/V before any attention reads.
        # A request verifying drafts runs its last token and the drafts: one "greedy" token per row.
        for s in plan.scheduled:
            for i, t in enumerate(s.token_ids):
                p = s.start_position + i
                self.device[s.block_ids[p // bs]][p % bs] = (p, t)
        out = RunnerOutput()
        for s in plan.scheduled:
            req, table = request_of(s.request_id), s.block_ids  # the live request: the oracle's tokens
            end = s.start_position + s.num_new_tokens
            # The oldest position any of the row's queries sees (all of them without a window).
            lo = max(0, s.start_position - self.window + 1) if self.window else 0
            context = [self.device[table[p // bs]][p % bs] for p in range(lo, end)]
            tokens = req.all_token_ids + list(s.draft_token_ids)  # what the KV must hold (the oracle)
            assert context == [(p, tokens[p]) for p in range(lo, end)], f"request {req.request_id} reads corrupt KV"
            kv = dict(context)
            if s.draft_token_ids:
                out.greedy[s.request_id] = [
                    fake_next_token(self.seen(kv, s.start_position + i), s.request_id) for i in range(s.num_new_tokens)
                ]
            elif s.samples:
                out.sampled[s.request_id] = fake_next_token(self.seen(kv, end - 1), s.request_id)
        return out

    def seen(self, kv: dict, q: int) -> list[int]:
        """The tokens a query at position ``q`` reads from ``kv`` (position -> token): its window."""
        first = max(0, q - self.window + 1) if self.window else 0
        return [kv[p] for p in range(first, q + 1)]


def decide_as_the_engine_does(req: Request, tokens: list[int]) -> StopDecision:
    """The engine's stop decision on a request's proposed tokens, token by token (EOS, then
    max_new_tokens): the first stop keeps the tokens up to it."""
    for k, token in enumerate(tokens):
        if token in req.sampling.eos_token_ids:
            return StopDecision(k + 1, RequestStatus.FINISHED_STOPPED)
        if len(req.output_token_ids) + k + 1 >= req.sampling.max_new_tokens:
            return StopDecision(k + 1, RequestStatus.FINISHED_LENGTH)
    return StopDecision(len(tokens))


def check_iteration(sched: Scheduler, out: StepResult, prior_running: set, max_num_seqs: int, in_batch: set) -> None:
    bm, host = sched.block_manager, sched.host_block_manager
    # The runner's batch, kept as the runner keeps it: rows leave, then new ones come, once each.
    in_batch -= set(out.plan.finished_ids) | set(out.plan.preempted_ids)
    for new in out.plan.new_requests:
        req = sched.request(new.request_id)
        assert new.request_id not in in_batch, "a request's data sent twice"
        assert new.token_ids == tuple(req.all_token_ids) and new.adapter_name == req.sampling.adapter_name
        in_batch.add(new.request_id)
    assert in_batch <= {r.request_id for r in sched.running}, "the runner keeps a row of a request not running"
    assert [name for name, _ in out.report.phases] == list(PHASES[:4])
    bm.check_invariants()
    host.check_invariants()
    owed = sum(len(r.pending_forks) for r in sched.running)
    assert len(sched.running) + owed <= max_num_seqs
    assert out.plan.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert out.report.reserved_blocks >= 0
    ids = [s.request_id for s in out.plan.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for s in out.plan.scheduled:
        req = sched.request(s.request_id)
        assert s.num_new_tokens >= 1 and req.status is RequestStatus.RUNNING
        table = bm.get_block_table(req.request_id)
        # The plan is a value: each row holds what the runner reads, equal to the live state now.
        assert s.request_id == req.request_id and s.block_ids == tuple(table)
        assert s.start_position == req.num_computed_tokens
        last_and_drafts = (req.all_token_ids[-1], *s.draft_token_ids)
        want_ids = (
            last_and_drafts if s.draft_token_ids else tuple(req.all_token_ids[s.start_position :][: s.num_new_tokens])
        )
        assert s.token_ids == want_ids and len(s.token_ids) == s.num_new_tokens
        assert s.request_id in in_batch, "a row whose request's data never reached the runner"
        assert len(table) * bm.block_size >= req.num_computed_tokens + s.num_new_tokens
        for p in range(req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens):
            assert table[p // bm.block_size] != bm.null_block, "a write into the null block"
            assert bm.ref_counts[table[p // bm.block_size]] == 1, "a write into a shared block (no copy-on-write)"
        if bm.sliding_window is not None:
            # Positions start - W + 1 .. start + n - 1 span at most ceil((W - 2 + n) / bs) + 1 blocks.
            span = -(-(bm.sliding_window - 2 + s.num_new_tokens) // bm.block_size) + 1
            assert len(bm.live_blocks(req.request_id)) <= span, "a sliding-window request holds blocks it cannot read"
        if s.draft_token_ids:
            assert s.samples and req.num_computed_tokens + 1 == req.num_tokens
            assert s.num_new_tokens == 1 + len(s.draft_token_ids)
            assert len(req.output_token_ids) + s.num_new_tokens <= req.sampling.max_new_tokens
        else:
            assert s.samples == (req.num_computed_tokens + s.num_new_tokens == req.num_tokens)
    running = {r.request_id for r in sched.running}
    swapped = {r.request_id: r for r in sched.swapped}
    assert set(bm.block_tables) <= running, "a device block table outlived its request's running state"
    assert set(host.block_tables) == set(swapped), "host tables and the swapped queue disagree"
    for rid, req in swapped.items():
        assert len(host.get_block_table(rid)) == bm.blocks_for_tokens(req.num_computed_tokens)
        held = bm.blocks_for_tokens(req.num_computed_tokens) - bm.first_live_block(req.num_computed_tokens)
        assert len(host.live_blocks(rid)) == held, "a swapped-out request holds host blocks its window cannot read"
    assert all(r.status is RequestStatus.WAITING for r in sched.waiting)
    entered = out.report.admitted or out.report.swapped_in
    if entered and prior_running and not out.report.preempted and not out.report.forked:
        assert bm.num_free_blocks >= sched.watermark_blocks, "admission ate into the watermark"


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    tokens = st.integers(3, VOCAB - 1)
    prefixes = [draw(st.lists(tokens, max_size=16)) for _ in range(2)]  # shared "system prompts"
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes + [[]]))
        prompt = prefix + draw(st.lists(tokens, min_size=0 if prefix else 1, max_size=20))
        requests.append(
            dict(
                arrival=draw(st.integers(0, 12)),
                prompt=prompt,
                max_new=draw(st.integers(1, 10)),
                priority=draw(st.integers(0, 2)),
                n=draw(st.sampled_from([1, 1, 1, 2, 3])),
                cancel_at=draw(st.none() | st.integers(0, 60)),
                cancel_parent_only=draw(st.booleans()),  # its forks go on (it computes their prefix)
                eos=draw(st.booleans()),
            )
        )
    max_need = max(-(-(len(r["prompt"]) + r["max_new"]) // bs) for r in requests)
    # Tight pools (preemption is the point); one block short of the largest request: it is rejected.
    num_blocks = draw(st.integers(max(1, max_need - 1), 2 * max_need + 1))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        watermark=draw(st.sampled_from([0.0, 0.05, 0.2])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap", "auto"])),
        long_prefill_token_threshold=draw(st.none() | st.integers(1, 12)),
        max_preemptions=draw(st.integers(1, 4)),
        aging_seconds=draw(st.sampled_from([None, 3.0])),
        swap_cost_per_block=draw(st.sampled_from([0.0, 0.5, 4.0])),
    )
    host_blocks = draw(st.sampled_from([0, 1, max_need, 4 * num_blocks]))
    prefix_caching = draw(st.booleans())
    lookup = draw(st.sampled_from([0, 0, 1, 3]))  # prompt-lookup drafts (speculative decoding)
    for r in requests:
        r["lookup"] = lookup
    window = draw(st.sampled_from([None, None, 1, 2, 5, 9]))  # a sliding-window pool, or full attention
    return bs, num_blocks, host_blocks, prefix_caching, config, requests, window


def run_workload(bs, num_blocks, host_blocks, prefix_caching, config, specs, window=None):
    clock = [0.0]
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=prefix_caching, sliding_window=window)
    host = BlockManager(host_blocks, bs, sliding_window=window)
    sched = Scheduler(config, bm, clock=lambda: clock[0], host_block_manager=host)
    model = FakeModel(num_blocks, host_blocks, bs, window)
    next_id = 0
    groups = []  # (spec, [requests]) of accepted submissions
    work = 0
    for spec in specs:
        if -(-(len(spec["prompt"]) + spec["max_new"]) // bs) > num_blocks and bm.max_tokens_per_step is None:
            continue  # the engine rejects it at submit: it can never fit (a window that fits always does)
        sp = SamplingParams(
            max_new_tokens=spec["max_new"],
            eos_token_ids=EOS_TOKENS if spec["eos"] else (),
            prompt_lookup_num_tokens=spec.get("lookup", 0),
        )
        seqs = []
        for _ in range(spec["n"]):
            seqs.append(
                Request(
                    next_id,
                    list(spec["prompt"]),
                    sp,
                    priority=spec["priority"],
                    arrival_time=float(spec["arrival"]),
                    parent_id=None if not seqs else seqs[0].request_id,
                )
            )
            next_id += 1
        seqs[0].pending_forks = seqs[1:]
        groups.append((spec, seqs))
        work += spec["n"] * (len(spec["prompt"]) + spec["max_new"])
    bound = 25 + 10 * (config.max_preemptions + 2) * (work + 1)
    every = [r for _, seqs in groups for r in seqs]
    empty_in_a_row = 0
    in_batch: set = set()
    for it in range(bound):
        clock[0] = float(it)
        for spec, seqs in groups:
            if spec["arrival"] == it:
                sched.add_request(seqs[0])
            if spec["cancel_at"] == it:
                for r in seqs[:1] if spec.get("cancel_parent_only") else seqs:
                    if not r.status.is_finished:
                        r.cancel_requested = True
        if it > 21 and not sched.has_work:
            break
        prior = {r.request_id for r in sched.running if not r.status.is_finished and not r.cancel_requested}
        out = sched.schedule()
        check_iteration(sched, out, prior, config.max_num_seqs, in_batch)
        empty_in_a_row = empty_in_a_row + 1 if (out.plan.is_empty and sched.has_work and not out.report.reaped) else 0
        assert empty_in_a_row < 3, "the scheduler stalls with work pending"
        model.move_blocks(out.plan)
        output = model.forward(out.plan, sched.request)
        proposed = sched.proposed_tokens(out.plan, output)
        decisions = {rid: decide_as_the_engine_does(sched.request(rid), t) for rid, t in proposed.items()}
        sched.update_from_output(out.plan, output, decisions)
    else:
        pytest.fail(
            f"not finished after {bound} iterations (livelock): {[(r.request_id, r.status) for r in every if not r.status.is_finished]}"
        )
    assert all(r.status.is_finished for r in every), "a request never finished"
    assert bm.num_free_blocks == num_blocks and host.num_free_blocks == host_blocks, "blocks leaked"
    bm.check_invariants()
    for spec, seqs in groups:
        for r in seqs:
            want = expected_output(spec["prompt"], r.request_id, spec["max_new"], r.sampling.eos_token_ids, window)
            if r.status is RequestStatus.FINISHED_CANCELLED:
                assert r.output_token_ids == want[: len(r.output_token_ids)], "cancelled output is not a prefix"
            else:
                assert r.output_token_ids == want, f"request {r.request_id}: tokens lost, duplicated or corrupted"
    return sched


@pytest.mark.timeout(600)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_keep_every_invariant_and_every_token(workload):
    run_workload(*workload)


@pytest.mark.timeout(300)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["swap", "auto"]),
    lengths=st.lists(st.integers(4, 30), min_size=3, max_size=8),
    bs=st.sampled_from([2, 4]),
)
def test_tight_pools_swap_and_every_request_still_finishes(mode, lengths, bs):
    # A pool for about two requests at a time and a roomy host pool: swap preemption must happen.
    specs = [
        dict(
            arrival=0,
            prompt=[3 + (i * 7 + j) % 30 for j in range(n)],
            max_new=12,
            priority=0,
            n=1,
            cancel_at=None,
            eos=False,
        )
        for i, n in enumerate(lengths)
    ]
    num_blocks = 2 * -(-(max(lengths) + 12) // bs)
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, watermark=0.0, preemption_mode=mode, swap_cost_per_block=0.0
    )
    sched = run_workload(bs, num_blocks, 4 * num_blocks, False, config, specs)
    assert sched.counters.num_recompute_preemptions == 0, "a roomy host pool never needs the recompute fallback"
    assert (
        sched.counters.num_blocks_swapped_in == sched.counters.num_blocks_swapped_out
    )  # nothing cancelled: all came back


@pytest.mark.timeout(600)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_device_blocks_are_handed_out_only_by_allocate_slots(workload):
    calls = []  # (pool, caller) of every allocate and fork
    originals = BlockManager.allocate, BlockManager.fork

    def recording(original):
        def call(self, *args, **kwargs):
            calls.append((self, sys._getframe(1).f_code.co_name))
            return original(self, *args, **kwargs)

        return call

    BlockManager.allocate, BlockManager.fork = (recording(f) for f in originals)
    try:
        sched = run_workload(*workload)
    finally:
        BlockManager.allocate, BlockManager.fork = originals
    device = {caller for pool, caller in calls if pool is sched.block_manager}
    host = {caller for pool, caller in calls if pool is sched.host_block_manager}
    assert device <= {"allocate_slots"}, f"device blocks handed out by {device - {'allocate_slots'}}"
    assert host <= {"swap_out"}, "host blocks are taken only by a swap-out"


@pytest.mark.timeout(300)
def test_a_cancelled_parents_copy_source_survives_a_swap_in_of_the_same_step():
    # Found by a random search: request 9's parent is cancelled before it arrives, so it lives only
    # to compute its fork's prefix; the step that forks it also swaps a request in. The fork's
    # partial block is copied from the parent's, and the engine swaps in before it copies: the
    # parent's block must not be handed to the swap-in (the fork would read another request's KV).
    def spec(arrival, prompt, max_new, priority, n, cancel_at, eos, parent_only):
        return dict(arrival=arrival, prompt=prompt, max_new=max_new, priority=priority, n=n, cancel_at=cancel_at,
                    eos=eos, cancel_parent_only=parent_only, lookup=0)  # fmt: skip

    long_prompt = [24, 17, 36, 12, 9, 29, 30, 25, 10, 18, 9, 24, 30, 11, 4, 37, 17, 19, 24, 34, 9, 16, 7, 5, 38, 9, 35]
    specs = [
        spec(2, [5, 21], 8, 1, 1, 48, True, False),
        spec(3, long_prompt, 9, 1, 1, 47, False, True),
        spec(1, [16], 10, 2, 3, None, True, False),
        spec(10, [20, 8], 3, 1, 2, 0, False, True),
    ]
    config = SchedulerConfig(
        max_num_seqs=5,
        max_num_batched_tokens=31,
        watermark=0.05,
        preemption_mode="swap",
        long_prefill_token_threshold=11,
        max_preemptions=3,
        aging_seconds=None,
        swap_cost_per_block=4.0,
    )
    run_workload(4, 18, 9, False, config, specs)
