"""The scheduler: the queues and four steps of an iteration, reap -> budget -> admit -> preempt.

Each step is its own public method, called in that order by ``LLMEngine.step`` (which then runs
step five, decode, on the model runner); ``schedule()`` runs the four for callers without a model
(tests, simulations). An iteration yields a ``StepPlan`` that the engine executes (block moves, one
flattened forward) and a ``StepReport`` for stats. The order is the specification: free before
measuring, measure before handing out, and leave the expensive forward to the end so it sees the
densest legal batch. The budget step only measures; admit and preempt change queues; blocks are
handed out in one place, ``allocate_slots``.

Request state follows vLLM v1: a request needs ``num_tokens - num_computed_tokens`` more tokens of
KV; prefill, chunked prefill, prefix-cache hits (``num_computed_tokens`` set at admission) and
resumption after recompute or swap preemption are that one rule.

The sub-steps live beside this file, one job each: ``forks`` (parallel sampling), ``swap`` (swap
preemption), ``admission`` (waiting requests), ``drafts`` (prompt-lookup drafts), ``preemption``
(victims and modes); the queues and the rank that orders them are in ``queues``, the step's budget
in ``budget``, the plain-data outputs in ``plan``, the one writer of a request's progress fields in
``request_state``.

After the forward the engine asks for each request's proposed tokens (``proposed_tokens``: the
sampled one, or the accepted drafts and the greedy token after them), decides the stops on them
(``StopDecision``) and hands the decisions to ``update_from_output``, which appends the kept tokens
once and advances ``num_computed_tokens``.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional, Sequence

from ..config import SchedulerConfig
from ..request import Request, RequestStatus
from .admission import WaitingAdmission
from .block_manager import BlockManager
from .budget import StepBudget
from .drafts import Drafts
from .forks import Forks
from .phases import PHASES, PhaseTimer
from .plan import (
    NewRequestData,
    RunnerOutput,
    ScheduledRequest,
    SchedulerCounters,
    StepPlan,
    StepReport,
    StepResult,
    StopDecision,
)
from .preemption import Preemption
from .queues import Rank, RequestQueues
from .request_state import RequestState
from .swap import Swap

__all__ = ["PHASES", "Scheduler"]


class Scheduler:
    """Decides, each iteration, which requests run and with how many tokens.

    Args:
        config: the scheduler limits.
        block_manager: the device pool's bookkeeping.
        clock: time source (seconds), injectable for tests.
        host_block_manager: the host swap pool's bookkeeping; None (or 0 blocks) means swap
            preemption falls back to recompute. Its ``sliding_window`` must be the device pool's
            (a swapped request's host table mirrors its device table's null entries).
        swap_cost_per_block: cost of swapping one block out and back in, in tokens of recompute
            (``preemption_mode="auto"``); ``config.swap_cost_per_block`` overrides it. The engine
            estimates it from the model size and the block bytes.
        draft_filter: cuts a request's prompt-lookup drafts to the prefix it may verify
            (``Drafts``; the engine's grammar check); None keeps them all.

    Raises:
        ValueError: the two pools' ``sliding_window`` or ``block_size`` differ.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        host_block_manager: Optional[BlockManager] = None,
        swap_cost_per_block: float = 1.0,
        draft_filter: Optional[Callable[[Request, list[int]], list[int]]] = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.host_block_manager = host_block_manager or BlockManager(
            0, block_manager.block_size, sliding_window=block_manager.sliding_window
        )
        host = self.host_block_manager
        if (host.sliding_window, host.block_size) != (block_manager.sliding_window, block_manager.block_size):
            raise ValueError(
                f"the host pool (sliding_window={host.sliding_window}, block_size={host.block_size}) must match "
                f"the device pool (sliding_window={block_manager.sliding_window}, block_size={block_manager.block_size})"
            )
        self.clock = clock
        self.state = RequestState()  # the one writer of status, num_computed_tokens, output tokens
        self.queues = RequestQueues(config, clock(), self.state)
        self._requests: dict[int, Request] = {}  # every request it holds, pending forks included
        self.counters = SchedulerCounters()
        self.iteration = 0
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)
        if config.swap_cost_per_block is not None:
            swap_cost_per_block = config.swap_cost_per_block
        self.forks = Forks(self.queues, block_manager, self.counters, self.allocate_slots)
        self.swap = Swap(
            config,
            self.queues,
            block_manager,
            self.host_block_manager,
            self.counters,
            self.allocate_slots,
            swap_cost_per_block,
        )
        self.drafts = Drafts(block_manager, self.counters, draft_filter)
        self.preemption = Preemption(config, self.queues, block_manager, self.swap, self.counters)
        self.waiting_admission = WaitingAdmission(self.queues, block_manager, self.preemption, self.allocate_slots)

    # --- queues ----------------------------------------------------------------------------------
    @property
    def waiting(self) -> list[Request]:
        """Requests waiting for admission, by rank."""
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def swapped(self) -> list[Request]:
        """Requests whose KV is in the host pool, by rank."""
        return self.queues.swapped

    @property
    def has_work(self) -> bool:
        """True while any request is waiting, running or swapped out."""
        return self.queues.has_work

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept free at admission (``watermark`` of the pool)."""
        return self._watermark_blocks

    def add_request(self, request: Request) -> None:
        """Queue ``request`` to wait, by rank (its pending forks apart when they can never fork)."""
        for r in (request, *request.pending_forks):
            self._requests[r.request_id] = r
        for child in Forks.take_unforkable(request, self.config.max_num_seqs, self.config.per_request_state):
            self.queues.add_waiting(child)
        self.queues.add_waiting(request)

    def all_requests(self) -> list[Request]:
        """Every unfinished request, pending forks included."""
        return self.queues.all_requests()

    def rank(self, req: Request) -> Rank:
        """``req``'s sort key, smaller first (see ``queues.Rank``)."""
        return self.queues.rank(req)

    def drop_all_requests(self) -> list[Request]:
        """Empty every queue (running, swapped, waiting, and their pending forks) and free the
        requests' device and host blocks; returns the requests in that order. Their statuses are the
        caller's to set (the engine fails them when it closes or a step fails)."""
        dropped = self.queues.all_requests()
        for req in dropped:
            self.state.leaves(req.request_id)
            self._requests.pop(req.request_id, None)
            for child in req.pending_forks:
                self._requests.pop(child.request_id, None)
            self.block_manager.free(req.request_id)
            self.host_block_manager.free(req.request_id)
            self.drafts.forget(req.request_id)
            req.pending_forks = []
        self.queues.clear()
        return dropped

    # --- the iteration ---------------------------------------------------------------------------
    def schedule(self) -> StepResult:
        """Steps 1-4 as ``LLMEngine.step`` runs them, without a model: the plan for the decode
        step, and the report with the four steps' seconds in ``phases``."""
        timer = PhaseTimer(self.clock)
        result = self.begin_iteration()
        result.report.reaped = self.reap()
        timer.charge("reap")
        self.plan(result, timer)
        result.report.phases = list(timer.as_tuple()[:4])
        return result

    def plan(self, result: StepResult, timer: PhaseTimer) -> None:
        """Steps 2-4 after the reap, each charged to ``timer`` under its name: budget, admit,
        preempt; then the plan's rows are laid out and the iteration's invariants checked."""
        step = self.budget(result.report)
        timer.charge("budget")
        self.admit(result, step, timer)
        timer.charge("admit")
        self.preempt(result, step)
        timer.charge("preempt")
        self.finish_plan(result, step)

    def begin_iteration(self) -> StepResult:
        """An empty plan and report for the next iteration number."""
        result = StepResult.empty(self.iteration)
        self.iteration += 1
        return result

    def reap(self) -> list[Request]:
        """Step 1: drop finished and cancelled requests (any queue) and free their blocks at once."""
        reaped: list[Request] = []
        gone: list[Request] = []
        for req in self.queues.queued():
            if req.pending_forks:
                reaped += self.forks.reap_pending(req)
            if req.cancel_requested and not req.status.is_finished and not req.pending_forks:
                self.state.set_status(req, RequestStatus.FINISHED_CANCELLED)
            if req.status.is_finished:
                self.block_manager.free(req.request_id)
                self.host_block_manager.free(req.request_id)
                self.drafts.forget(req.request_id)
                reaped.append(req)
                gone.append(req)
        self.queues.remove(gone)
        for req in reaped:
            self._requests.pop(req.request_id, None)
        return reaped

    def budget(self, report: StepReport) -> StepBudget:
        """Step 2: free blocks - reservations - watermark, recorded in ``report``. Reservations are
        the blocks the running requests need for this step's tokens (decodes take one token,
        ongoing prefills a chunk), then forks that are due, then swap-ins (swapped requests resume
        before any waiting request they rank before). Changes no queue and hands out no block."""
        step = StepBudget(self.queues, self.block_manager, self.config, self._watermark_blocks)
        for req in sorted(self.running, key=lambda r: (r.is_prefill, self.rank(r))):
            n = step.tokens_to_schedule(req)
            if n:
                step.schedule(ScheduledRequest.for_tokens(req, n))
        free = self.block_manager.num_free_blocks
        step.open_blocks(free)
        self.forks.reserve(step)
        self.swap.reserve_swap_ins(step)
        report.budget_blocks = step.block_budget
        report.reserved_blocks = free - self._watermark_blocks - step.block_budget
        return step

    def admit(self, result: StepResult, step: StepBudget, timer: Optional[PhaseTimer] = None) -> None:
        """Step 3, in four sub-steps: the forks (reserved ones forked, the others queued as
        waiting requests), the reserved swap-ins, waiting requests by rank, then prompt-lookup
        drafts from what is left. ``timer`` charges priority preemptions to "preempt"."""
        self.forks.admit(result, step)
        self.swap.swap_in(result, step)
        self.waiting_admission.admit(result, step, timer)
        self.drafts.add(step, self.running)

    def preempt(self, result: StepResult, step: StepBudget) -> None:
        """Step 4: preempt running requests, lowest-ranked first, until the others' blocks for this
        step fit (``Preemption.until_running_fit``); then every planned request gets its blocks."""
        self.preemption.until_running_fit(result, step)
        for s in step.rows:
            self.allocate_slots(self._requests[s.request_id], s.num_new_tokens)

    def finish_plan(self, result: StepResult, step: StepBudget) -> None:
        """Put the rows into the plan in the layout attention metadata expects (decodes, then
        requests verifying drafts, then prefill chunks), each with its block table as it is now;
        add the data of the requests that enter the runner's batch and the ids that left it; and
        check the iteration's invariants."""
        rows = sorted(step.rows, key=lambda s: 0 if s.is_decode else 1 if s.is_speculative else 2)
        bm = self.block_manager
        plan = result.plan
        plan.scheduled = [s.with_blocks(bm.get_block_table(s.request_id)) for s in rows]
        plan.finished_ids, plan.preempted_ids = self.state.take_departures()
        plan.new_requests = [
            NewRequestData.of(self._requests[s.request_id]) for s in rows if self.state.enters_batch(s.request_id)
        ]
        assert step.token_budget >= 0, "token budget overspent"
        assert result.plan.num_batched_tokens <= self.config.max_num_batched_tokens, "token budget exceeded"
        assert len(self.running) <= self.config.max_num_seqs, "max_num_seqs exceeded"
        # The engine swaps in before it copies: a copy source overwritten by a swap-in is lost.
        swapped_in = {dst for _, dst in result.plan.blocks_to_swap_in}
        assert not any(src in swapped_in for src, _ in result.plan.blocks_to_copy), "copy source swapped over"

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        *,
        prefix_blocks: Sequence[int] = (),
        fork_of: Optional[Request] = None,
    ) -> Optional[tuple[int, int]]:
        """The one place device blocks are handed out: grow ``req``'s block table to hold its
        computed tokens plus ``num_new_tokens`` (starting from cached ``prefix_blocks`` at
        admission), or, with ``fork_of``, share that parent's blocks up to ``req.num_computed_tokens``.

        Returns the (src, dst) copy-on-write pair of a fork's partial last block, else None.
        Raises ``RuntimeError`` if the pool is short (the budget and preempt steps checked first).
        """
        if fork_of is not None:
            return self.block_manager.fork(fork_of.request_id, req.request_id, req.num_computed_tokens)
        self.block_manager.allocate(
            req.request_id,
            req.num_computed_tokens + num_new_tokens,
            prefix_blocks=prefix_blocks,
            num_computed_tokens=req.num_computed_tokens,
        )
        return None

    def departures(self) -> StepPlan:
        """A plan without rows carrying the ids that left the runner's batch since the last plan,
        for a reap or a drop outside an iteration (the runner applies it at once)."""
        plan = StepPlan(self.iteration)
        plan.finished_ids, plan.preempted_ids = self.state.take_departures()
        return plan

    # --- after the forward -----------------------------------------------------------------------
    def request(self, request_id: int) -> Optional[Request]:
        """The request ``request_id`` while the scheduler holds it (pending forks included), else None."""
        return self._requests.get(request_id)

    def proposed_tokens(self, plan: StepPlan, output: RunnerOutput) -> dict[int, list[int]]:
        """``{request id: the tokens it would get this step}``, nothing appended: the sampled token
        of a sampling row; for a request verifying drafts, the drafts equal to the greedy tokens and
        the greedy token after them (``Drafts.accepted_tokens``). Requests that finished meanwhile
        (failed in the forward, cancelled) get none. The engine decides the stops on these
        (``StopDecision``) before ``update_from_output`` appends anything."""
        proposed: dict[int, list[int]] = {}
        for s in plan.scheduled:
            req = self._requests.get(s.request_id)
            if req is None or req.status.is_finished:
                continue
            if s.draft_token_ids:
                proposed[s.request_id] = Drafts.accepted_tokens(s.draft_token_ids, output.greedy[s.request_id])
            elif s.samples:
                proposed[s.request_id] = [output.sampled[s.request_id]]
        return proposed

    def update_from_output(
        self,
        plan: StepPlan,
        output: RunnerOutput,
        decisions: Optional[Mapping[int, StopDecision]] = None,
    ) -> list[tuple[Request, list[int]]]:
        """Apply the step: record prompt log-probs, advance ``num_computed_tokens``, append each
        request's kept tokens once (with their log-probs), and set the status the engine decided.

        Args:
            plan: the step's plan.
            output: the forward's tokens: ``sampled[request_id]`` for a sampling row,
                ``greedy[request_id]`` for a request with drafts (the greedy token after its last
                token and after each draft), the scored prompt positions' and the sampled tokens'
                log-probs.
            decisions: ``{request id: StopDecision}`` on ``proposed_tokens(plan, output)``: how many
                of its proposed tokens each request keeps, and the status it finishes with. A
                request without an entry keeps them all and goes on (None: every request).

        Returns:
            ``(request, the tokens appended to it)`` per request that got tokens, in plan order.

        A request verifying drafts counts as computed its last token and the kept drafts; the KV of
        the others (rejected, or past a stop) is dropped: ``num_computed_tokens`` covers them no
        more and the blocks past it are freed. Blocks that became full and computed enter the
        prefix cache (kept tokens only); under a sliding window, blocks no later query reads are
        released (``BlockManager.free_out_of_window``). The blocks of a finished request are freed by
        the next iteration's reap step.
        """
        advanced: list[tuple[Request, list[int]]] = []
        bm, state = self.block_manager, self.state
        if output.prompt_logprobs:
            self._record_prompt_logprobs(output.prompt_logprobs)
        for s in plan.scheduled:
            rid = s.request_id
            req = self._requests.get(rid)
            if req is None or req.status.is_finished:
                continue
            if s.draft_token_ids:
                tokens = Drafts.accepted_tokens(s.draft_token_ids, output.greedy[rid])
            elif s.samples:
                tokens = [output.sampled[rid]]
            else:
                tokens = []
            decision = decisions.get(rid) if decisions is not None else None
            kept = tokens if decision is None else tokens[: decision.num_kept]
            if kept:
                state.append_tokens(req, kept)
                logprob = output.logprobs.get(rid)
                if logprob is not None and not s.draft_token_ids:
                    chosen, top = logprob
                    req.output_logprobs.append(chosen)
                    if top is not None:
                        req.output_top_logprobs.append(top)
                advanced.append((req, kept))
            if s.draft_token_ids:
                # the last token's KV, and each kept draft's (the kept tokens are drafts but the last)
                kept_drafts = min(len(kept), len(tokens) - 1)
                state.set_computed(req, s.start_position + 1 + kept_drafts)
                self.drafts.count(len(s.draft_token_ids), kept_drafts)
                bm.trim(rid, s.start_position + 1 + kept_drafts)
            else:
                state.set_computed(req, req.num_computed_tokens + s.num_new_tokens)
            if decision is not None and decision.error is not None:
                self.fail(req, decision.error)
            elif decision is not None and decision.status is not None:
                state.set_status(req, decision.status)
            if bm.enable_prefix_caching and req.num_computed_tokens // bm.block_size > bm.num_hashed_blocks(rid):
                bm.cache_full_blocks(
                    rid, req.all_token_ids, req.block_hashes, req.num_computed_tokens, req.prefix_cache_key
                )
            # After the prefix cache took the full blocks: under a window, what no later query reads goes.
            bm.free_out_of_window(req.request_id, req.num_computed_tokens)
        return advanced

    def recompute(self, request: Request) -> None:
        """Drop running ``request``'s KV and queue it to compute all its known tokens again (as a
        recompute preemption, not counted as one), under its current ``prefix_cache_key``: what
        its KV depends on changed (a LongRoPE model's factors when the sequence passes the
        threshold, ``engine.rotary_variants``). Its freed full blocks stay in the prefix cache
        under the key they were computed with."""
        self.block_manager.free(request.request_id)
        self.state.set_computed(request, 0)
        request.block_hashes.clear()  # chained from the old key's root
        self.queues.preempt_to_waiting(request)

    def fail(self, request: Request, exc: BaseException) -> None:
        """Fail one request (a step's forward, its stop checks or its grammar raised ``exc``): it
        keeps its tokens, the next reap frees its blocks and finishes its handle, its pending forks
        with it; the other requests are untouched."""
        request.error = exc
        self.state.set_status(request, RequestStatus.FINISHED_ERROR)
        for child in request.pending_forks:
            child.error = exc

    def finish_dropped(self, requests: Sequence[Request], status: RequestStatus, exc: BaseException) -> None:
        """Finish requests the scheduler no longer holds (``drop_all_requests``, or never queued)
        with ``status`` and ``exc``."""
        for req in requests:
            req.error = exc
            self.state.set_status(req, status)

    def _record_prompt_logprobs(self, scores: dict[int, list[tuple[int, float, bool]]]) -> None:
        """Store (log-prob, is_argmax) per scored position in ``Request.prompt_logprobs`` (a list
        of ``num_prompt_tokens + 1`` entries, None where nothing was scored)."""
        for rid, got in scores.items():
            req = self._requests.get(rid)
            if req is None or not got:
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * (req.num_prompt_tokens + 1)
            for position, logprob, is_argmax in got:
                req.prompt_logprobs[position] = (logprob, is_argmax)
