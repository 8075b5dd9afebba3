"""The five-step scheduler iteration: reap -> budget -> admit -> preempt -> (decode, run by the engine).

Each step is its own short method; ``schedule()`` runs the first four in order and returns a plain
``SchedulerOutput`` that the model runner turns into one flattened forward (step five). The order is
the specification (DESIGN.md): free before measuring, measure before handing out, and leave the
expensive forward to the end so it sees the densest legal batch.

Request state follows vLLM v1: a request needs ``num_tokens - num_computed_tokens`` more tokens of
KV; prefill, chunked prefill and resumption after recompute preemption are that one rule.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .config import SchedulerConfig
from .kv.block_manager import BlockManager
from .request import Request, RequestStatus

PHASES = ("reap", "budget", "admit", "preempt", "decode")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose KV this step computes
    samples: bool  # True when this step completes the request's known tokens, so a token is sampled


@dataclass
class SchedulerOutput:
    """One iteration's plan, plain data for the runner.

    Attributes:
        iteration: the iteration number.
        scheduled: requests to run, decodes (one token) first, then prefill chunks.
        num_batched_tokens: sum of ``num_new_tokens`` (never above ``max_num_batched_tokens``).
        reaped: requests freed in the reap step.
        preempted: requests preempted in the preempt step.
        admitted: requests admitted in the admit step.
        budget_blocks: the block budget measured in the budget step.
        phases: (phase name, seconds) in the order they ran.
    """

    iteration: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    reaped: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    budget_blocks: int = 0
    phases: list[tuple[str, float]] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1 and not s.request.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each iteration, which requests run and with how many tokens.

    Args:
        config: the scheduler limits.
        block_manager: the block bookkeeping it allocates from.
        clock: time source (seconds), injectable for tests.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key()
        self.running: list[Request] = []
        self.iteration = 0
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)

    # --- queue management ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=Request.sort_key)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all_requests(self) -> list[Request]:
        return self.running + self.waiting

    # --- the iteration -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Run reap, budget, admit and preempt; return the plan for the decode step."""
        out = SchedulerOutput(iteration=self.iteration)
        self.iteration += 1
        t = self.clock()

        def mark(name: str) -> None:
            nonlocal t
            now = self.clock()
            out.phases.append((name, now - t))
            t = now

        out.reaped = self._reap()
        mark("reap")
        token_budget, plan = self._plan_running()
        out.budget_blocks = self._block_budget(plan)
        mark("budget")
        token_budget = self._admit(out, plan, token_budget)
        mark("admit")
        self._preempt(out, plan)
        self._allocate(plan)
        mark("preempt")
        # Decodes first, then prefill chunks: the layout attention metadata expects.
        plan.sort(key=lambda s: 0 if (s.num_new_tokens == 1 and not s.request.is_prefill) else 1)
        out.scheduled = plan
        out.num_batched_tokens = sum(s.num_new_tokens for s in plan)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens, "token budget exceeded"
        assert len(self.running) <= self.config.max_num_seqs, "max_num_seqs exceeded"
        return out

    def _reap(self) -> list[Request]:
        """Step 1: drop finished and cancelled requests and free their blocks at once."""
        reaped = []
        for queue in (self.running, self.waiting):
            keep = []
            for req in queue:
                if req.cancel_requested and not req.status.is_finished:
                    req.status = RequestStatus.FINISHED_CANCELLED
                if req.status.is_finished:
                    self.block_manager.free(req.request_id)
                    reaped.append(req)
                else:
                    keep.append(req)
            queue[:] = keep
        return reaped

    def _plan_running(self) -> tuple[int, list[ScheduledRequest]]:
        """Token budget for running requests: decodes take one token, ongoing prefills a chunk."""
        budget = self.config.max_num_batched_tokens
        plan = []
        for req in sorted(self.running, key=lambda r: (r.is_prefill, r.sort_key())):
            n = self._num_tokens_to_schedule(req, budget)
            if n == 0:
                continue
            plan.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
            budget -= n
        return budget, plan

    def _num_tokens_to_schedule(self, req: Request, token_budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, token_budget)
        if self.config.long_prefill_token_threshold is not None:
            n = min(n, self.config.long_prefill_token_threshold)
        return max(n, 0)

    def _reservation(self, plan: list[ScheduledRequest]) -> int:
        """Blocks the planned requests still need for this step's tokens."""
        bm = self.block_manager
        return sum(
            bm.num_blocks_needed(s.request.request_id, s.request.num_computed_tokens + s.num_new_tokens)
            for s in plan
        )

    def _block_budget(self, plan: list[ScheduledRequest]) -> int:
        """Step 2: free blocks minus in-flight reservations minus the watermark."""
        return self.block_manager.num_free_blocks - self._reservation(plan) - self._watermark_blocks

    def _admit(self, out: SchedulerOutput, plan: list[ScheduledRequest], token_budget: int) -> int:
        """Step 3: admit waiting requests by priority, then arrival, while blocks and tokens allow."""
        budget = out.budget_blocks
        bm = self.block_manager
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = self._num_tokens_to_schedule(req, token_budget)
            need = bm.num_blocks_needed(req.request_id, req.num_computed_tokens + n)
            # With nothing running the watermark has nobody to protect: admit if the blocks exist.
            limit = budget if self.running else self.block_manager.num_free_blocks
            if n == 0 or need > limit:
                break  # strict order: a request never overtakes an earlier one of its priority
            self.waiting.pop(0)
            bm.allocate(req.request_id, req.num_computed_tokens + n)
            budget -= need
            token_budget -= n
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.append(ScheduledRequest(req, n, req.num_computed_tokens + n == req.num_tokens))
            out.admitted.append(req)
        return token_budget

    def _preempt(self, out: SchedulerOutput, plan: list[ScheduledRequest]) -> None:
        """Step 4: while the running requests cannot all get their blocks, preempt the lowest
        priority (then latest arrived) one, freeing its KV for recompute."""
        while self._reservation(plan) > self.block_manager.num_free_blocks:
            victim = self._choose_victim()
            if victim is None:
                break
            self._preempt_request(victim)
            out.preempted.append(victim)
            plan[:] = [s for s in plan if s.request is not victim]

    def _choose_victim(self) -> Optional[Request]:
        candidates = [r for r in self.running if r.num_preemptions < self.config.max_preemptions]
        if not candidates:
            candidates = list(self.running)
        if len(candidates) <= 1 and len(self.running) <= 1:
            return None
        return max(candidates, key=Request.sort_key)

    def _preempt_request(self, req: Request) -> None:
        self.block_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.add_request(req)

    def _allocate(self, plan: list[ScheduledRequest]) -> None:
        for s in plan:
            self.block_manager.allocate(s.request.request_id, s.request.num_computed_tokens + s.num_new_tokens)

    # --- after the forward ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens; return requests that got a token.

        Finishing (EOS, length, stop) is decided by the engine, which marks the status; the blocks
        are freed by the next iteration's reap step.
        """
        advanced = []
        for s in out.scheduled:
            req = s.request
            if req.status.is_finished:
                continue
            req.num_computed_tokens += s.num_new_tokens
            if s.samples:
                req.output_token_ids.append(sampled[req.request_id])
                advanced.append(req)
        return advanced
