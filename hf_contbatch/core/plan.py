"""The scheduler's plain-data outputs: the plan the runner executes, and the report stats read.

``StepPlan`` holds what the engine and the model runner need to carry out one iteration: the
scheduled requests in the batch's layout order (with their draft tokens) and the block mappings to
apply before the forward. ``StepReport`` holds what stats and the dashboard read: who was reaped,
admitted, preempted, swapped or forked, the budget, prefix-cache hits and the phases' seconds. As in
vLLM v1, the runner's input carries no bookkeeping it does not use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request

__all__ = ["ScheduledRequest", "SchedulerCounters", "StepPlan", "StepReport", "StepResult"]


@dataclass
class ScheduledRequest:
    """One request's part of a step: ``num_new_tokens`` rows of the flattened batch.

    Attributes:
        request: the request.
        num_new_tokens: tokens whose KV this step computes.
        samples: True when this step completes the request's known tokens, so a token is sampled.
        draft_token_ids: prompt-lookup drafts that follow the request's last token this step
            (speculative decoding): ``num_new_tokens == 1 + len(draft_token_ids)``, and every row
            yields a greedy token.
    """

    request: Request
    num_new_tokens: int
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def for_tokens(cls, request: Request, num_new_tokens: int) -> "ScheduledRequest":
        """``num_new_tokens`` more tokens of ``request``; it samples when they complete its known
        tokens (decided now: ``num_computed_tokens`` advances after the forward)."""
        return cls(request, num_new_tokens, request.num_computed_tokens + num_new_tokens == request.num_tokens)

    @property
    def is_decode(self) -> bool:
        """One query token that is the request's last known token (not a 1-token prefill chunk).
        Decodes come first in a step's batch; attention serves them batched."""
        return self.num_new_tokens == 1 and not self.request.is_prefill

    @property
    def is_speculative(self) -> bool:
        """The last token plus drafts: attention serves each row as a decode with its own length,
        so these come right after the decodes."""
        return bool(self.draft_token_ids)


@dataclass
class StepPlan:
    """One iteration's plan: what the engine and the model runner execute.

    The engine applies the block mappings in this order before the forward: swap in, swap out, copy
    (``LLMEngine._move_blocks``); the scheduler hands out only blocks that this order makes safe.

    Attributes:
        iteration: the iteration number.
        scheduled: the requests of the flattened batch in layout order: decodes (one token each),
            then requests verifying drafts (``1 + len(draft_token_ids)`` tokens), then prefill
            chunks.
        blocks_to_swap_in: (host block, device block) pairs.
        blocks_to_swap_out: (device block, host block) pairs.
        blocks_to_copy: (src, dst) device block pairs (copy-on-write of a forked partial block).
    """

    iteration: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Rows of the flattened batch: the sum of ``num_new_tokens`` (at most
        ``max_num_batched_tokens``)."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def drafting(self) -> list[ScheduledRequest]:
        """The requests verifying drafts this step, in layout order."""
        return [s for s in self.scheduled if s.draft_token_ids]

    @property
    def moves_blocks(self) -> bool:
        """True when the engine has blocks to swap or copy before the forward."""
        return bool(self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepReport:
    """What one iteration did, for stats and the dashboard.

    Attributes:
        iteration: the iteration number.
        reaped: requests freed in the reap step (finished, cancelled, and cancelled pending forks).
        admitted: requests admitted from the waiting queue.
        preempted: requests preempted this step (by either mode, for memory or for priority).
        swapped_out / swapped_in: requests whose KV moves to / from the host pool this step.
        forked: sequences forked off a parent this step (parallel sampling).
        budget_blocks: what the budget step left for admissions: free blocks - reserved_blocks -
            watermark (negative when running requests already need more than is free: the preempt
            step then preempts).
        reserved_blocks: running requests' blocks for this step's tokens, plus the reserved forks
            and swap-ins.
        num_prefix_hit_tokens: prompt tokens served from the prefix cache at this step's admissions.
        phases: (phase name, seconds) in the order they ran.
    """

    iteration: int
    reaped: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    forked: list[Request] = field(default_factory=list)
    budget_blocks: int = 0
    reserved_blocks: int = 0
    num_prefix_hit_tokens: int = 0
    phases: list[tuple[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """One iteration's plan and report (``Scheduler.schedule`` and ``LLMEngine.step`` return it)."""

    plan: StepPlan
    report: StepReport

    @classmethod
    def empty(cls, iteration: int) -> "StepResult":
        return cls(StepPlan(iteration), StepReport(iteration))


@dataclass
class SchedulerCounters:
    """Counts since the scheduler started (``EngineStats`` reports them).

    Attributes:
        num_preemptions: preemptions of either mode.
        num_swap_preemptions / num_recompute_preemptions: preemptions by mode.
        num_swap_fallbacks: swaps wanted that recomputed instead (host pool full, or KV not yet
            valid because it only arrives this step).
        num_blocks_swapped_out / num_blocks_swapped_in: blocks moved to / from the host pool.
        num_forks: sequences forked off a parent (parallel sampling).
        num_fork_fallbacks: sequences that could not be forked and recompute their prompt.
        num_pool_wall_stops: requests finished "length" because the pool could not grow them.
        num_draft_tokens: prompt-lookup drafts verified.
        num_accepted_draft_tokens: drafts equal to the greedy token, kept.
    """

    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_fallbacks: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_forks: int = 0
    num_fork_fallbacks: int = 0
    num_pool_wall_stops: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
