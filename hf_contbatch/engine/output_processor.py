"""What happens to a step's new tokens once the scheduler appended them: streaming to the handles,
the grammar's advance, the stop checks, and finishing handles of requests that left the engine.

The engine runs it in two parts. Under its state lock the scheduler appends the sampled tokens
(and accepted drafts) and calls ``OutputProcessor.on_token`` after each: it only records where the
request's new tokens start and runs the cheap EOS/length check (``stopping.length_or_eos_status``),
which decides how many accepted drafts the scheduler keeps. After the lock is released
``OutputProcessor.process`` walks each request's new tokens in order, as they were appended: it
streams each, advances the grammar and runs the stop checks that call user code (stop strings,
the grammar's end, ``stopping_criteria``). A stop at the k-th of several accepted tokens keeps the
first k, so the output is the one the checks would give token by token; the KV of the accepted
drafts dropped after it is reported back (``ProcessedOutput.excess_computed``) for the engine to
uncount under the lock. A stop checker, a streamer or a grammar that raises fails its request alone
(``fail_in_step``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

from ..request import Request, RequestStatus
from .handles import HandleRegistry
from .sampler import Sampler
from .stopping import length_or_eos_status, stop_check_status
from .structured import GrammarMatchers

logger = logging.getLogger(__name__)


def fail_in_step(req: Request, exc: Exception) -> None:
    """Fail one request during a step: it keeps its tokens, the next reap frees its blocks and
    finishes its handle (its pending forks with it); the other requests are untouched."""
    logger.error("request %s failed after %d generated tokens: %r", req.request_id, len(req.output_token_ids), exc)
    req.error = exc
    req.status = RequestStatus.FINISHED_ERROR
    for child in req.pending_forks:
        child.error = exc


@dataclass
class ProcessedOutput:
    """What ``OutputProcessor.process`` did with a step's new tokens.

    Attributes:
        kept: ``(request, number of its new tokens kept)`` per request that got tokens, in the
            order they were appended (the engine counts them: TTFT, ITL, generated tokens).
        excess_computed: ``(request, tokens)`` for requests that stopped before the last of several
            accepted drafts: KV positions counted in ``num_computed_tokens`` past the tokens kept.
    """

    kept: list[tuple[Request, int]] = field(default_factory=list)
    excess_computed: list[tuple[Request, int]] = field(default_factory=list)


class OutputProcessor:
    """Streams, stop-checks and grammar-advances one engine's new tokens, and finishes handles.

    Args:
        handles: the handles the engine's requests stream to.
        grammars: the matchers of requests with structured outputs.
        sampler: the engine's sampler (``stopping_criteria`` and per-request sampling state).
    """

    def __init__(self, handles: HandleRegistry, grammars: GrammarMatchers, sampler: Sampler) -> None:
        self.handles = handles
        self.grammars = grammars
        self.sampler = sampler
        self._new: dict[int, tuple[Request, int]] = {}  # request id -> (request, index of its first new token)

    def on_token(self, req: Request) -> bool:
        """The scheduler's ``on_token`` hook, called under the engine's state lock after each token
        appended to ``req``: record it, and finish ``req`` on EOS or length. True when finished
        (the scheduler then appends no further token of this step)."""
        self._new.setdefault(req.request_id, (req, len(req.output_token_ids) - 1))
        status = length_or_eos_status(req)
        if status is not None:
            req.status = status
        return status is not None

    def process(self) -> ProcessedOutput:
        """Stream, advance the grammar and stop-check the tokens recorded by ``on_token`` since the
        last call, request by request, token by token (call with the state lock released)."""
        new, self._new = self._new, {}
        out = ProcessedOutput()
        for req, start in new.values():
            kept = self._process_request(req, start)
            out.kept.append((req, kept))
            excess = req.num_computed_tokens - req.num_tokens
            if excess > 0:  # stopped inside accepted drafts: their KV is no longer the request's
                out.excess_computed.append((req, excess))
        return out

    def _process_request(self, req: Request, start: int) -> int:
        """Replay ``req``'s tokens from ``start`` one at a time; returns how many it keeps."""
        appended = req.output_token_ids[start:]
        # Set by on_token at the last appended token (the scheduler appended none after it).
        cheap = req.status if req.status.is_finished else None
        del req.output_token_ids[start:]  # each check sees the tokens up to its own, as generate does
        for k, token in enumerate(appended):
            req.output_token_ids.append(token)
            last = k == len(appended) - 1
            try:
                self.handles.push_token(req)
                grammar_done = self.grammars.accept(req)
                status = cheap if last and cheap is not None else stop_check_status(req, grammar_done, self.sampler)
            except Exception as exc:  # noqa: BLE001 - a stop checker, stream or grammar of one request
                fail_in_step(req, exc)
                return k + 1
            if status is not None:
                req.status = status
                return k + 1
        return len(appended)

    def complete(self, requests: Iterable[Request]) -> None:
        """Finish the handles of requests that left the engine (reaped, cancelled or failed) and drop
        what the sampler and the grammars kept for them."""
        now = time.monotonic()
        for req in requests:
            req.finish_time = now
            self.sampler.forget(req.request_id)
            self.grammars.forget(req.request_id)
            self.handles.finish(req)
