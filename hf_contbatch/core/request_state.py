"""The one writer of a request's progress fields: ``status``, ``num_computed_tokens`` and
``output_token_ids``.

The scheduler owns the one ``RequestState`` of an engine and hands it to its sub-steps (queues,
forks, admission, preemption); every call runs under the engine's state lock (the scheduler's
methods are only called there). Nothing outside ``core/`` writes these fields: the engine asks the
scheduler (``Scheduler.fail``, ``Scheduler.finish_dropped``) or returns decisions
(``StopDecision``) that ``Scheduler.update_from_output`` applies. ``tests/core/test_one_writer.py``
checks it by reading the package's source.

It also keeps which requests the model runner's batch holds, so the plan can carry a request's
data once (``NewRequestData``) and then the ids that left (``StepPlan.finished_ids`` /
``preempted_ids``): a request leaves the batch when its status stops being RUNNING.
"""

from __future__ import annotations

from typing import Sequence

from ..request import Request, RequestStatus

__all__ = ["RequestState"]


class RequestState:
    """Writes requests' status, computed tokens and output tokens; tracks the runner's batch."""

    def __init__(self) -> None:
        self._in_batch: set[int] = set()
        self._finished_ids: list[int] = []
        self._preempted_ids: list[int] = []

    # --- the fields ------------------------------------------------------------------------------
    def set_status(self, req: Request, status: RequestStatus) -> None:
        """Set ``req.status``; a request that stops running leaves the runner's batch (preempted
        when it goes back to WAITING or SWAPPED, finished otherwise)."""
        req.status = status
        if status is not RequestStatus.RUNNING and req.request_id in self._in_batch:
            self._in_batch.discard(req.request_id)
            if status.is_finished:
                self._finished_ids.append(req.request_id)
            else:
                self._preempted_ids.append(req.request_id)

    def set_computed(self, req: Request, num_computed_tokens: int) -> None:
        """Set ``req.num_computed_tokens`` (tokens whose KV is in the cache).

        Raises:
            ValueError: outside ``[0, req.num_tokens]``.
        """
        if not 0 <= num_computed_tokens <= req.num_tokens:
            raise ValueError(
                f"num_computed_tokens must be in [0, {req.num_tokens}] (the request's tokens), got {num_computed_tokens}"
            )
        req.num_computed_tokens = num_computed_tokens

    def append_tokens(self, req: Request, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (decided kept: no stop falls before the last) to ``req``'s output."""
        req.output_token_ids.extend(tokens)

    # --- the runner's batch ----------------------------------------------------------------------
    def enters_batch(self, request_id: int) -> bool:
        """Record that the runner's batch gets ``request_id``'s row this step; False when it has
        it already (no ``NewRequestData`` to send)."""
        if request_id in self._in_batch:
            return False
        self._in_batch.add(request_id)
        return True

    def leaves(self, request_id: int) -> None:
        """``request_id`` left the scheduler without a status change (dropped on close or a failed
        step): its row goes with the next plan's finished ids."""
        if request_id in self._in_batch:
            self._in_batch.discard(request_id)
            self._finished_ids.append(request_id)

    def take_departures(self) -> tuple[list[int], list[int]]:
        """The ids that left the batch since the last call: (finished, preempted)."""
        finished, self._finished_ids = self._finished_ids, []
        preempted, self._preempted_ids = self._preempted_ids, []
        return finished, preempted
