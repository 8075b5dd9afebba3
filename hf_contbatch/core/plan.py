"""The scheduler's plain-data outputs: the plan the runner executes, and the report stats read.

``StepPlan`` is the contract between the scheduler and the model runner, made of values only (no
``Request`` crosses it): the data of each request that enters the runner's batch, once
(``NewRequestData``: its token ids, ``SamplingValues``, adapter); per step only what changes (the
scheduled rows in the batch's layout order with their token ids, first position, block table and
drafts); the ids that left the batch (finished, cancelled, failed, preempted); and the block
mappings to apply before the forward. The runner answers with a ``RunnerOutput``, on which the
engine decides the stops (``StopDecision``) before the scheduler appends any token.
``StepReport`` holds what stats and the dashboard read: who was reaped, admitted, preempted,
swapped or forked, the budget, prefix-cache hits and the phases' seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..request import Request, RequestStatus, SamplingParams

__all__ = [
    "NewRequestData",
    "RunnerOutput",
    "SamplingValues",
    "ScheduledRequest",
    "SchedulerCounters",
    "StepPlan",
    "StepReport",
    "StepResult",
    "StopDecision",
]


@dataclass(frozen=True)
class SamplingValues:
    """A request's sampling settings as plain values, for the runner's batch and the sampler
    (``SamplingParams`` minus the live objects: processors, criteria and the grammar stay
    engine-side, keyed by request id; only whether the request has them is here).

    Attributes:
        do_sample, temperature, top_k, top_p, seed, logprobs, max_new_tokens, eos_token_ids:
            ``SamplingParams``' values.
        prompt_logprobs: positions ``p`` with ``p + 1`` in ``[prompt_logprobs, num_prompt_tokens)``
            score the next prompt token (0: none).
        score_token_id: scored as the whole prompt's continuation at its first sampling row.
        has_grammar: the request's structured outputs mask its rows (engine-side matcher).
        has_stopping_criteria: its stopping criteria read the processed scores of each step.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int = 0
    score_token_id: Optional[int] = None
    has_grammar: bool = False
    has_stopping_criteria: bool = False

    @classmethod
    def of(cls, params: SamplingParams) -> "SamplingValues":
        """The values of ``params`` (its processors, criteria and grammar stay with the engine)."""
        has_grammar = params.structured_outputs is not None
        return cls(
            do_sample=params.do_sample,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            logprobs=params.logprobs,
            max_new_tokens=params.max_new_tokens,
            eos_token_ids=tuple(params.eos_token_ids),
            prompt_logprobs=int(params.prompt_logprobs),
            score_token_id=params.score_token_id,
            has_grammar=has_grammar,
            has_stopping_criteria=bool(params.stopping_criteria),
        )


@dataclass(frozen=True)
class NewRequestData:
    """A request entering the runner's batch (admitted, swapped in, forked, or resumed after
    preemption): sent once; later steps carry only its ``ScheduledRequest`` rows.

    Attributes:
        request_id: the request's id (the key of its batch row).
        token_ids: its prompt and the tokens generated so far (a resumed request keeps them).
        num_prompt_tokens: the prompt's length (``token_ids[:num_prompt_tokens]``).
        sampling: its sampling settings as values.
        adapter_name: the LoRA adapter its rows run (None: the base model).
        kv_variant: what its K/V is computed with beyond the weights (``Request.kv_variant``: a
            LongRoPE model's long factors), None for the default; fixed while the row is in the
            batch (a change sends the request back to the waiting queue, and its row anew).
    """

    request_id: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    sampling: SamplingValues
    adapter_name: Optional[str] = None
    kv_variant: Optional[str] = None

    @classmethod
    def of(cls, request: Request) -> "NewRequestData":
        return cls(
            request.request_id,
            tuple(request.all_token_ids),
            request.num_prompt_tokens,
            SamplingValues.of(request.sampling),
            request.sampling.adapter_name,
            request.kv_variant,
        )


