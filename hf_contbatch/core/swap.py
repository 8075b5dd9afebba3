"""Swap preemption: a preempted request's KV moves to the host pool and comes back when it fits.

Swapped requests resume in rank order, before any waiting request they rank before, and a waiting
request never overtakes a swapped one that ranks before it. The block mappings go into the plan;
the engine moves the blocks before the forward in the order swap in, swap out, copy, so a host block
freed by a swap-in may take a swap-out of the same step, and a device block freed by a swap-out may
be a copy target of the same step.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..config import SchedulerConfig
from ..request import Request
from .block_manager import BlockManager
from .budget import StepBudget
from .plan import ScheduledRequest, SchedulerCounters, StepResult
from .queues import RequestQueues

__all__ = ["Swap"]


class Swap:
    """The swap sub-steps of budget, admit and preempt, and the choice between swap and recompute.

    Args:
        config: the scheduler limits (``preemption_mode``).
        queues: the scheduler's queues.
        block_manager: the device pool's bookkeeping.
        host_block_manager: the host swap pool's bookkeeping (0 blocks: every swap falls back to
            recompute).
        counters: the scheduler's counters (swap preemptions, fallbacks, blocks moved).
        allocate_slots: the scheduler's ``allocate_slots``, the one place device blocks are handed out.
        swap_cost_per_block: cost of swapping one block out and back in, in tokens of recompute
            (``preemption_mode="auto"``).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        queues: RequestQueues,
        block_manager: BlockManager,
        host_block_manager: BlockManager,
        counters: SchedulerCounters,
        allocate_slots: Callable[..., Optional[tuple[int, int]]],
        swap_cost_per_block: float,
    ) -> None:
        self._config = config
        self._queues = queues
        self._block_manager = block_manager
        self._host_block_manager = host_block_manager
        self._counters = counters
        self._allocate_slots = allocate_slots
        self.swap_cost_per_block = swap_cost_per_block

    def reserve_swap_ins(self, step: StepBudget) -> None:
        """Budget sub-step: reserve swapped requests in rank order, until one does not fit (tokens,
        seats for it and its forks, blocks) or a waiting request ranks before it; that one's rank
        becomes the step's swap barrier."""
        rank = self._queues.rank
        # The forks detached this step join the waiting queue in admit; they wait already.
        waiting = self._queues.waiting[:1] + [c for p in step.detached_forks for c in p.pending_forks]
        first_waiting = min(map(rank, waiting), default=None)
        for req in self._queues.swapped:
            if first_waiting is not None and first_waiting < rank(req):
                step.swap_barrier_rank = rank(req)
                return
            n = step.tokens_to_schedule(req)
            need = self._block_manager.num_blocks_needed(
                req.request_id, req.num_computed_tokens + n, req.num_computed_tokens
            )
            if n == 0 or step.seats_left() < 1 + len(req.pending_forks) or need > step.block_limit():
                step.swap_barrier_rank = rank(req)
                return
            step.reserve_swap_in(req, n, need)

    def swap_in(self, result: StepResult, step: StepBudget) -> None:
        """Admit sub-step: resume the reserved swapped requests; their host blocks are free at once
        (the engine swaps in before it swaps out)."""
        for req, n in step.swap_ins:
            host_table = self._host_block_manager.get_block_table(req.request_id)
            self._allocate_slots(req, n)
            device_table = self._block_manager.get_block_table(req.request_id)
            pairs = _live_pairs(host_table, device_table, self._host_block_manager, self._block_manager)
            result.plan.blocks_to_swap_in.extend(pairs)
            self._host_block_manager.free(req.request_id)
            self._counters.num_blocks_swapped_in += len(pairs)
            self._queues.swap_in(req)
            step.kv_arrives.add(req.request_id)
            step.schedule_reserved(ScheduledRequest.for_tokens(req, n))
            result.report.swapped_in.append(req)

    def choose_mode(self, req: Request, step: StepBudget) -> tuple[str, bool]:
        """("swap" or "recompute", whether a wanted swap fell back to recompute) for this victim.

        Recompute when nothing is computed (free), when its KV only arrives this step (swap-in or
        fork copy still pending: the engine swaps out before it copies), or when the host pool
        cannot take it (the fallback). "auto" swaps when moving its blocks out and back costs less
        than recomputing its tokens: ``swap_cost_per_block * blocks < tokens``, where tokens
        excludes leading blocks shared with a running request and cached (they survive a recompute).
        """
        mode = self._config.preemption_mode
        bm = self._block_manager
        # The blocks it holds (under a window, fewer than its computed tokens span).
        blocks = bm.blocks_for_tokens(req.num_computed_tokens) - bm.first_live_block(req.num_computed_tokens)
        if mode == "recompute" or blocks == 0:
            return "recompute", False
        if req.request_id in step.kv_arrives or not self._host_block_manager.can_allocate(blocks):
            return "recompute", True
        if mode == "swap":
            return "swap", False
        table = bm.get_block_table(req.request_id)
        shared = 0
        while (
            shared < blocks
            and table[shared] != bm.null_block
            and bm.ref_counts[table[shared]] > 1
            and bm.is_cached(table[shared])
        ):
            shared += 1
        tokens_to_recompute = req.num_computed_tokens - shared * bm.block_size
        return ("swap" if self.swap_cost_per_block * blocks < tokens_to_recompute else "recompute"), False

    def swap_out(self, result: StepResult, req: Request) -> None:
        """Preempt sub-step: move running ``req``'s computed KV to the host pool and queue it as
        swapped."""
        bm, host = self._block_manager, self._host_block_manager
        computed = req.num_computed_tokens
        # Under a window the host table gets the same null entries as the device one.
        host.allocate(req.request_id, bm.blocks_for_tokens(computed) * bm.block_size, num_computed_tokens=computed)
        device_table = bm.get_block_table(req.request_id)
        pairs = _live_pairs(device_table, host.get_block_table(req.request_id), bm, host)
        result.plan.blocks_to_swap_out.extend(pairs)
        bm.free(req.request_id)
        self._counters.num_blocks_swapped_out += len(pairs)
        self._counters.num_swap_preemptions += 1
        self._queues.swap_out(req)
        result.report.swapped_out.append(req)


def _live_pairs(
    src_table: list[int], dst_table: list[int], src: BlockManager, dst: BlockManager
) -> list[tuple[int, int]]:
    """(src block, dst block) pairs of two tables of one request, position by position, without
    the positions a window left null (nothing to move there; both pools' tables agree on them).

    Raises:
        RuntimeError: one table holds a block where the other has a null entry (KV would be lost).
    """
    pairs = []
    for s, d in zip(src_table, dst_table):
        if (s == src.null_block) != (d == dst.null_block):
            raise RuntimeError(f"swap tables disagree on a null entry: {src_table} vs {dst_table}")
        if s != src.null_block:
            pairs.append((s, d))
    return pairs
