"""The scheduler's request queues (waiting, running, swapped) and the rank that orders them.

Rank: priority (lower first), then arrival, both folded into one number when aging is on
(``priority + arrival / aging_seconds``: waiting ``aging_seconds`` is worth one priority level). The
rank of a request never changes while it waits, so queues stay sorted by insertion, two requests
never swap places over time (no priority ping-pong), and a request is overtaken only by the bounded
set of arrivals that rank before it. Requests preempted ``max_preemptions`` times escalate ahead of
everything and are preempted only when nothing else is left to preempt.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple, Optional

from ..config import SchedulerConfig
from ..request import Request, RequestStatus
from .request_state import RequestState

__all__ = ["Rank", "RequestQueues"]


class Rank(NamedTuple):
    """A request's sort key, smaller first; compared as a tuple, field by field."""

    tier: int  # 0 for an escalated request (preempted ``max_preemptions`` times), 1 for the others
    level: float  # the priority, plus arrival / ``aging_seconds`` when aging is on
    arrival: float  # arrival time, seconds
    request_id: int  # the last tie-break: two requests never rank equal

    @property
    def escalated(self) -> bool:
        """True for a request that ranks ahead of every priority and is preempted last."""
        return self.tier == 0


class RequestQueues:
    """Waiting, running and swapped requests; the waiting and swapped queues sorted by rank.

    The only code that moves requests between queues (and asks ``RequestState`` for the queue
    statuses WAITING, RUNNING, SWAPPED): the scheduler's sub-steps call its verbs and only read
    ``waiting``, ``running`` and ``swapped``.

    Args:
        config: the scheduler limits (``aging_seconds`` and ``max_preemptions`` shape the rank).
        epoch: the clock reading (seconds) that aging counts arrival from.
        state: the scheduler's writer of request statuses (None: a private one).
    """

    def __init__(self, config: SchedulerConfig, epoch: float, state: Optional[RequestState] = None) -> None:
        self.config = config
        self.epoch = epoch
        self.state = state if state is not None else RequestState()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []

    def rank(self, req: Request) -> Rank:
        """``req``'s sort key: escalated first, then priority level (aged), arrival, id."""
        level: float = req.priority
        if self.config.aging_seconds is not None:
            level = req.priority + (req.arrival_time - self.epoch) / self.config.aging_seconds
        escalated = req.num_preemptions >= self.config.max_preemptions
        return Rank(0 if escalated else 1, level, req.arrival_time, req.request_id)

    def add_waiting(self, req: Request) -> None:
        """Queue ``req`` to wait, by rank."""
        self.state.set_status(req, RequestStatus.WAITING)
        bisect.insort(self.waiting, req, key=self.rank)

    def add_swapped(self, req: Request) -> None:
        """Queue ``req``, whose KV is in the host pool now, by rank."""
        self.state.set_status(req, RequestStatus.SWAPPED)
        bisect.insort(self.swapped, req, key=self.rank)

    def start_running(self, req: Request) -> None:
        """Run ``req``, which is in no queue (a sequence forked off its parent)."""
        self.state.set_status(req, RequestStatus.RUNNING)
        self.running.append(req)

    def admit_waiting(self, req: Request) -> None:
        """Move ``req`` (this very object) from the waiting queue to running."""
        del self.waiting[_index(self.waiting, req)]
        self.start_running(req)

    def swap_in(self, req: Request) -> None:
        """Move ``req`` from the swapped queue to running (its KV comes back this step)."""
        del self.swapped[_index(self.swapped, req)]
        self.start_running(req)

    def preempt_to_waiting(self, req: Request) -> None:
        """Move running ``req`` to the waiting queue, by rank (recompute preemption)."""
        del self.running[_index(self.running, req)]
        self.add_waiting(req)

    def swap_out(self, req: Request) -> None:
        """Move running ``req`` to the swapped queue, by rank (its KV is in the host pool now)."""
        del self.running[_index(self.running, req)]
        self.add_swapped(req)

    def remove(self, gone: list[Request]) -> None:
        """Take the requests of ``gone`` (finished or cancelled: the reap step) out of every queue."""
        ids = {id(r) for r in gone}
        for queue in (self.running, self.swapped, self.waiting):
            queue[:] = [r for r in queue if id(r) not in ids]

    def clear(self) -> None:
        """Empty every queue."""
        for queue in (self.running, self.swapped, self.waiting):
            queue.clear()

    @property
    def has_work(self) -> bool:
        """True while any request is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def queued(self) -> list[Request]:
        """Every queued request: running, swapped, then waiting (pending forks not included)."""
        return self.running + self.swapped + self.waiting

    def all_requests(self) -> list[Request]:
        """Every unfinished request: running, swapped, waiting, then their pending forks."""
        queued = self.queued()
        return queued + [c for r in queued for c in r.pending_forks]

    def preemptible(self) -> list[Request]:
        """Running requests that may be preempted."""
        # A parent cancelled at its fork is finished but holds blocks until the next reap.
        return [r for r in self.running if not r.status.is_finished]


def _index(queue: list[Request], req: Request) -> int:
    """Position of this very object in ``queue`` (``ValueError`` if absent)."""
    for i, r in enumerate(queue):
        if r is req:
            return i
    raise ValueError(f"request {req.request_id} is not in the queue")
