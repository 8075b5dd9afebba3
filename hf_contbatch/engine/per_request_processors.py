"""Per-request processors, kept engine-side by request id: ``RequestProcessors`` holds each request's
``LogitsProcessorList`` and stopping criteria (the sampler looks them up by id; no ``Request``
reaches it). A call's ``logits_processor`` given as a factory is called once per request and per
fork, so stateful processors (a grammar library's processor keeps one matcher per batch row and can
be used once) get their own instances instead of seeing every request's rows interleaved."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..request import Request, SamplingParams
from .structured import GrammarMaskSlot, spec_of


def build_logits_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """The processors ``generate`` would build for the plain fields of ``params`` (engine callers
    that pass no ``logits_processor``)."""
    procs = LogitsProcessorList()
    if params.repetition_penalty not in (None, 1.0):
        procs.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.min_new_tokens > 0 and params.eos_token_ids:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens, list(params.eos_token_ids)))
    if spec_of(params) is not None:
        procs.append(GrammarMaskSlot())  # where generate runs a custom processor: before the warpers
    if params.do_sample:
        if params.temperature is not None and params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k is not None and params.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
        if params.top_p is not None and params.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return procs


class RequestProcessors:
    """The logits processors and stopping criteria of one engine's requests, by request id, from
    ``track`` (the engine takes the request in) to ``forget`` (it left). A request's list is built
    when it first samples: its ``SamplingParams.logits_processor`` (a factory is called then, once
    per request and fork), or the processors ``generate`` would build from its plain fields."""

    def __init__(self) -> None:
        self._params: dict[int, tuple[SamplingParams, int]] = {}
        self._lists: dict[int, LogitsProcessorList] = {}

    @property
    def num_tracked(self) -> int:
        """Requests whose settings are held here (0 once every request ended)."""
        return len(self._params)

    def track(self, request: Request) -> None:
        """Keep the settings of ``request`` and of its pending forks."""
        for r in (request, *request.pending_forks):
            self._params[r.request_id] = (r.sampling, r.num_prompt_tokens)

    def processors(self, request_id: int) -> LogitsProcessorList:
        """The request's processor list (built on the first call).

        Raises:
            KeyError: ``request_id`` is not tracked.
            ValueError: its factory did not return a list of callables.
        """
        procs = self._lists.get(request_id)
        if procs is None:
            params, prompt_len = self._params[request_id]
            procs = params.logits_processor
            if procs is None:
                procs = build_logits_processors(params, prompt_len)
            elif not isinstance(procs, (list, tuple)):
                procs = procs()  # a factory: this request's (or fork's) own processors
            self._lists[request_id] = procs
        return procs

    def stopping_criteria(self, request_id: int) -> Optional[Any]:
        """The request's ``StoppingCriteriaList``, or None (none, or an untracked id)."""
        entry = self._params.get(request_id)
        return entry[0].stopping_criteria if entry is not None else None

    def forget(self, request_id: int) -> None:
        """Drop what is kept for ``request_id`` (it left the engine); unknown ids are ignored."""
        self._params.pop(request_id, None)
        self._lists.pop(request_id, None)


class PerRequestProcessors:
    """A request's processor list built anew for each request and fork: the call's
    ``logits_processor`` factory is called, and transformers merges its fresh processors into the
    list ``generate`` builds for the prompt. The sampler calls this once per request id, when the
    request (or fork) first samples, so stateful processors (one matcher per batch row, "use once")
    never see another request's rows.

    Args:
        factory: a zero-argument callable returning a ``LogitsProcessorList``.
        build: ``custom processors -> the request's full list`` (``build_logits_processor`` bound
            to the prompt and its settings).
        extra: processors appended after the factory's (the grammar mask's place).
    """

    def __init__(self, factory: Callable[[], Sequence], build: Callable, extra: Sequence = ()) -> None:
        self.factory = factory
        self.build = build
        self.extra = list(extra)

    def __call__(self) -> LogitsProcessorList:
        """The request's processors.

        Raises:
            ValueError: the factory did not return a list of callables.
        """
        custom = self.factory()
        if not (isinstance(custom, (list, tuple)) and all(callable(p) for p in custom)):
            raise ValueError(
                f"the `logits_processor` factory must return a LogitsProcessorList (a list of callables), got {custom!r}"
            )
        return self.build(LogitsProcessorList(list(custom) + self.extra))


def is_processor_factory(logits_processor) -> bool:
    """True for a zero-argument callable that is not itself a list of processors."""
    if isinstance(logits_processor, (list, tuple)) or not callable(logits_processor):
        return False
    try:
        params = inspect.signature(logits_processor).parameters.values()
    except (TypeError, ValueError):
        return True  # a builtin: trust it
    return not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
