"""Admission of waiting requests: the admit step's sub-step that turns waiting requests into running ones.

Waiting requests are admitted strictly by rank while seats (``max_num_seqs``), blocks (the step's
block budget, after prefix-cache hits) and tokens (the token budget) allow; a request never
overtakes an earlier one of its rank, nor a swapped request that ranks before it and could not
resume. A waiting request at least one priority level above a running one may preempt it for a
seat or for blocks. A request with pending forks takes the seats of its forks at admission, so its
forks rarely degrade to independent requests. A request whose grammar still compiles
(``Request.waiting_for_grammar``) is passed over without holding back the ones behind it.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..request import Request
from .block_manager import BlockManager
from .budget import StepBudget
from .phases import PhaseTimer
from .plan import ScheduledRequest, StepResult
from .preemption import Preemption
from .queues import RequestQueues

__all__ = ["WaitingAdmission"]


class WaitingAdmission:
    """Admits waiting requests by rank.

    Args:
        queues: the scheduler's queues.
        block_manager: the device pool's bookkeeping (prefix-cache lookups).
        preemption: priority preemption for an admission.
        allocate_slots: the scheduler's ``allocate_slots``, the one place blocks are handed out.
    """

    def __init__(
        self,
        queues: RequestQueues,
        block_manager: BlockManager,
        preemption: Preemption,
        allocate_slots: Callable[..., Optional[tuple[int, int]]],
    ) -> None:
        self._queues = queues
        self._block_manager = block_manager
        self._preemption = preemption
        self._allocate_slots = allocate_slots

    def admit(self, result: StepResult, step: StepBudget, timer: Optional[PhaseTimer] = None) -> None:
        """Admit waiting requests by rank while seats, blocks and tokens allow, preempting a running
        request one priority level below for a seat or blocks (``timer`` charges that to
        "preempt")."""
        waiting, rank = self._queues.waiting, self._queues.rank
        passed = 0  # requests at the head whose grammar is not ready yet: passed over, not blocking
        while len(waiting) > passed and step.token_budget > 0:
            req = waiting[passed]
            if req.waiting_for_grammar:
                passed += 1
                continue
            if step.swap_barrier_rank is not None and rank(req) > step.swap_barrier_rank:
                break  # a swapped request ranks before it and could not resume
            if self._try_admit(result, step, req):
                continue
            # The seat or blocks go to ``req`` itself, not to whoever is queued first afterwards
            # (an escalated victim would be, and would take them straight back).
            while self._preemption.for_admission(result, step, req, timer):
                if self._try_admit(result, step, req):
                    break
            else:
                break  # strict order: a request never overtakes an earlier one of its rank

    def _try_admit(self, result: StepResult, step: StepBudget, req: Request) -> bool:
        """Admit ``req`` if its seats, blocks (after prefix-cache hits) and tokens fit."""
        bm = self._block_manager
        hits = []
        limit = None  # at most this many blocks of hits (None: as many as match)
        if req.pending_forks:  # leave the parent at least one token before its fork point
            limit = max(0, (req.num_prompt_tokens - 2) // bm.block_size)
        if req.sampling.prompt_logprobs:  # rows from prompt_logprobs - 1 on must be computed
            cut = max(0, int(req.sampling.prompt_logprobs) - 1) // bm.block_size
            limit = cut if limit is None else min(limit, cut)
        if bm.enable_prefix_caching and req.num_computed_tokens == 0:
            # The limit goes into the lookup: under a window, a shorter hit needs other blocks cached.
            hits = bm.match_prefix(req.all_token_ids, req.block_hashes, req.prefix_cache_key, max_blocks=limit)
        computed = req.num_computed_tokens + len(hits) * bm.block_size
        n = step.tokens_to_schedule(req, computed)
        need = bm.num_blocks_needed_with_prefix(hits, computed + n, computed)
        need_seats = 1 + len(req.pending_forks)
        if n == 0 or need_seats > step.seats_left() or need > step.block_limit():
            return False
        if req.num_computed_tokens == 0 and bm.enable_prefix_caching:
            result.report.num_prefix_hit_tokens += len(hits) * bm.block_size
            if req.num_preemptions == 0:
                # The hit rate is about prompts: a request recomputed after preemption that finds
                # its own blocks again shares no prefix with anyone (counted once, at first admission).
                bm.record_prefix_lookup(req.num_prompt_tokens, len(hits) * bm.block_size)
                req.num_cached_prompt_tokens = len(hits) * bm.block_size
        self._queues.state.set_computed(req, computed)
        self._allocate_slots(req, n, prefix_blocks=hits)
        self._queues.admit_waiting(req)
        step.schedule(ScheduledRequest.for_tokens(req, n), blocks=need)
        result.report.admitted.append(req)
        return True
