"""What happens to a step's tokens: the stop decisions before they are appended, streaming after,
and finishing handles of requests that left the engine.

The engine runs it around ``Scheduler.update_from_output``, the one place tokens are appended:

1. ``decide`` (the state lock released: it runs user code) walks each request's proposed tokens of
   the step (``Scheduler.proposed_tokens``: the sampled token, or the accepted drafts and the greedy
   token after them) in order, and stops at the first stop: EOS or length
   (``stopping.length_or_eos_status``), the request's stop checker (stop strings, which may span
   tokens: it sees the output up to and including the proposed token), the grammar's end (the
   matcher advances on each token checked, so on kept tokens only), ``stopping_criteria``. A stop
   at the k-th token keeps the first k, as the checks would give token by token; a check, a
   grammar or a stop checker that raises fails its request alone (``StopDecision.error``).
2. The scheduler applies the decisions under the lock: it appends the kept tokens once and sets the
   status.
3. ``stream`` hands each kept token to the request's handle: every kept token, nothing past a stop.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Mapping, Optional, Sequence

from ..core.plan import StopDecision
from ..request import Request, RequestStatus
from .handles import HandleRegistry
from .per_request_processors import RequestProcessors
from .sampler import Sampler
from .stopping import has_user_checks, length_or_eos_status, stop_check_status
from .structured import GrammarMatchers

logger = logging.getLogger(__name__)


def log_failure(req: Request, exc: BaseException, num_generated: Optional[int] = None) -> None:
    """Log that ``req`` fails in a step (the scheduler then fails it alone: ``Scheduler.fail``) after
    ``num_generated`` generated tokens (None: its output's length now), the count its handle's
    ``EngineError`` will give."""
    if num_generated is None:
        num_generated = len(req.output_token_ids)
    logger.error("request %s failed after %d generated tokens: %r", req.request_id, num_generated, exc)


class OutputProcessor:
    """Decides the stops on one engine's proposed tokens, streams the kept ones, finishes handles.

    Args:
        handles: the handles the engine's requests stream to.
        grammars: the matchers of requests with structured outputs.
        sampler: the engine's sampler (``stopping_criteria`` read its processed scores).
        processors: the engine's per-request processors (forgotten with the request).
    """

    def __init__(
        self, handles: HandleRegistry, grammars: GrammarMatchers, sampler: Sampler, processors: RequestProcessors
    ) -> None:
        self.handles = handles
        self.grammars = grammars
        self.sampler = sampler
        self.processors = processors

    def decide(self, proposed: Mapping[int, Sequence[int]], requests: Mapping[int, Request]) -> dict[int, StopDecision]:
        """``{request id: StopDecision}`` for each request's ``proposed`` tokens (``requests``: the
        request of each id). Runs user code: call with the state lock released. Never raises: a
        failing check fails its request (``StopDecision.error``)."""
        return {rid: self._decide(requests[rid], tokens) for rid, tokens in proposed.items()}

    def _decide(self, req: Request, tokens: Sequence[int]) -> StopDecision:
        base = len(req.output_token_ids)
        # The output ids with the proposed tokens, built only for checks that read them (copying a
        # long output for every token of every request would cost more than the checks).
        output = list(req.output_token_ids) if has_user_checks(req) or self.grammars.tracks(req.request_id) else None
        for k, token in enumerate(tokens):
            try:
                status = length_or_eos_status(req, base + k + 1, token)
                if output is not None:
                    output.append(token)
                    grammar_done = self.grammars.accept(req.request_id, output)
                    status = status or stop_check_status(req, output, grammar_done, self.sampler)
            except Exception as exc:  # noqa: BLE001 - a stop checker or grammar of one request
                # The decision keeps the token the check failed on (appended after this), so the
                # log counts it as the handle's error will.
                log_failure(req, exc, base + k + 1)
                return StopDecision(k + 1, RequestStatus.FINISHED_ERROR, exc)
            if status is not None:
                return StopDecision(k + 1, status)
        return StopDecision(len(tokens))

    def stream(self, appended: Iterable[tuple[Request, Sequence[int]]]) -> None:
        """Hand each appended token to its request's handle, one push per token, in order."""
        for req, tokens in appended:
            for token in tokens:
                self.handles.push(req.request_id, token)

    def complete(self, requests: Iterable[Request]) -> None:
        """Finish the handles of requests that left the engine (reaped, cancelled or failed) and drop
        what the sampler, the processors and the grammars kept for them."""
        now = time.monotonic()
        for req in requests:
            req.finish_time = now
            self.sampler.forget(req.request_id)
            self.processors.forget(req.request_id)
            self.grammars.forget(req.request_id)
            self.handles.finish(req)
