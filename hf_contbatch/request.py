"""Request state, the single source of truth the scheduler reasons about.

Following vLLM v1, a request is its token ids plus ``num_computed_tokens`` (how many of them have KV
in the cache). Prefill, chunked prefill, prefix-cache hits and resumption after preemption are all
"schedule ``num_tokens - num_computed_tokens`` more tokens"; no special cases.
"""

from __future__ import annotations

import array
import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from .config import is_int


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop string
    FINISHED_LENGTH = "finished_length"  # max_new_tokens or the model's context
    FINISHED_CANCELLED = "finished_cancelled"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")


#: The ``adapter_names`` entry for the base model, PEFT's spelling in mixed-batch inference.
BASE_ADAPTER = "__base__"

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters (names follow ``transformers.GenerationConfig``).

    The one place each value is checked: construction (and ``dataclasses.replace``) raises
    ``ValueError`` naming the field, the allowed values and the value given, for every request
    path alike (``LLMEngine.submit``, the pipeline, the CLI, lm-eval). What needs the engine (token
    ids against the vocabulary, the context, the pool, adapters) ``RequestFactory.build`` checks.

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1).
        min_new_tokens: EOS is suppressed until this many tokens exist (as transformers'
            ``MinNewTokensLengthLogitsProcessor``).
        do_sample: sample (True) or take the argmax (False).
        temperature, top_k, top_p, repetition_penalty: as in transformers; applied with
            transformers' own logits processors.
        eos_token_ids: token ids that finish the request; empty when ``ignore_eos``.
        ignore_eos: keep generating past EOS (benchmarks).
        seed: seed of this request's sampling generator; None draws from the engine's generator.
        prompt_logprobs: 0 (off), or k >= 1 (``True`` means 1): record the log-prob of every prompt
            token from position k on, given the tokens before it, in ``Request.prompt_logprobs``
            (scoring, e.g. lm-eval's loglikelihood). Rows before k - 1 are not needed, so a
            prefix-cache hit may cover at most k - 1 prompt tokens of such a request.
        score_token_id: with ``prompt_logprobs``, also score this token as the continuation of the
            whole prompt (at the prompt's last row, never fed to the model), so a scored sequence
            can fill the model's whole context.
        logits_processor: the request's full ``transformers.LogitsProcessorList`` as ``generate``
            builds it (``engine.logits_processors.build_logits_processor``); it replaces the processors built
            from the fields above. None: built from the fields above. Or a zero-argument callable
            returning such a list, called once per request and per fork when it first samples
            (``engine.logits_processors.PerRequestProcessors``: stateful processors get their own).
        stopping_criteria: a ``transformers.StoppingCriteriaList`` evaluated on the request's own
            ``[1, seq]`` ids after each token; True finishes it as "stop".
        logprobs: None (off), 0 (record the log-prob of each chosen token under the processed
            scores, as ``generate(output_scores=True)`` scores it), or N >= 1 (also the top N).
        prompt_lookup_num_tokens: draft up to this many tokens per step from n-gram matches in the
            request's own context and verify them in the step's forward (prompt-lookup speculative
            decoding, ``hf_contbatch.core.prompt_lookup``); None takes ``EngineConfig``'s default, 0 is
            off. Only requests whose next token is a plain argmax draft (``can_draft``); the
            output is exactly the one without drafts.
        max_matching_ngram_size: longest context suffix looked up for drafts (transformers' name);
            None means 2, transformers' default.
        adapter_name: the LoRA adapter of a ``peft.PeftModel`` that serves this request (PEFT's
            ``adapter_names`` entry). Given to ``LLMEngine.build_request``: a loaded adapter's name,
            ``BASE_ADAPTER`` ("__base__") for the base model, or None for the model's active adapter
            (the base model when the model has no adapters). On a built request: the adapter that
            runs, or None for the base model.
        structured_outputs: a ``StructuredOutputsParams`` (or a dict of its fields, vLLM's names):
            the output must match this JSON schema, regex, choice or grammar; the engine masks
            every step's logits with the request's grammar and the grammar decides where it may
            stop (``hf_contbatch.engine.structured``). None: unconstrained.
    """

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: Optional[int] = None
    prompt_logprobs: int = 0
    score_token_id: Optional[int] = None
    logits_processor: Any = field(default=None, compare=False, repr=False)
    stopping_criteria: Any = field(default=None, compare=False, repr=False)
    logprobs: Optional[int] = None
    prompt_lookup_num_tokens: Optional[int] = None
    max_matching_ngram_size: Optional[int] = None
    adapter_name: Optional[str] = None
    structured_outputs: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_sampling_values(self)

    @property
    def can_draft(self) -> bool:
        """True when prompt-lookup drafts are on and can be verified exactly by comparing them with
        the argmax of each row (under the request's grammar mask, if any): greedy with no
        processor, no per-token scores, no stopping criteria (sampled requests and processors that
        read the history skip drafting)."""
        return (
            bool(self.prompt_lookup_num_tokens)
            and self.is_greedy_unprocessed
            and self.logprobs is None
            and not self.prompt_logprobs
            and self.score_token_id is None
            and not self.stopping_criteria
        )

    @property
    def is_greedy_plain(self) -> bool:
        """True when the next token is a plain argmax (no processor or grammar changes the ranking)."""
        return self.structured_outputs is None and self.is_greedy_unprocessed

    @property
    def is_greedy_unprocessed(self) -> bool:
        """True when the next token is the argmax of the logits, masked by the request's grammar if
        it has one: greedy, and no logits processor but the grammar mask's place in the list."""
        procs = self.logits_processor
        if procs is not None:
            if not isinstance(procs, (list, tuple)):
                return False  # a factory: its processors are unknown until it is called
            return not self.do_sample and all(getattr(p, "is_grammar_mask_slot", False) for p in procs)
        return not self.do_sample and (self.repetition_penalty in (None, 1.0)) and self.min_new_tokens == 0


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_sampling_values(sp: SamplingParams) -> None:
    """Raise ``ValueError("`name` must be <allowed>, got <value>")`` for the first value of ``sp``
    out of range (``SamplingParams`` runs it on construction)."""

    def bad(name: str, allowed: str) -> ValueError:
        return ValueError(f"`{name}` must be {allowed}, got {getattr(sp, name)!r}")

    if not is_int(sp.max_new_tokens) or sp.max_new_tokens < 1:
        raise bad("max_new_tokens", "an int >= 1")
    if not is_int(sp.min_new_tokens) or sp.min_new_tokens < 0:
        raise bad("min_new_tokens", "an int >= 0")
    if not isinstance(sp.do_sample, bool):
        raise bad("do_sample", "True or False")
    if sp.do_sample and (not _is_num(sp.temperature) or not sp.temperature > 0):
        raise bad("temperature", "a number > 0 when do_sample=True")
    if sp.top_k is not None and (not is_int(sp.top_k) or sp.top_k < 0):
        raise bad("top_k", "None or an int >= 0")
    if sp.top_p is not None and (not _is_num(sp.top_p) or not 0 < sp.top_p <= 1):
        raise bad("top_p", "None or a number in (0, 1]")
    if sp.repetition_penalty is not None and (not _is_num(sp.repetition_penalty) or not sp.repetition_penalty > 0):
        raise bad("repetition_penalty", "None or a number > 0")
    if not all(is_int(e) for e in sp.eos_token_ids):
        raise bad("eos_token_ids", "a tuple of ints")
    if sp.seed is not None and (not is_int(sp.seed) or sp.seed < 0):
        raise bad("seed", "None or an int >= 0")
    if not (is_int(sp.prompt_logprobs) or isinstance(sp.prompt_logprobs, bool)) or sp.prompt_logprobs < 0:
        raise bad("prompt_logprobs", "an int >= 0 (or a bool)")
    if sp.score_token_id is not None and (not is_int(sp.score_token_id) or sp.score_token_id < 0):
        raise bad("score_token_id", "None or a token id >= 0")
    if sp.prompt_lookup_num_tokens is not None and (
        not is_int(sp.prompt_lookup_num_tokens) or sp.prompt_lookup_num_tokens < 0
    ):
        raise bad("prompt_lookup_num_tokens", "None or an int >= 0 (0: no drafts)")
    if sp.max_matching_ngram_size is not None and (
        not is_int(sp.max_matching_ngram_size) or sp.max_matching_ngram_size < 1
    ):
        raise bad("max_matching_ngram_size", "None or an int >= 1")


@dataclass
class Request:
    """One generation request, the engine's live record of it. It never crosses into the model
    runner, the sampler or kernels (they get values: ``core.plan.NewRequestData``), and its
    ``status``, ``num_computed_tokens`` and ``output_token_ids`` have one writer: the scheduler's
    ``core.request_state.RequestState``, under the engine's state lock.

    Attributes:
        request_id: unique within its engine.
        prompt_token_ids: the prompt, as token ids.
        output_token_ids: tokens generated so far (kept across preemption).
        num_computed_tokens: tokens whose KV is in the cache (0 after recompute preemption).
        priority: lower value is served first (vLLM convention); ties go by arrival.
        stop_checker: called for each new token before it is appended, with a read-only view of
            the request whose ``output_token_ids`` end with that token
            (``engine.stopping.ProposedRequest``); True finishes it as "stop", the token kept (the
            pipeline uses it for stop strings, since only it has the tokenizer).
        block_hashes: chained hashes of its full blocks of tokens (prefix caching), grown lazily.
        pending_forks: the other sequences of a ``num_return_sequences > 1`` request, not yet
            forked; they are forked off this one once its prompt, minus the last token, has KV.
        parent_id: for a forked sequence, the request it was forked from.
        waiting_for_grammar: True while the grammar of its ``structured_outputs`` compiles (in
            the engine's worker thread): admission passes over it, as vLLM's WAITING_FOR_FSM.
    """

    request_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    stop_checker: Optional[Callable[["Request"], bool]] = None
    max_total_tokens: Optional[int] = None  # the model's context; reaching it finishes with "length"
    # What besides its tokens and adapter decides its blocks' K (a LongRoPE model: whether the prompt
    # selects the long factors, engine.rotary_variants), set by the engine; None: nothing.
    kv_variant: Optional[str] = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    cancel_requested: bool = False
    error: Optional[BaseException] = None
    # Event times on time.monotonic()'s clock, read by engine.stats.RequestMetrics: the first plan
    # that gave it a row (admitted, or forked), its first and latest token, leaving the engine.
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None  # for inter-token latency
    finish_time: Optional[float] = None
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at first admission
    block_hashes: list[int] = field(default_factory=list)
    pending_forks: list["Request"] = field(default_factory=list)
    parent_id: Optional[int] = None
    waiting_for_grammar: bool = False
    # With SamplingParams.prompt_logprobs: entry t is (log-prob, is_argmax) of prompt token t given
    # the tokens before it (None where not requested); entry len(prompt) scores score_token_id.
    prompt_logprobs: Optional[list] = None
    # With SamplingParams.logprobs: per output token, its log-prob under the processed scores, and
    # (logprobs=N) the top N as [(token id, log-prob), ...], best first.
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefill(self) -> bool:
        """True while more than one token lacks KV (prompt, or a recomputed prefix)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def at_fork_point(self) -> bool:
        """True when its forks are due: every prompt token but the last has KV (parallel sampling
        forks here so each sequence samples its own first token from the shared prefix)."""
        return bool(self.pending_forks) and self.num_computed_tokens == self.num_prompt_tokens - 1

    @property
    def prefix_cache_key(self) -> Optional[str]:
        """What besides the tokens decides this request's KV: its LoRA adapter (None for the base
        model) and its ``kv_variant``. Prefix-cache blocks are shared only between requests with the
        same key."""
        if self.kv_variant is None:
            return self.sampling.adapter_name
        return f"{self.sampling.adapter_name}\0{self.kv_variant}"

    @property
    def finish_reason(self) -> Optional[str]:
        return FINISH_REASONS.get(self.status)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0 <= q <= 100) of ``values``, interpolated linearly between the two
    nearest ranks (numpy's default ``method="linear"``); None for no values.

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"`q` must be in [0, 100], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class RequestMetrics:
    """When one request's events happened, and the latencies a user feels from them.

    Times are seconds on ``time.monotonic()``'s clock (compare them with each other, or with
    ``time.monotonic()`` read in the same process), None until the event happened. The names follow
    vLLM's ``RequestOutput.metrics``. For a request that ran its course,
    ``arrival_time <= first_scheduled_time <= first_token_time <= last_token_time <= finished_time``.

    Attributes:
        arrival_time: when it was queued (``LLMEngine.enqueue``, the pipeline's call, ``submit``).
        first_scheduled_time: when a step's plan first gave it a row (its prefill, or its first
            chunk); a request preempted and resumed keeps its first time.
        first_token_time: when its first generated token was ready (after the step's forward and
            sampling).
        last_token_time: when its latest generated token was ready.
        finished_time: when it left the engine (the reap step after its last token, a cancellation
            or a failure) and its handle completed.
        num_generated_tokens: output tokens so far.
    """

    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    last_token_time: Optional[float]
    finished_time: Optional[float]
    num_generated_tokens: int

    @classmethod
    def of(cls, request) -> "RequestMetrics":
        """The metrics of ``request`` (a ``Request``) now."""
        return cls(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            last_token_time=request.last_token_time,
            finished_time=request.finish_time,
            num_generated_tokens=len(request.output_token_ids),
        )

    @property
    def time_in_queue(self) -> Optional[float]:
        """Seconds from arrival to the first plan that scheduled it; None before that."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: seconds from arrival to the first generated token (queueing and
        prefill included); None before it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> Optional[float]:
        """Inter-token latency, the mean seconds per output token after the first (time per output
        token, TPOT): ``(last_token_time - first_token_time) / (num_generated_tokens - 1)``; None
        before a second token. ``ttft + (num_generated_tokens - 1) * itl`` is the time from
        arrival to the last token."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Generated tokens per second of the whole request, arrival to last token (what one
        request's user sees, prefill included); None before the first token."""
        if self.last_token_time is None or self.last_token_time <= self.arrival_time:
            return None
        return self.num_generated_tokens / (self.last_token_time - self.arrival_time)

    @property
    def latency(self) -> Optional[float]:
        """Seconds from arrival to leaving the engine; None while it runs."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class LatencySamples:
    """Per-request TTFT and ITL of a call or a job, for their medians and 90th percentiles.

    Values are kept exactly (float32, 8 bytes per request for both: a million requests take 8 MB),
    so a one-request call reports that request's own figures.
    """

    def __init__(self) -> None:
        self.ttfts = array.array("f")
        self.itls = array.array("f")

    def add(self, metrics: RequestMetrics) -> None:
        """Count one request's ``ttft`` and ``itl`` (each when it has one: a request cut before
        its second token has no ITL)."""
        if metrics.ttft is not None:
            self.ttfts.append(metrics.ttft)
        if metrics.itl is not None:
            self.itls.append(metrics.itl)

    def extend(self, metrics: Iterable[RequestMetrics]) -> None:
        """``add`` each of ``metrics``."""
        for m in metrics:
            self.add(m)

    def summary(self) -> dict:
        """``{"ttft_s": median, "ttft_p90_s": ..., "itl_s": median, "itl_p90_s": ...}`` in seconds
        over the requests counted (None where there is no value)."""
        return {
            "ttft_s": percentile(self.ttfts, 50),
            "ttft_p90_s": percentile(self.ttfts, 90),
            "itl_s": percentile(self.itls, 50),
            "itl_p90_s": percentile(self.itls, 90),
        }


class RequestIdCounter:
    """Per-engine id source (no class-level counters: two engines may live in one process)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def __call__(self) -> int:
        return next(self._counter)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match, in vLLM's terms; set exactly one field.

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it,
            written compactly (one line, ``", "`` and ``": "`` separators).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's GBNF dialect, start rule ``root``) the output matches.
        json_object: True: the output is any JSON object.
        argument: the call argument the value came from, named in error messages
            (``"structured_outputs"``, or ``"response_format"`` for an OpenAI-style value); not part
            of equality.
    """

    json: Any = None
    regex: Optional[str] = None
    choice: Optional[tuple] = None
    grammar: Optional[str] = None
    json_object: bool = False
    argument: str = field(default="structured_outputs", repr=False, compare=False)

    FIELDS = ("json", "regex", "choice", "grammar", "json_object")

    @property
    def kind(self) -> Optional[str]:
        """The one field that is set (its name), or None when none is."""
        set_fields = [name for name in self.FIELDS if getattr(self, name) not in (None, False)]
        return set_fields[0] if len(set_fields) == 1 else None
