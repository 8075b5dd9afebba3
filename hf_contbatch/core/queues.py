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
from typing import NamedTuple

from ..config import SchedulerConfig
from ..request import Request, RequestStatus

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

    Args:
        config: the scheduler limits (``aging_seconds`` and ``max_preemptions`` shape the rank).
        epoch: the clock reading (seconds) that aging counts arrival from.
    """

    def __init__(self, config: SchedulerConfig, epoch: float) -> None:
        self.config = config
        self.epoch = epoch
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
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=self.rank)

    def add_swapped(self, req: Request) -> None:
        """Queue ``req``, whose KV is in the host pool now, by rank."""
        req.status = RequestStatus.SWAPPED
        bisect.insort(self.swapped, req, key=self.rank)

    def take_waiting(self, req: Request) -> None:
        """Remove ``req`` (this very object) from the waiting queue."""
        del self.waiting[next(i for i, r in enumerate(self.waiting) if r is req)]

    @property
    def has_work(self) -> bool:
        """True while any request is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def all_requests(self) -> list[Request]:
        """Every unfinished request: running, swapped, waiting, then their pending forks."""
        queued = self.running + self.swapped + self.waiting
        return queued + [c for r in queued for c in r.pending_forks]

    def preemptible(self) -> list[Request]:
        """Running requests that may be preempted."""
        # A parent cancelled at its fork is finished but holds blocks until the next reap.
        return [r for r in self.running if not r.status.is_finished]
