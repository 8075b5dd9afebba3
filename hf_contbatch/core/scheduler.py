"""The scheduler's four steps of an iteration: reap -> budget -> admit -> preempt.

Each step is its own public method, called in that order by ``LLMEngine.step`` (which then runs
step five, decode, on the model runner); ``schedule()`` runs the four for callers without a model
(tests, the engine's profiling forward). Each iteration yields a plain ``SchedulerOutput`` that the
engine executes (swap-in, swap-out and copy mappings) and the model runner turns into one flattened
forward. The order is the specification: free before measuring, measure before handing out, and
leave the expensive forward to the end so it sees the densest legal batch. Blocks are handed out in
one place, ``_allocate_slots``.

Request state follows vLLM v1: a request needs ``num_tokens - num_computed_tokens`` more tokens of
KV; prefill, chunked prefill, prefix-cache hits (``num_computed_tokens`` set at admission) and
resumption after recompute or swap preemption are that one rule.

Ordering ("rank"): priority (lower first), then arrival, both folded into one number when aging is on
(``priority + arrival / aging_seconds``: waiting ``aging_seconds`` is worth one priority level). The
rank of a request never changes while it waits, so queues stay sorted by insertion, two requests
never swap places over time (no priority ping-pong), and a request is overtaken only by the bounded
set of arrivals that rank before it. Requests preempted ``max_preemptions`` times escalate ahead of
everything and are preempted only when nothing else is left to preempt.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..config import SchedulerConfig
from ..request import Request, RequestStatus
from .block_manager import BlockManager
from .phases import PHASES, PhaseTimer
from .prompt_lookup import DEFAULT_MAX_MATCHING_NGRAM_SIZE, NgramProposer

__all__ = ["PHASES", "ScheduledRequest", "Scheduler", "SchedulerOutput", "StepBudget"]


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes
    samples: bool  # True when this step completes the request's known tokens, so a token is sampled
    # Prompt-lookup drafts that follow the request's last token this step (speculative decoding):
    # ``num_new_tokens == 1 + len(draft_token_ids)``, and every row yields a greedy token.
    draft_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def for_tokens(cls, request: Request, num_new_tokens: int) -> "ScheduledRequest":
        """``num_new_tokens`` more tokens of ``request``; it samples when they complete its known
        tokens (decided now: ``num_computed_tokens`` advances after the forward)."""
        return cls(request, num_new_tokens, request.num_computed_tokens + num_new_tokens == request.num_tokens)

    @property
    def is_decode(self) -> bool:
        """One query token that is the request's last known token (not a 1-token prefill chunk).
        Decodes come first in a step's batch; attention serves them batched."""
        return self.num_new_tokens == 1 and not self.request.is_prefill

    @property
    def is_speculative(self) -> bool:
        """The last token plus drafts: attention serves each row as a decode with its own length,
        so these come right after the decodes."""
        return bool(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    """One iteration's plan, plain data for the engine and the runner.

    The engine applies the block mappings in this order before the forward: swap in, swap out, copy
    (see ``LLMEngine._move_blocks``); the scheduler only hands out blocks that this order makes safe.

    Attributes:
        iteration: the iteration number.
        scheduled: requests to run, decodes (one token) first, then prefill chunks.
        num_batched_tokens: sum of ``num_new_tokens`` (never above ``max_num_batched_tokens``).
        reaped: requests freed in the reap step (finished, cancelled, and cancelled pending forks).
        preempted: requests preempted this step (by either mode, for memory or for priority).
        swapped_out / swapped_in: requests whose KV moves to / from the host pool this step.
        forked: sequences forked off a parent this step (parallel sampling).
        admitted: requests admitted from the waiting queue.
        blocks_to_swap_out: (device block, host block) pairs.
        blocks_to_swap_in: (host block, device block) pairs.
        blocks_to_copy: (src, dst) device block pairs (copy-on-write of a forked partial block).
        budget_blocks: what the budget step left for admissions: free blocks - reserved_blocks -
            watermark (negative when running requests already need more than is free: step 4
            then preempts).
        reserved_blocks: running requests' blocks for this step's tokens, plus the reserved forks
            and swap-ins.
        num_prefix_hit_tokens: prompt tokens served from the prefix cache at this step's admissions.
        phases: (phase name, seconds) in the order they ran.
    """

    iteration: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    reaped: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    forked: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    budget_blocks: int = 0
    reserved_blocks: int = 0
    num_prefix_hit_tokens: int = 0
    phases: list[tuple[str, float]] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepBudget:
    """What the budget step hands to admit and preempt within one iteration.

    Attributes:
        plan: the requests scheduled so far, with their token counts.
        token_budget: tokens left of ``max_num_batched_tokens``.
        block_budget: blocks left for admissions (free - reservations - watermark; may be negative).
        forks: parents whose forks are reserved for this step.
        swap_ins: (swapped request, tokens) reserved to resume this step.
        swap_barrier_rank: rank of the first swapped request that stays out; no waiting request
            ranked after it is admitted (it would overtake the swapped one).
    """

    plan: list[ScheduledRequest]
    token_budget: int
    block_budget: int = 0
    forks: list[Request] = field(default_factory=list)
    swap_ins: list[tuple[Request, int]] = field(default_factory=list)
    swap_barrier_rank: Optional[tuple] = None


class Scheduler:
    """Decides, each iteration, which requests run and with how many tokens.

    Args:
        config: the scheduler limits.
        block_manager: the device pool's bookkeeping.
        clock: time source (seconds), injectable for tests.
        host_block_manager: the host swap pool's bookkeeping; None (or 0 blocks) means swap
            preemption falls back to recompute.
        swap_cost_per_block: cost of swapping one block out and back in, in tokens of recompute
            (``preemption_mode="auto"``); ``config.swap_cost_per_block`` overrides it. The engine
            estimates it from the model size and the block bytes.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        host_block_manager: Optional[BlockManager] = None,
        swap_cost_per_block: float = 1.0,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.host_block_manager = host_block_manager or BlockManager(0, block_manager.block_size)
        self.clock = clock
        self.swap_cost_per_block = (
            config.swap_cost_per_block if config.swap_cost_per_block is not None else swap_cost_per_block
        )
        self.waiting: list[Request] = []  # sorted by rank
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # sorted by rank
        self.iteration = 0
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.num_swap_fallbacks = 0  # swap wanted, host pool full (or KV not yet valid): recomputed instead
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.num_forks = 0
        self.num_fork_fallbacks = 0  # sequences that could not be forked and recompute their prompt
        self.num_pool_wall_stops = 0  # requests finished "length" because the pool could not grow them
        self.proposer = NgramProposer()  # prompt-lookup drafts (speculative decoding)
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_draft_tokens = 0  # drafts equal to the greedy token, kept
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)
        self._epoch = clock()
        # Requests whose KV arrives by swap-in or fork copy this step: not swappable yet.
        self._kv_arrives_this_step: set[int] = set()

    # --- queue management ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (new, or preempted for recompute) by rank."""
        if request.pending_forks and (
            request.num_prompt_tokens < 2 or 1 + len(request.pending_forks) > self.config.max_num_seqs
        ):
            # Nothing to share before the first token, or never room for all of them at once:
            # the sequences are independent requests.
            forks, request.pending_forks = request.pending_forks, []
            for child in forks:
                self.add_request(child)
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self.rank)

    @property
    def has_work(self) -> bool:
        """True while any request is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def all_requests(self) -> list[Request]:
        """Every unfinished request, pending forks included."""
        queued = self.running + self.swapped + self.waiting
        return queued + [c for r in queued for c in r.pending_forks]

    def rank(self, req: Request) -> tuple:
        """Sort key, smaller first: escalated, then priority level (aged), arrival, id."""
        level: float = req.priority
        if self.config.aging_seconds is not None:
            level = req.priority + (req.arrival_time - self._epoch) / self.config.aging_seconds
        escalated = req.num_preemptions >= self.config.max_preemptions
        return (0 if escalated else 1, level, req.arrival_time, req.request_id)

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept free at admission (``watermark`` of the pool)."""
        return self._watermark_blocks

    # --- the iteration -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Steps 1-4 as ``LLMEngine.step`` runs them, without a model: the plan for the decode step,
        with ``phases`` holding the four steps' seconds."""
        timer = PhaseTimer(self.clock)
        out = self.begin_iteration()
        out.reaped = self.reap()
        timer.charge("reap")
        step = self.budget(out)
        timer.charge("budget")
        self.admit(out, step, timer)
        timer.charge("admit")
        self.preempt(out, step)
        timer.charge("preempt")
        self.finish_plan(out, step)
        out.phases = list(timer.as_tuple()[:4])
        return out

    def begin_iteration(self) -> SchedulerOutput:
        """A new, empty ``SchedulerOutput`` for the next iteration number."""
        out = SchedulerOutput(iteration=self.iteration)
        self.iteration += 1
        self._kv_arrives_this_step.clear()
        return out

    def finish_plan(self, out: SchedulerOutput, step: StepBudget) -> None:
        """Put the plan into ``out`` in the layout attention metadata expects (decodes first, then
        prefill chunks) and check the iteration's invariants."""
        step.plan.sort(key=lambda s: 0 if s.is_decode else 1 if s.is_speculative else 2)
        out.scheduled = step.plan
        out.num_batched_tokens = sum(s.num_new_tokens for s in step.plan)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens, "token budget exceeded"
        assert len(self.running) <= self.config.max_num_seqs, "max_num_seqs exceeded"

    # --- step 1: reap ---------------------------------------------------------------------------
    def reap(self) -> list[Request]:
        """Step 1: drop finished and cancelled requests (any queue) and free their blocks at once."""
        reaped: list[Request] = []
        for queue in (self.running, self.swapped, self.waiting):
            keep = []
            for req in queue:
                if req.pending_forks:
                    reaped += self._reap_pending_forks(req)
                if req.cancel_requested and not req.status.is_finished and not req.pending_forks:
                    req.status = RequestStatus.FINISHED_CANCELLED
                if req.status.is_finished:
                    self.block_manager.free(req.request_id)
                    self.host_block_manager.free(req.request_id)
                    self.proposer.forget(req.request_id)
                    reaped.append(req)
                else:
                    keep.append(req)
            queue[:] = keep
        return reaped

    def _reap_pending_forks(self, req: Request) -> list[Request]:
        """Cancelled not-yet-forked sequences go now; the others go with a finished parent.
        A cancelled parent with live pending forks keeps computing the prefix they share."""
        gone = [c for c in req.pending_forks if c.cancel_requested or req.status.is_finished]
        for c in gone:
            if not c.status.is_finished:
                c.status = RequestStatus.FINISHED_CANCELLED if c.cancel_requested else req.status
        req.pending_forks = [c for c in req.pending_forks if c not in gone]
        return gone

    # --- step 2: budget -----------------------------------------------------------------------
    def budget(self, out: SchedulerOutput) -> StepBudget:
        """Step 2: free blocks - reservations - watermark. Reservations are the blocks the running
        requests need for this step's tokens, then forks that are due, then swap-ins (swapped
        requests resume before any waiting request they rank before)."""
        step = self._plan_running()
        free = self.block_manager.num_free_blocks
        step.block_budget = free - self._reservation(step.plan) - self._watermark_blocks
        self._reserve_forks(step)
        self._reserve_swap_ins(step)
        out.budget_blocks = step.block_budget
        out.reserved_blocks = free - self._watermark_blocks - step.block_budget
        return step

    def _plan_running(self) -> StepBudget:
        """Token budget for running requests: decodes take one token, ongoing prefills a chunk."""
        budget = self.config.max_num_batched_tokens
        plan = []
        for req in sorted(self.running, key=lambda r: (r.is_prefill, self.rank(r))):
            n = self._num_tokens_to_schedule(req, budget)
            if n == 0:
                continue
            plan.append(ScheduledRequest.for_tokens(req, n))
            budget -= n
        return StepBudget(plan=plan, token_budget=budget)

    def _add_drafts(self, step: StepBudget) -> None:
        """Prompt-lookup drafts for the planned decodes, best-ranked first, from what the step has
        left once running requests, forks, swap-ins and admissions have their tokens and blocks:
        a draft never holds back, preempts or keeps waiting anything else, and never takes the
        watermark."""
        bm = self.block_manager
        for i, s in enumerate(step.plan):
            req = s.request
            if step.token_budget < 1:
                return
            if not req.sampling.prompt_lookup_num_tokens or not s.is_decode:
                continue
            # Room in the blocks the decode already has, plus what the step can still hand out.
            held = bm.blocks_for_tokens(req.num_tokens)
            room = (held + max(0, step.block_budget)) * bm.block_size - req.num_tokens
            drafts = self._drafts(req, min(step.token_budget, room))
            if drafts:
                extra = bm.blocks_for_tokens(req.num_tokens + len(drafts)) - held
                step.plan[i] = ScheduledRequest(req, 1 + len(drafts), True, drafts)
                step.token_budget -= len(drafts)
                step.block_budget -= extra

    def _drafts(self, req: Request, room: int) -> list[int]:
        """Prompt-lookup drafts for a decoding request (``SamplingParams.can_draft``), at most
        ``room`` of them, and never so many that accepting all of them plus the token after them
        would pass ``max_new_tokens`` or the model's context (``submit`` sized the request for
        that many tokens, so drafts never need more KV than the request could)."""
        sp = req.sampling
        if not sp.can_draft or req.pending_forks or not req.output_token_ids:
            return []
        k = min(sp.prompt_lookup_num_tokens, room, sp.max_new_tokens - len(req.output_token_ids) - 1)
        if req.max_total_tokens is not None:
            k = min(k, req.max_total_tokens - req.num_tokens - 1)
        if k <= 0:
            return []
        max_ngram = sp.max_matching_ngram_size or DEFAULT_MAX_MATCHING_NGRAM_SIZE
        return self.proposer.propose(req.request_id, req.all_token_ids, k, max_ngram)

    def _num_tokens_to_schedule(self, req: Request, token_budget: int, computed: Optional[int] = None) -> int:
        computed = req.num_computed_tokens if computed is None else computed
        todo = req.num_tokens - computed
        if req.pending_forks:
            todo = req.num_prompt_tokens - 1 - computed  # stop at the fork point
        n = min(todo, token_budget)
        if self.config.long_prefill_token_threshold is not None:
            n = min(n, self.config.long_prefill_token_threshold)
        return max(n, 0)

    def _reservation(self, plan: list[ScheduledRequest]) -> int:
        """Blocks the planned requests still need for this step's tokens."""
        bm = self.block_manager
        return sum(
            bm.num_blocks_needed(s.request.request_id, s.request.num_computed_tokens + s.num_new_tokens) for s in plan
        )

    def _block_limit(self, step: StepBudget, alone: bool = False) -> int:
        # With nothing else running the watermark has nobody to protect: what is free may be used.
        alone = alone or not (self.running or step.forks or step.swap_ins)
        return step.block_budget + (self._watermark_blocks if alone else 0)

    def _seats_left(self, step: StepBudget) -> int:
        """``max_num_seqs`` minus running requests, the forks they are owed, and reserved swap-ins."""
        owed = sum(len(r.pending_forks) for r in self.running)
        reserved = sum(1 + len(r.pending_forks) for r, _ in step.swap_ins)
        return self.config.max_num_seqs - len(self.running) - owed - reserved

    def _reserve_forks(self, step: StepBudget) -> None:
        """Due forks: each new sequence needs a seat, one token, and one block (the copy of the
        partial last block, or a fresh block when the prompt minus one ends on a block boundary,
        in which case the parent needs one too).

        A fork that does not fit now is not postponed: its sequences become ordinary waiting
        requests (same rank; the prefix cache may still serve their prompt) and the parent goes on
        alone. A parent idling for room could deadlock against another one doing the same.
        """
        for parent in sorted((r for r in self.running if r.at_fork_point), key=self.rank):
            k = len(parent.pending_forks)
            need = k + (1 if parent.num_computed_tokens % self.block_manager.block_size == 0 else 0)
            alone = self.running == [parent] and not step.forks
            # Seats were reserved at admission (``_seats_left`` counts owed forks).
            if k + 1 <= step.token_budget and need <= self._block_limit(step, alone):
                step.forks.append(parent)
                step.token_budget -= k + 1
                step.block_budget -= need
            else:
                self._detach_forks(step, parent)

    def _detach_forks(self, step: StepBudget, parent: Request) -> None:
        for child in parent.pending_forks:
            self.add_request(child)
        self.num_fork_fallbacks += len(parent.pending_forks)
        parent.pending_forks = []
        if parent.cancel_requested:
            self._finish_cancelled_parent(parent)
            return
        n = self._num_tokens_to_schedule(parent, step.token_budget)
        if n:
            step.plan.append(ScheduledRequest.for_tokens(parent, n))
            step.token_budget -= n
            step.block_budget -= self._reservation(step.plan[-1:])

    def _reserve_swap_ins(self, step: StepBudget) -> None:
        """Swapped requests in rank order, until one does not fit or a waiting one ranks before it."""
        for req in self.swapped:
            if self.waiting and self.rank(self.waiting[0]) < self.rank(req):
                step.swap_barrier_rank = self.rank(req)
                return
            n = self._num_tokens_to_schedule(req, step.token_budget)
            need = self.block_manager.blocks_for_tokens(req.num_computed_tokens + n)
            if n == 0 or self._seats_left(step) < 1 + len(req.pending_forks) or need > self._block_limit(step):
                step.swap_barrier_rank = self.rank(req)
                return
            step.swap_ins.append((req, n))
            step.token_budget -= n
            step.block_budget -= need

    # --- step 3: admit ---------------------------------------------------------------------------
    def admit(self, out: SchedulerOutput, step: StepBudget, timer: Optional[PhaseTimer] = None) -> None:
        """Step 3: carry out the reserved forks and swap-ins, then admit waiting requests by rank
        while seats, blocks and tokens allow; a waiting request at least one priority level above a
        running one may preempt it (for a seat or for blocks). ``timer`` charges those preemptions
        to "preempt" and the rest to "admit"."""
        for parent in step.forks:
            self._fork(out, step, parent)
        for req, n in step.swap_ins:
            self._swap_in(out, step, req, n)
        while self.waiting and step.token_budget > 0:
            req = self.waiting[0]
            if step.swap_barrier_rank is not None and self.rank(req) > step.swap_barrier_rank:
                break  # a swapped request ranks before it and could not resume
            if self._try_admit(out, step, req):
                continue
            # The seat or blocks go to ``req`` itself, not to whoever is queued first afterwards
            # (an escalated victim would be, and would take them straight back).
            while self._preempt_for(out, step, req, timer):
                if self._try_admit(out, step, req):
                    break
            else:
                break  # strict order: a request never overtakes an earlier one of its rank
        self._add_drafts(step)

    def _try_admit(self, out: SchedulerOutput, step: StepBudget, req: Request) -> bool:
        bm = self.block_manager
        hits = []
        if bm.enable_prefix_caching and req.num_computed_tokens == 0:
            hits = bm.match_prefix(req.all_token_ids, req.block_hashes)
        if req.pending_forks:  # leave the parent at least one token before its fork point
            hits = hits[: max(0, (req.num_prompt_tokens - 2) // bm.block_size)]
        if req.sampling.prompt_logprobs:  # rows from prompt_logprobs - 1 on must be computed
            hits = hits[: max(0, int(req.sampling.prompt_logprobs) - 1) // bm.block_size]
        computed = req.num_computed_tokens + len(hits) * bm.block_size
        n = self._num_tokens_to_schedule(req, step.token_budget, computed)
        need = bm.num_blocks_needed_with_prefix(hits, computed + n)
        need_seats = 1 + len(req.pending_forks)  # its forks get their seats now, so they rarely degrade
        if n == 0 or need_seats > self._seats_left(step) or need > self._block_limit(step):
            return False
        del self.waiting[next(i for i, r in enumerate(self.waiting) if r is req)]
        if req.num_computed_tokens == 0 and bm.enable_prefix_caching:
            bm.record_prefix_lookup(req.num_tokens, len(hits) * bm.block_size)
            out.num_prefix_hit_tokens += len(hits) * bm.block_size
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = len(hits) * bm.block_size
        req.num_computed_tokens = computed
        self._allocate_slots(req, n, prefix_blocks=hits)
        step.block_budget -= need
        step.token_budget -= n
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.plan.append(ScheduledRequest.for_tokens(req, n))
        out.admitted.append(req)
        return True

    def _fork(self, out: SchedulerOutput, step: StepBudget, parent: Request) -> None:
        """Fork the parent's pending sequences: they share its full blocks and get a copy of its
        partial last block; every sequence then computes the last prompt token and samples."""
        children, parent.pending_forks = parent.pending_forks, []
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens
            copy = self._allocate_slots(child, 0, fork_of=parent)
            if copy is not None:
                out.blocks_to_copy.append(copy)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._kv_arrives_this_step.add(child.request_id)
            step.plan.append(ScheduledRequest.for_tokens(child, 1))
            out.forked.append(child)
        self.num_forks += len(children)
        if parent.cancel_requested:
            self._finish_cancelled_parent(parent)
        else:
            step.plan.append(ScheduledRequest.for_tokens(parent, 1))

    def _finish_cancelled_parent(self, parent: Request) -> None:
        """A cancelled parent lived on only to compute its forks' prefix. Its blocks go now (the
        shared ones stay with the forks), so nobody waits on them; the next reap reports it."""
        parent.status = RequestStatus.FINISHED_CANCELLED
        self.block_manager.free(parent.request_id)

    def _swap_in(self, out: SchedulerOutput, step: StepBudget, req: Request, n: int) -> None:
        host_table = self.host_block_manager.get_block_table(req.request_id)
        self._allocate_slots(req, n)
        device_table = self.block_manager.get_block_table(req.request_id)
        out.blocks_to_swap_in.extend(zip(host_table, device_table))
        # Safe to reuse at once: the engine swaps in before it swaps out (see SchedulerOutput).
        self.host_block_manager.free(req.request_id)
        self.num_blocks_swapped_in += len(host_table)
        self.swapped.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._kv_arrives_this_step.add(req.request_id)
        step.plan.append(ScheduledRequest.for_tokens(req, n))
        out.swapped_in.append(req)

    def _preempt_for(
        self, out: SchedulerOutput, step: StepBudget, req: Request, timer: Optional[PhaseTimer] = None
    ) -> bool:
        """Preempt the lowest-ranked running request if it is at least one priority level below
        ``req`` (escalated requests are exempt); False if there is none."""
        level = self.rank(req)[1]
        victims = [r for r in self._preemptible() if self.rank(r)[0] == 1 and self.rank(r)[1] - level >= 1]
        if self.rank(req)[0] == 0 or not victims:
            return False
        if timer is not None:
            timer.charge("admit")
        self._preempt_request(out, step, max(victims, key=self.rank))
        if timer is not None:
            timer.charge("preempt")
        return True

    # --- step 4: preempt ---------------------------------------------------------------------------
    def preempt(self, out: SchedulerOutput, step: StepBudget) -> None:
        """Step 4: while the running requests cannot all get their blocks, preempt the lowest-ranked
        one (swap or recompute, see ``_choose_preemption_mode``); with nobody left to preempt, what
        still does not fit stops at the pool wall (``_stop_at_pool_wall``). Then give every planned
        request its blocks for this step's tokens."""
        while self._reservation(step.plan) > self.block_manager.num_free_blocks:
            victim = self._choose_victim()
            if victim is None:
                self._stop_at_pool_wall(step)
                break
            self._preempt_request(out, step, victim)
        for s in step.plan:
            self._allocate_slots(s.request, s.num_new_tokens)

    def _stop_at_pool_wall(self, step: StepBudget) -> None:
        """Finish planned requests, lowest rank first, with "length" until the rest fit: the pool
        cannot hold their next tokens and nothing is left to preempt (blocks held by requests that
        cannot be preempted, or taken outside the scheduler). They keep every token generated so
        far; the next reap frees their blocks. Failing instead would fail every request in flight."""
        for s in sorted(step.plan, key=lambda s: self.rank(s.request), reverse=True):
            if self._reservation(step.plan) <= self.block_manager.num_free_blocks:
                return
            step.plan.remove(s)
            step.token_budget += s.num_new_tokens
            s.request.status = RequestStatus.FINISHED_LENGTH
            self.num_pool_wall_stops += 1

    def _choose_victim(self) -> Optional[Request]:
        """The lowest-ranked running request; escalated ones only if nothing else is left. Among
        escalated ones the best-ranked is never chosen, so it finishes: no livelock."""
        alive = self._preemptible()
        if len(alive) <= 1:
            return None
        candidates = [r for r in alive if r.num_preemptions < self.config.max_preemptions]
        return max(candidates or alive, key=self.rank)

    def _preemptible(self) -> list[Request]:
        # A parent cancelled at its fork is finished but holds blocks until the next reap.
        return [r for r in self.running if not r.status.is_finished]

    def _choose_preemption_mode(self, req: Request) -> tuple[str, bool]:
        """("swap" or "recompute", whether a wanted swap fell back to recompute) for this victim.

        Recompute when nothing is computed (free), when its KV only arrives this step (swap-in or
        fork copy still pending: the engine swaps out before it copies), or when the host pool
        cannot take it (the fallback). "auto" swaps when moving its blocks out and back costs less
        than recomputing its tokens: ``swap_cost_per_block * blocks < tokens``, where tokens
        excludes leading blocks shared with a running request and cached (they survive a recompute).
        """
        mode = self.config.preemption_mode
        blocks = self.block_manager.blocks_for_tokens(req.num_computed_tokens)
        if mode == "recompute" or blocks == 0:
            return "recompute", False
        if req.request_id in self._kv_arrives_this_step or not self.host_block_manager.can_allocate(blocks):
            return "recompute", True
        if mode == "swap":
            return "swap", False
        bm = self.block_manager
        table = bm.get_block_table(req.request_id)
        shared = 0
        while shared < blocks and bm.ref_counts[table[shared]] > 1 and bm.is_cached(table[shared]):
            shared += 1
        tokens_to_recompute = req.num_computed_tokens - shared * bm.block_size
        return ("swap" if self.swap_cost_per_block * blocks < tokens_to_recompute else "recompute"), False

    def _preempt_request(self, out: SchedulerOutput, step: StepBudget, req: Request) -> None:
        """Take ``req`` out of running and out of this step's plan; it keeps every generated token."""
        removed = [s for s in step.plan if s.request is req]
        step.plan[:] = [s for s in step.plan if s.request is not req]
        step.token_budget += sum(s.num_new_tokens for s in removed)
        reserved = self._reservation(removed)
        before = self.block_manager.num_free_blocks
        if req.request_id in self._kv_arrives_this_step:  # its swap-in or fork copy is moot now
            table = set(self.block_manager.get_block_table(req.request_id))
            out.blocks_to_swap_in[:] = [p for p in out.blocks_to_swap_in if p[1] not in table]
            out.blocks_to_copy[:] = [p for p in out.blocks_to_copy if p[1] not in table]
        self.running.remove(req)
        req.num_preemptions += 1  # before re-queuing: the queue position must see an escalation
        self.num_preemptions += 1
        mode, fell_back = self._choose_preemption_mode(req)
        self.num_swap_fallbacks += fell_back
        if mode == "swap":
            self._swap_out(out, req)
        else:
            self.block_manager.free(req.request_id)
            req.num_computed_tokens = 0
            self.num_recompute_preemptions += 1
            self.add_request(req)
        step.block_budget += reserved + self.block_manager.num_free_blocks - before
        out.preempted.append(req)

    def _swap_out(self, out: SchedulerOutput, req: Request) -> None:
        blocks = self.block_manager.blocks_for_tokens(req.num_computed_tokens)
        host_table = self.host_block_manager.allocate(req.request_id, blocks * self.block_manager.block_size)
        device_table = self.block_manager.get_block_table(req.request_id)[:blocks]
        out.blocks_to_swap_out.extend(zip(device_table, host_table))
        self.block_manager.free(req.request_id)
        self.num_blocks_swapped_out += blocks
        self.num_swap_preemptions += 1
        req.status = RequestStatus.SWAPPED
        bisect.insort(self.swapped, req, key=self.rank)
        out.swapped_out.append(req)

    def _allocate_slots(
        self, req: Request, num_new_tokens: int, *, prefix_blocks=(), fork_of: Optional[Request] = None
    ) -> Optional[tuple[int, int]]:
        """The one place device blocks are handed out: grow ``req``'s block table to hold its
        computed tokens plus ``num_new_tokens`` (starting from cached ``prefix_blocks`` at
        admission), or, with ``fork_of``, share that parent's blocks up to ``req.num_computed_tokens``.

        Returns the (src, dst) copy-on-write pair of a fork's partial last block, else None.
        Raises ``RuntimeError`` if the pool is short (the budget step checked it first).
        """
        if fork_of is not None:
            return self.block_manager.fork(fork_of.request_id, req.request_id, req.num_computed_tokens)
        self.block_manager.allocate(
            req.request_id, req.num_computed_tokens + num_new_tokens, prefix_blocks=prefix_blocks
        )
        return None

    # --- after the forward ---------------------------------------------------------------------
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict,
        on_token: Optional[Callable[[Request], bool]] = None,
    ) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens; return requests that got a token.

        Args:
            out: the step's plan.
            sampled: ``{request_id: token}``; for a request with drafts, ``{request_id: [token per
                row]}``, the greedy token after its last token and after each draft.
            on_token: called after each appended token (the engine's stop checks and streaming);
                True means the request finished and gets no further token of this step.

        A request with drafts keeps the longest prefix of drafts equal to the greedy tokens and the
        greedy token after it (so its output is exactly plain greedy decoding's); the KV of
        rejected drafts is dropped: ``num_computed_tokens`` covers accepted tokens only and blocks
        past it are freed (their slots are rewritten by the next step anyway). Blocks that became
        full and computed enter the prefix cache (accepted tokens only). Finishing (EOS, length,
        stop) is decided by the engine, which marks the status; the blocks are freed by the next
        iteration's reap step.
        """
        advanced = []
        bm = self.block_manager
        for s in out.scheduled:
            req = s.request
            if req.status.is_finished:
                continue
            if s.draft_token_ids:
                self._accept_drafts(s, sampled[req.request_id], on_token)
                advanced.append(req)
            else:
                req.num_computed_tokens += s.num_new_tokens
                if s.samples:
                    req.output_token_ids.append(sampled[req.request_id])
                    advanced.append(req)
                    if on_token is not None:
                        on_token(req)
            if bm.enable_prefix_caching and req.num_computed_tokens // bm.block_size > bm.num_hashed_blocks(
                req.request_id
            ):
                bm.cache_full_blocks(req.request_id, req.all_token_ids, req.block_hashes, req.num_computed_tokens)
        return advanced

    def _accept_drafts(self, s: ScheduledRequest, tokens: list[int], on_token) -> None:
        """Greedy verification (Leviathan et al., 2023, with argmax targets): ``tokens[i]`` is the
        greedy token after the last token and ``i`` drafts; keep drafts while they equal it."""
        req, drafts = s.request, s.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == tokens[accepted]:
            accepted += 1
        self.num_draft_tokens += len(drafts)
        req.num_computed_tokens += 1  # the last token's KV
        for i, token in enumerate(tokens[: accepted + 1]):
            req.output_token_ids.append(token)
            if i < accepted:
                req.num_computed_tokens += 1  # it was a draft: its KV was computed this step
                self.num_accepted_draft_tokens += 1  # counted only when kept (a stop may come first)
            if on_token is not None and on_token(req):
                break
        self.block_manager.trim(req.request_id, req.num_computed_tokens)

    def drop_all_requests(self) -> list[Request]:
        """Remove every unfinished request from the queues (pending forks included), free their
        device and host blocks, and return them; the caller finishes them (``LLMEngine.close``, a
        failed step)."""
        dropped = self.all_requests()
        for queue in (self.running, self.swapped, self.waiting):
            queue.clear()
        for req in dropped:
            req.pending_forks = []
            self.block_manager.free(req.request_id)
            self.host_block_manager.free(req.request_id)
            self.proposer.forget(req.request_id)
        return dropped
