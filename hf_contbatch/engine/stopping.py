"""When a request stops: EOS, length and stop strings, in one place.

``length_or_eos_status`` and ``stop_check_status`` are the checks the ``OutputProcessor`` runs on
each proposed token of a step, in order, before anything is appended (the state lock released); ``StopStringCheckers`` builds the
per-request stop-string check that the pipeline and the lm-eval integration pass to
``LLMEngine.build_request`` (transformers' ``StopStringCriteria``, which matches stop strings against the
token strings, so a stop string spanning tokens is found without decoding).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

from ..request import Request, RequestStatus

StopChecker = Callable[[Request], bool]


class ProposedRequest:
    """A read-only view of a request as it would be with its proposed tokens kept: what a stop
    checker (``Request.stop_checker``, user code) is called with while the engine decides, before
    anything is appended. ``output_token_ids`` is a tuple (the proposed token last); every other
    attribute reads the request's."""

    __slots__ = ("_request", "_output")

    def __init__(self, request: Request, output_token_ids: Sequence[int]) -> None:
        self._request = request
        self._output = tuple(output_token_ids)

    def __getattr__(self, name: str):
        return getattr(self._request, name)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The request's output with the proposed tokens up to the one being checked."""
        return self._output

    @property
    def num_tokens(self) -> int:
        return self._request.num_prompt_tokens + len(self._output)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self._request.prompt_token_ids, *self._output]


def length_or_eos_status(req: Request, num_output_tokens: int, token: int) -> Optional[RequestStatus]:
    """The status ``req`` finishes with by EOS or length if ``token`` were its newest output token,
    the ``num_output_tokens``-th, or None to go on: EOS (unless ``ignore_eos``, and not before
    ``min_new_tokens``) -> "stop"; ``max_new_tokens`` reached, or the model's context
    (``max_total_tokens``) full -> "length". Cheap and free of user code."""
    sp = req.sampling
    n = num_output_tokens
    if not sp.ignore_eos and token in sp.eos_token_ids and n >= sp.min_new_tokens:
        return RequestStatus.FINISHED_STOPPED
    if n >= sp.max_new_tokens:
        return RequestStatus.FINISHED_LENGTH
    if req.max_total_tokens is not None and req.num_prompt_tokens + n >= req.max_total_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def has_user_checks(req: Request) -> bool:
    """True when ``req`` has a stop checker or stopping criteria (``stop_check_status`` then needs
    its output ids)."""
    return req.stop_checker is not None or bool(req.sampling.stopping_criteria)


def stop_check_status(
    req: Request, output_token_ids: Sequence[int], grammar_done: bool, sampler
) -> Optional[RequestStatus]:
    """The status ``req`` finishes with by the checks that run user code if its output were
    ``output_token_ids`` (the proposed token last), or None to go on; in order: the request's stop
    checker (stop strings; called with a ``ProposedRequest``), the grammar's end (``grammar_done``),
    the call's ``stopping_criteria`` on the request's ids (``sampler.should_stop``). Each finishes
    with "stop". Raises whatever a check raises."""
    if req.stop_checker is not None and req.stop_checker(ProposedRequest(req, output_token_ids)):
        return RequestStatus.FINISHED_STOPPED
    if grammar_done:
        return RequestStatus.FINISHED_STOPPED
    if req.sampling.stopping_criteria and sampler.should_stop(
        req.request_id, [*req.prompt_token_ids, *output_token_ids]
    ):
        return RequestStatus.FINISHED_STOPPED
    return None


class StopStringCheckers:
    """Stop-string checks for one tokenizer, their ``StopStringCriteria`` cached by stop strings
    (building one preprocesses the whole vocabulary).

    Args:
        tokenizer: the tokenizer whose tokens the engine generates.
        max_cached: most stop-string sets kept (least recently built dropped first).
    """

    def __init__(self, tokenizer, max_cached: int = 32) -> None:
        self.tokenizer = tokenizer
        self.max_cached = max_cached
        self._criteria: "OrderedDict[tuple, object]" = OrderedDict()
        self._lock = threading.Lock()

    def checker(self, stop_strings: "str | Sequence[str] | None", over_prompt: bool = True) -> Optional[StopChecker]:
        """A check for ``LLMEngine.submit``/``build_request(stop_checker=...)``: True once the request's tokens
        end with one of ``stop_strings``, checked after each new token; None when there are none. With
        ``over_prompt`` (transformers' ``generate``: its ``StopStringCriteria`` reads the whole sequence) a
        stop string may begin in the prompt and end in the first new tokens; without it (lm-eval's ``hf``
        backend) only the new tokens are matched.

        Raises:
            ValueError: ``stop_strings`` is not a non-empty string or a list of them.
        """
        if not stop_strings:
            return None
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if not (isinstance(stop_strings, (list, tuple)) and all(isinstance(s, str) and s for s in stop_strings)):
            raise ValueError(f"`stop_strings` must be a non-empty string or a list of them, got {stop_strings!r}")
        key = tuple(stop_strings)
        with self._lock:
            criteria = self._criteria.get(key)
            if criteria is None:
                from transformers.generation.stopping_criteria import StopStringCriteria

                criteria = StopStringCriteria(tokenizer=self.tokenizer, stop_strings=list(stop_strings))
                self._criteria[key] = criteria
                if len(self._criteria) > self.max_cached:
                    self._criteria.popitem(last=False)
        # A stop string spans at most its length in tokens; the margin covers tokens that decode to
        # nothing (StopStringCriteria looks back over the given ids only).
        tail = max(len(s) for s in stop_strings) + 8

        def check(req: Request) -> bool:
            out = req.output_token_ids[-tail:]
            # generate's StopStringCriteria reads the whole sequence: a stop string may start in the prompt.
            lead = req.prompt_token_ids[-(tail - len(out)) :] if over_prompt and len(out) < tail else []
            ids = torch.tensor([[*lead, *out]])
            return bool(criteria(ids, None)[0])

        return check
