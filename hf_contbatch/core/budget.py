"""One iteration's budget: what the budget step measured, and the rules admit and preempt spend it by.

The budget step fills a ``StepBudget`` without changing a queue or handing out a block: the tokens of
the running requests, their blocks for those tokens, the forks that are due and the swap-ins that
fit. Admit carries those reservations out and spends what is left on waiting requests and drafts;
preempt gives tokens and blocks back when it takes a request out.
"""

from __future__ import annotations

from typing import Optional

from ..config import SchedulerConfig
from ..request import Request
from .block_manager import BlockManager
from .plan import ScheduledRequest
from .queues import Rank, RequestQueues

__all__ = ["StepBudget"]


class StepBudget:
    """The budget of one iteration, spent by admit and preempt. The only code that changes the
    token and block budgets: the sub-steps call its verbs and read ``token_budget`` and
    ``block_budget``.

    Args:
        queues: the scheduler's queues (read: the running requests and the forks they are owed).
        block_manager: the device pool's bookkeeping (read only).
        config: the scheduler limits.
        watermark_blocks: blocks kept free at admission.

    Attributes:
        rows: the requests scheduled so far with their token counts, in the order they were
            planned (the layout order is set when the plan is finished); read only outside.
        forks: parents whose forks are reserved for this step.
        detached_forks: parents whose forks do not fit now; admit queues the forks as independent
            waiting requests.
        swap_ins: (swapped request, tokens) reserved to resume this step.
        swap_barrier_rank: rank of the first swapped request that stays out; no waiting request
            ranked after it is admitted (it would overtake the swapped one).
        kv_arrives: ids of requests whose KV arrives this step by swap-in or fork copy; they cannot
            be swapped out in the same step (the engine swaps out before it copies).
    """

    def __init__(
        self, queues: RequestQueues, block_manager: BlockManager, config: SchedulerConfig, watermark_blocks: int
    ) -> None:
        self._queues = queues
        self._block_manager = block_manager
        self._config = config
        self._watermark_blocks = watermark_blocks
        self.rows: list[ScheduledRequest] = []
        self._tokens = config.max_num_batched_tokens
        self._blocks = 0
        self.forks: list[Request] = []
        self.detached_forks: list[Request] = []
        self.swap_ins: list[tuple[Request, int]] = []
        self.swap_barrier_rank: Optional[Rank] = None
        self.kv_arrives: set[int] = set()

    @property
    def token_budget(self) -> int:
        """Tokens left of ``max_num_batched_tokens``."""
        return self._tokens

    @property
    def block_budget(self) -> int:
        """Blocks left for admissions (free - reservations - watermark; may be negative)."""
        return self._blocks

    # --- reading -----------------------------------------------------------------------------------
    def tokens_to_schedule(self, req: Request, computed: Optional[int] = None, stop_at_fork: bool = True) -> int:
        """Tokens ``req`` may run this step: what it lacks after ``computed`` (default: its
        ``num_computed_tokens``) tokens, within the token budget, ``long_prefill_token_threshold``
        and, for a sliding-window pool, ``BlockManager.step_token_limit`` (so a request alone in the
        pool always progresses); under ``per_request_state``, all it lacks or 0 when all of it fits
        one step (where it never does, at least its prompt's rest, or 0 when that fits one step). With ``stop_at_fork``, a request with pending forks stops one
        token before the end of its prompt (the fork point)."""
        computed = req.num_computed_tokens if computed is None else computed
        todo = req.num_tokens - computed
        if stop_at_fork and req.pending_forks:
            todo = req.num_prompt_tokens - 1 - computed
        n = min(todo, self._tokens)
        if self._config.long_prefill_token_threshold is not None:
            n = min(n, self._config.long_prefill_token_threshold)
        cap = self._block_manager.step_token_limit(computed)
        if cap is not None:
            n = min(n, cap)
        if self._config.per_request_state and 0 < n < todo:
            # Whole prefills for a recurrent model: wait for a step with room for all of it, unless
            # no step ever has (a request recomputed after preemption with more tokens than that).
            whole = min(self._config.max_num_batched_tokens, self._config.long_prefill_token_threshold or todo)
            if cap is not None:
                whole = min(whole, cap)
            if todo <= whole:
                return 0
            # Never whole (resumed with its generated tokens): its prompt part still is, in the
            # chunk that starts it, when one step holds it (a router mixing a prompt's tokens,
            # engine.cross_token_routers, routes them in one forward).
            if 0 < n < req.num_prompt_tokens - computed <= whole:
                return 0
        return max(n, 0)

    def reservation(self, rows: list[ScheduledRequest]) -> int:
        """Blocks the requests of ``rows`` still need for this step's tokens."""
        bm = self._block_manager
        return sum(bm.num_blocks_needed(s.request_id, s.start_position + s.num_new_tokens) for s in rows)

    def block_limit(self, alone: bool = False) -> int:
        """Blocks an admission may take: the block budget, plus the watermark when nothing else
        runs (``alone``, or no running request, reserved fork or swap-in): the watermark then has
        nobody to protect."""
        alone = alone or not (self._queues.running or self.forks or self.swap_ins)
        return self._blocks + (self._watermark_blocks if alone else 0)

    def seats_left(self) -> int:
        """``max_num_seqs`` minus running requests, the forks they are owed, and reserved swap-ins
        with their forks."""
        owed = sum(len(r.pending_forks) for r in self._queues.running if not any(r is p for p in self.detached_forks))
        reserved = sum(1 + len(r.pending_forks) for r, _ in self.swap_ins)
        return self._config.max_num_seqs - len(self._queues.running) - owed - reserved

    # --- the verbs that change the budget ---------------------------------------------------------
    def open_blocks(self, num_free_blocks: int) -> None:
        """Budget step: the block budget is ``num_free_blocks`` minus the blocks the rows planned so
        far need for this step's tokens, minus the watermark."""
        self._blocks = num_free_blocks - self.reservation(self.rows) - self._watermark_blocks

    def schedule(self, row: ScheduledRequest, blocks: int = 0) -> None:
        """Plan ``row``, spending its tokens and ``blocks``."""
        self.rows.append(row)
        self._tokens -= row.num_new_tokens
        self._blocks -= blocks

    def schedule_reserved(self, row: ScheduledRequest) -> None:
        """Plan ``row`` of a fork or swap-in whose tokens and blocks were reserved at the budget step."""
        self.rows.append(row)

    def replace_row(self, index: int, row: ScheduledRequest, blocks: int = 0) -> None:
        """Put ``row`` in place of ``rows[index]`` (a decode that takes drafts), spending the extra
        tokens and ``blocks``."""
        self._tokens -= row.num_new_tokens - self.rows[index].num_new_tokens
        self.rows[index] = row
        self._blocks -= blocks

    def unschedule(self, req: Request) -> list[ScheduledRequest]:
        """Take ``req`` out of this step's rows, giving its tokens back; returns its rows."""
        removed = [s for s in self.rows if s.request_id == req.request_id]
        self.rows[:] = [s for s in self.rows if s.request_id != req.request_id]
        self._tokens += sum(s.num_new_tokens for s in removed)
        return removed

    def reserve_fork(self, parent: Request, tokens: int, blocks: int) -> None:
        """Reserve ``parent``'s due forks: ``tokens`` (one per sequence) and ``blocks``."""
        self.forks.append(parent)
        self._tokens -= tokens
        self._blocks -= blocks

    def reserve_swap_in(self, req: Request, tokens: int, blocks: int) -> None:
        """Reserve the resumption of swapped ``req`` with ``tokens`` tokens in ``blocks`` blocks."""
        self.swap_ins.append((req, tokens))
        self._tokens -= tokens
        self._blocks -= blocks

    def take_blocks(self, blocks: int) -> None:
        """Spend ``blocks`` (an admission's blocks after its prefix-cache hits)."""
        self._blocks -= blocks

    def give_back_blocks(self, blocks: int) -> None:
        """Return ``blocks`` (what a preempted request held or had reserved)."""
        self._blocks += blocks
