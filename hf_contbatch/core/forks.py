"""Parallel sampling by forking: the sequences of one ``num_return_sequences > 1`` request share its
prompt's KV.

The first sequence (the parent) prefills the prompt up to its last token, the fork point; the others
wait on it as ``Request.pending_forks``. At the fork point they are forked off it: full blocks are
shared by ref count, the partial last block is copied (copy-on-write, done at once because every
sequence writes into it in the step it is forked), and every sequence computes the last prompt token
and samples its own first token.

A fork that does not fit when it is due is not postponed: its sequences become ordinary waiting
requests (same rank; the prefix cache may still serve their prompt) and the parent goes on alone.
A parent idling for room could deadlock against another one doing the same.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..request import Request, RequestStatus
from .block_manager import BlockManager
from .budget import StepBudget
from .plan import ScheduledRequest, SchedulerCounters, StepResult
from .queues import RequestQueues

__all__ = ["Forks"]


class Forks:
    """The fork sub-steps of reap, budget and admit.

    Args:
        queues: the scheduler's queues.
        block_manager: the device pool's bookkeeping.
        counters: the scheduler's counters (``num_forks``, ``num_fork_fallbacks``).
        allocate_slots: the scheduler's ``allocate_slots``, the one place blocks are handed out.
    """

    def __init__(
        self,
        queues: RequestQueues,
        block_manager: BlockManager,
        counters: SchedulerCounters,
        allocate_slots: Callable[..., Optional[tuple[int, int]]],
    ) -> None:
        self._queues = queues
        self._block_manager = block_manager
        self._counters = counters
        self._allocate_slots = allocate_slots

    @staticmethod
    def take_unforkable(request: Request, max_num_seqs: int, per_request_state: bool = False) -> list[Request]:
        """Take ``request``'s pending forks off it when they can never be forked, to be queued as
        independent requests: nothing to share before the first token (a one-token prompt), never
        room for all of them at once (more sequences than ``max_num_seqs``), or a model with a
        recurrent state per request (``per_request_state``: the runner keeps no state to fork)."""
        if request.pending_forks and (
            per_request_state or request.num_prompt_tokens < 2 or 1 + len(request.pending_forks) > max_num_seqs
        ):
            forks, request.pending_forks = request.pending_forks, []
            return forks
        return []

    def reap_pending(self, req: Request) -> list[Request]:
        """Reap sub-step: cancelled not-yet-forked sequences go now; the others go with a finished
        parent. A cancelled parent with live pending forks keeps computing the prefix they share.
        Returns the sequences taken off ``req``."""
        gone = [c for c in req.pending_forks if c.cancel_requested or req.status.is_finished]
        for c in gone:
            if not c.status.is_finished:
                status = RequestStatus.FINISHED_CANCELLED if c.cancel_requested else req.status
                self._queues.state.set_status(c, status)
        req.pending_forks = [c for c in req.pending_forks if c not in gone]
        return gone

    def reserve(self, step: StepBudget) -> None:
        """Budget sub-step: reserve the forks that are due, best-ranked parent first. Each new
        sequence needs a seat (reserved at the parent's admission), one token, and one block (the
        copy of the partial last block, or a fresh block when the prompt minus one ends on a block
        boundary, in which case the parent needs one too). A fork that does not fit is marked
        detached; a detached parent that is not cancelled is planned on alone."""
        queues = self._queues
        for parent in sorted((r for r in queues.running if r.at_fork_point), key=queues.rank):
            k = len(parent.pending_forks)
            need = k + (1 if parent.num_computed_tokens % self._block_manager.block_size == 0 else 0)
            alone = queues.running == [parent] and not step.forks
            if k + 1 <= step.token_budget and need <= step.block_limit(alone):
                step.reserve_fork(parent, k + 1, need)
                continue
            step.detached_forks.append(parent)
            if parent.cancel_requested:
                continue  # admit finishes it: it lived on only for its forks
            n = step.tokens_to_schedule(parent, stop_at_fork=False)
            if n:
                row = ScheduledRequest.for_tokens(parent, n)
                step.schedule(row, blocks=step.reservation([row]))

    def admit(self, result: StepResult, step: StepBudget) -> None:
        """Admit sub-step: queue the detached forks as waiting requests, then fork the reserved
        ones (in that order: a detached cancelled parent frees blocks that forks may take)."""
        for parent in step.detached_forks:
            self._detach(parent)
        for parent in step.forks:
            self._fork(result, step, parent)

    def _detach(self, parent: Request) -> None:
        for child in parent.pending_forks:
            self._queues.add_waiting(child)
        self._counters.num_fork_fallbacks += len(parent.pending_forks)
        parent.pending_forks = []
        if parent.cancel_requested:
            self._finish_cancelled_parent(parent)

    def _fork(self, result: StepResult, step: StepBudget, parent: Request) -> None:
        """Fork the parent's pending sequences: they share its full blocks and get a copy of its
        partial last block; every sequence then computes the last prompt token and samples."""
        children, parent.pending_forks = parent.pending_forks, []
        for child in children:
            self._queues.state.set_computed(child, parent.num_computed_tokens)
            copy = self._allocate_slots(child, 0, fork_of=parent)
            if copy is not None:
                result.plan.blocks_to_copy.append(copy)
            self._queues.start_running(child)
            step.kv_arrives.add(child.request_id)
            step.schedule_reserved(ScheduledRequest.for_tokens(child, 1))
            result.report.forked.append(child)
        self._counters.num_forks += len(children)
        if parent.cancel_requested:
            # Finished, but its blocks stay until the next reap: the copies of its partial block are
            # made after this step's swap-ins, which must not be handed that block.
            self._queues.state.set_status(parent, RequestStatus.FINISHED_CANCELLED)
        else:
            step.schedule_reserved(ScheduledRequest.for_tokens(parent, 1))

    def _finish_cancelled_parent(self, parent: Request) -> None:
        """A cancelled parent whose forks were detached lived on only to compute their prefix. Its
        blocks go now (nothing copies from them), so nobody waits on them; the next reap reports it."""
        self._queues.state.set_status(parent, RequestStatus.FINISHED_CANCELLED)
        self._block_manager.free(parent.request_id)
