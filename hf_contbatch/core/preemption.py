"""Preemption: which running request gives way, and how (swap its KV out, or free it to recompute).

Two callers: the preempt step, which takes running requests out, lowest-ranked first, until the
others' blocks for this step fit; and admission, where a waiting request at least one priority level
above a running one may take its seat or blocks. A preempted request keeps every token it generated.
Escalated requests (preempted ``max_preemptions`` times) are preempted only when nothing else is
left, and the best-ranked of them never, so it finishes: no livelock.
"""

from __future__ import annotations

from typing import Optional

from ..config import SchedulerConfig
from ..request import Request, RequestStatus
from .block_manager import BlockManager
from .budget import StepBudget
from .phases import PhaseTimer
from .plan import SchedulerCounters, StepResult
from .queues import RequestQueues
from .swap import Swap

__all__ = ["Preemption"]


class Preemption:
    """Chooses victims and preempts them.

    Args:
        config: the scheduler limits (``max_preemptions``).
        queues: the scheduler's queues.
        block_manager: the device pool's bookkeeping.
        swap: swap preemption (the mode choice and the swap-out).
        counters: the scheduler's counters (preemptions by mode, pool-wall stops).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        queues: RequestQueues,
        block_manager: BlockManager,
        swap: Swap,
        counters: SchedulerCounters,
    ) -> None:
        self._config = config
        self._queues = queues
        self._block_manager = block_manager
        self._swap = swap
        self._counters = counters

    def until_running_fit(self, result: StepResult, step: StepBudget) -> None:
        """While the planned requests' blocks for this step exceed the free blocks, preempt the
        lowest-ranked running request; with nobody left to preempt, what still does not fit stops
        at the pool wall (``_stop_at_pool_wall``)."""
        while step.reservation(step.rows) > self._block_manager.num_free_blocks:
            victim = self._choose_victim()
            if victim is None:
                self._stop_at_pool_wall(step)
                return
            self.preempt(result, step, victim)

    def for_admission(
        self, result: StepResult, step: StepBudget, req: Request, timer: Optional[PhaseTimer] = None
    ) -> bool:
        """Preempt the lowest-ranked running request if it is at least one priority level below the
        waiting ``req`` (escalated requests are exempt); False if there is none. ``timer`` charges
        the time before to "admit" and the preemption to "preempt"."""
        rank = self._queues.rank
        level = rank(req).level
        victims = [r for r in self._queues.preemptible() if not rank(r).escalated and rank(r).level - level >= 1]
        if rank(req).escalated or not victims:
            return False
        if timer is not None:
            timer.charge("admit")
        self.preempt(result, step, max(victims, key=rank))
        if timer is not None:
            timer.charge("preempt")
        return True

    def preempt(self, result: StepResult, step: StepBudget, req: Request) -> None:
        """Take ``req`` out of running and out of this step's rows, by swap or recompute
        (``Swap.choose_mode``); its tokens and blocks return to the step's budget."""
        bm = self._block_manager
        reserved = step.reservation(step.unschedule(req))
        before = bm.num_free_blocks
        if req.request_id in step.kv_arrives:  # its swap-in or fork copy is moot now
            table = set(bm.get_block_table(req.request_id))
            plan = result.plan
            plan.blocks_to_swap_in[:] = [p for p in plan.blocks_to_swap_in if p[1] not in table]
            plan.blocks_to_copy[:] = [p for p in plan.blocks_to_copy if p[1] not in table]
        req.num_preemptions += 1  # before re-queuing: the queue position must see an escalation
        self._counters.num_preemptions += 1
        mode, fell_back = self._swap.choose_mode(req, step)
        self._counters.num_swap_fallbacks += fell_back
        if mode == "swap":
            self._swap.swap_out(result, req)
        else:
            bm.free(req.request_id)
            self._queues.state.set_computed(req, 0)
            self._counters.num_recompute_preemptions += 1
            self._queues.preempt_to_waiting(req)
        step.give_back_blocks(reserved + bm.num_free_blocks - before)
        result.report.preempted.append(req)

    def _choose_victim(self) -> Optional[Request]:
        """The lowest-ranked running request; escalated ones only if nothing else is left. Among
        escalated ones the best-ranked is never chosen, so it finishes: no livelock."""
        alive = self._queues.preemptible()
        if len(alive) <= 1:
            return None
        candidates = [r for r in alive if r.num_preemptions < self._config.max_preemptions]
        return max(candidates or alive, key=self._queues.rank)

    def _stop_at_pool_wall(self, step: StepBudget) -> None:
        """Finish planned requests, lowest rank first, with "length" until the rest fit: the pool
        cannot hold their next tokens and nothing is left to preempt (blocks held by requests that
        cannot be preempted, or taken outside the scheduler). They keep every token generated so
        far; the next reap frees their blocks. Failing instead would fail every request in flight."""
        by_id = {r.request_id: r for r in self._queues.running}
        for s in sorted(step.rows, key=lambda s: self._queues.rank(by_id[s.request_id]), reverse=True):
            if step.reservation(step.rows) <= self._block_manager.num_free_blocks:
                return
            req = by_id[s.request_id]
            step.unschedule(req)
            self._queues.state.set_status(req, RequestStatus.FINISHED_LENGTH)
            self._counters.num_pool_wall_stops += 1