@dataclass(frozen=True)
class StopDecision:
    """What the engine decided on one request's proposed tokens of a step, before any is appended
    (``Scheduler.update_from_output`` applies it).

    Attributes:
        num_kept: how many of the proposed tokens the request keeps (the first ones; 0..all).
        status: the finished status it ends with after them (a stop), or None to go on.
        error: the exception that failed the request (``status`` is then ``FINISHED_ERROR``).
    """

    num_kept: int
    status: Optional[RequestStatus] = None
    error: Optional[BaseException] = None


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a step, ``num_new_tokens`` rows of the flattened batch: a value the
    model runner builds its inputs from without reading the block manager or the live request.

    The scheduler creates a row when it plans the request (``for_tokens``; the ids and positions
    are fixed then) and adds the block table once every planned request has its blocks
    (``with_blocks``, at the end of the preempt step). What does not change from step to step
    (sampling settings, adapter, prompt) reached the runner once, in ``NewRequestData``.

    Attributes:
        num_new_tokens: tokens whose KV this step computes.
        samples: True when this step completes the request's known tokens, so a token is sampled.
        draft_token_ids: prompt-lookup drafts that follow the request's last token this step
            (speculative decoding): ``num_new_tokens == 1 + len(draft_token_ids)``, and every row
            yields a greedy token.
        request_id: the request's id.
        token_ids: the ``num_new_tokens`` input token ids, in row order (a request verifying drafts:
            its last token, then the drafts).
        start_position: position of the first new token: the request's ``num_computed_tokens``
            when it was planned.
        is_decode: one query token that is the request's last known token (not a 1-token prefill
            chunk). Decodes come first in a step's batch; attention serves them batched.
        block_ids: the request's block table (device block ids) when the plan was finished; it
            covers ``start_position + num_new_tokens`` tokens. Empty until ``with_blocks``.

    Which positions score their next prompt token (``SamplingValues.prompt_logprobs``,
    ``score_token_id``) the runner works out from the request's batch row: they never change.
    """

    num_new_tokens: int
    samples: bool
    draft_token_ids: tuple[int, ...] = ()
    request_id: int = -1
    token_ids: tuple[int, ...] = ()
    start_position: int = 0
    is_decode: bool = False
    block_ids: tuple[int, ...] = ()

    @classmethod
    def for_tokens(
        cls, request: Request, num_new_tokens: int, draft_token_ids: Sequence[int] = ()
    ) -> "ScheduledRequest":
        """``num_new_tokens`` more tokens of ``request`` from its ``num_computed_tokens`` (with
        ``draft_token_ids``: its last token and those drafts, ``num_new_tokens == 1 + len(drafts)``).
        It samples when they complete its known tokens (decided now: ``num_computed_tokens``
        advances after the forward)."""
        start = request.num_computed_tokens
        drafts = tuple(draft_token_ids)
        prompt, output = request.prompt_token_ids, request.output_token_ids
        if drafts:
            token_ids = ((output or prompt)[-1], *drafts)
        else:  # slices of the two lists, not of their concatenation (a decode row is every step)
            end, n_prompt = start + num_new_tokens, len(prompt)
            if start >= n_prompt:
                token_ids = tuple(output[start - n_prompt : end - n_prompt])
            elif end <= n_prompt:
                token_ids = tuple(prompt[start:end])
            else:
                token_ids = (*prompt[start:], *output[: end - n_prompt])
        samples = bool(drafts) or start + num_new_tokens == request.num_tokens
        return cls(
            num_new_tokens,
            samples,
            drafts,
            request.request_id,
            token_ids,
            start,
            num_new_tokens == 1 and not request.is_prefill,
        )

    def with_blocks(self, block_ids: Sequence[int]) -> "ScheduledRequest":
        """This row with the request's block table ``block_ids``."""
        # A field copy, not dataclasses.replace (which re-runs __init__ through its signature): every
        # row of every step passes here.
        row = object.__new__(ScheduledRequest)
        row.__dict__.update(self.__dict__)
        row.__dict__["block_ids"] = tuple(block_ids)
        return row

    @property
    def is_speculative(self) -> bool:
        """The last token plus drafts: attention serves each row as a decode with its own length,
        so these come right after the decodes."""
        return bool(self.draft_token_ids)

    def scored_positions(self, prompt_logprobs: int, num_prompt_tokens: int) -> range:
        """Positions of this step whose next prompt token is scored, the targets being ``p + 1``
        in ``[prompt_logprobs, num_prompt_tokens)``; empty when ``prompt_logprobs`` is 0."""
        if not prompt_logprobs:
            return range(0)
        start = self.start_position
        lo = max(start, prompt_logprobs - 1)
        return range(lo, max(lo, min(start + self.num_new_tokens, num_prompt_tokens - 1)))


