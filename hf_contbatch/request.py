"""Request state, the single source of truth the scheduler reasons about.

Following vLLM v1, a request is its token ids plus ``num_computed_tokens`` (how many of them have KV
in the cache). Prefill, chunked prefill, prefix-cache hits and resumption after preemption are all
"schedule ``num_tokens - num_computed_tokens`` more tokens"; no special cases.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


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
            builds it (``generation.build_logits_processor``); it replaces the processors built
            from the fields above. None: built from the fields above.
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

    @property
    def can_draft(self) -> bool:
        """True when prompt-lookup drafts are on and can be verified exactly by comparing them with
        the argmax of each row: greedy with no processor, no per-token scores, no stopping criteria
        (sampled requests and processors that read the history skip drafting)."""
        return (
            bool(self.prompt_lookup_num_tokens)
            and self.is_greedy_plain
            and self.logprobs is None
            and not self.prompt_logprobs
            and self.score_token_id is None
            and not self.stopping_criteria
        )

    @property
    def is_greedy_plain(self) -> bool:
        """True when the next token is a plain argmax (no processor changes the ranking)."""
        if self.logits_processor is not None:
            return not self.do_sample and len(self.logits_processor) == 0
        return not self.do_sample and (self.repetition_penalty in (None, 1.0)) and self.min_new_tokens == 0


@dataclass
class Request:
    """One generation request.

    Attributes:
        request_id: unique within its engine.
        prompt_token_ids: the prompt, as token ids.
        output_token_ids: tokens generated so far (kept across preemption).
        num_computed_tokens: tokens whose KV is in the cache (0 after recompute preemption).
        priority: lower value is served first (vLLM convention); ties go by arrival.
        stop_checker: called with the request after each new token; True finishes it as "stop"
            (the pipeline uses it for stop strings, since only it has the tokenizer).
        block_hashes: chained hashes of its full blocks of tokens (prefix caching), grown lazily.
        pending_forks: the other sequences of a ``num_return_sequences > 1`` request, not yet
            forked; they are forked off this one once its prompt, minus the last token, has KV.
        parent_id: for a forked sequence, the request it was forked from.
    """

    request_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    stop_checker: Optional[Callable[["Request"], bool]] = None
    max_total_tokens: Optional[int] = None  # the model's context; reaching it finishes with "length"

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    cancel_requested: bool = False
    error: Optional[BaseException] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None  # for inter-token latency
    finish_time: Optional[float] = None
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at first admission
    block_hashes: list[int] = field(default_factory=list)
    pending_forks: list["Request"] = field(default_factory=list)
    parent_id: Optional[int] = None
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
        model). Prefix-cache blocks are shared only between requests with the same key."""
        return self.sampling.adapter_name

    @property
    def finish_reason(self) -> Optional[str]:
        return FINISH_REASONS.get(self.status)


class RequestIdCounter:
    """Per-engine id source (no class-level counters: two engines may live in one process)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def __call__(self) -> int:
        return next(self._counter)