@dataclass
class StepPlan:
    """One iteration's plan: what the engine and the model runner execute.

    The engine applies the block mappings in this order before the forward: swap in, swap out, copy
    (``kv_pools.move_blocks``); the scheduler hands out only blocks that this order makes safe.

    Attributes:
        iteration: the iteration number.
        scheduled: the requests of the flattened batch in layout order: decodes (one token each),
            then requests verifying drafts (``1 + len(draft_token_ids)`` tokens), then prefill
            chunks; each row carries its token ids, first position and block table, so the runner
            needs nothing else.
        blocks_to_swap_in: (host block, device block) pairs.
        blocks_to_swap_out: (device block, host block) pairs.
        blocks_to_copy: (src, dst) device block pairs (copy-on-write of a forked partial block).
        new_requests: requests entering the runner's batch this step (their data, once); the
            runner adds them after removing ``finished_ids`` and ``preempted_ids``.
        finished_ids: ids that left the batch since the last plan: finished, cancelled, failed.
        preempted_ids: ids that left the batch since the last plan by preemption (recompute or
            swap out); they come back as ``new_requests``.
    """

    iteration: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_ids: list[int] = field(default_factory=list)
    preempted_ids: list[int] = field(default_factory=list)
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
    def sampling(self) -> list[ScheduledRequest]:
        """The rows that sample one token this step (requests verifying drafts excepted), in
        layout order."""
        return [s for s in self.scheduled if s.samples and not s.draft_token_ids]

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
        """No row to run (the batch diffs, if any, are applied at the next forward)."""
        return not self.scheduled


@dataclass
class RunnerOutput:
    """What one step's forward produced (``ModelRunner.execute``), for
    ``Scheduler.update_from_output``.

    Attributes:
        sampled: ``{request_id: token}`` for each sampling row (``StepPlan.sampling``).
        greedy: ``{request_id: [token per row]}`` for each request verifying drafts: the greedy
            token after its last token and after each draft (``1 + len(draft_token_ids)`` tokens).
        prompt_logprobs: ``{request_id: [(position, log-prob, is_argmax), ...]}``: the log-prob of
            the token at ``position`` given the ones before it (prompt tokens of
            ``SamplingParams.prompt_logprobs``; ``num_prompt_tokens`` for ``score_token_id``), and
            whether it was the argmax.
        logprobs: ``{request_id: (log-prob of the sampled token, top [(token, log-prob), ...] or
            None)}`` for sampling rows whose ``SamplingValues.logprobs`` is set (processed scores).
    """

    sampled: dict[int, int] = field(default_factory=dict)
    greedy: dict[int, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[tuple[int, float, bool]]] = field(default_factory=dict)
    logprobs: dict[int, tuple[float, Optional[list[tuple[int, float]]]]] = field(default_factory=dict)

    def merge(self, other: "RunnerOutput") -> None:
        """Add ``other``'s entries (another part of the same step's requests)."""
        self.sampled.update(other.sampled)
        self.greedy.update(other.greedy)
        self.logprobs.update(other.logprobs)
        for rid, scores in other.prompt_logprobs.items():
            self.prompt_logprobs.setdefault(rid, []).extend(scores)


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
