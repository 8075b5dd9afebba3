"""Request handles: what ``LLMEngine.submit`` returns, to wait for, stream or cancel one request.

A handle reaches its engine through ``HandleOwner`` (the engine's ``EngineDriver``: cancel, drive, cancel now); the engine feeds
it through ``push_tokens`` and ``finish``, and keeps its handles in a ``HandleRegistry``. Neither
imports the other's module.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Sequence

from ..request import Request, RequestMetrics

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """Raised from ``RequestHandle.result()`` when the engine failed the request.

    Attributes:
        output: the request's ``RequestOutput`` with the tokens it generated before failing
            (``finish_reason="error"``); the cause is ``__cause__``.
    """

    def __init__(self, message: str, output: Optional["RequestOutput"] = None) -> None:
        super().__init__(message)
        self.output = output


@dataclass
class RequestOutput:
    """The final state of one request.

    Attributes:
        request_id: engine-local id.
        prompt_token_ids: the prompt.
        output_token_ids: generated tokens (partial if cancelled).
        finish_reason: "stop", "length", "cancelled" or "error".
        num_preemptions: times it was preempted.
        ttft: seconds from arrival to first token (None if it produced none); ``metrics.ttft``.
        latency: seconds from arrival to finish (None while it runs); ``metrics.latency``.
        logprobs: with ``SamplingParams.logprobs``, the log-prob of each output token under the
            processed scores (``generate(output_scores=True)``'s scores, log-softmaxed); else None.
        top_logprobs: with ``logprobs=N >= 1``, per output token the top N ``(token id, log-prob)``.
        metrics: a ``RequestMetrics``: arrival, first scheduled, first and last token and finish
            times, and from them ``ttft``, ``itl`` (seconds per output token after the first),
            ``tokens_per_s`` and ``time_in_queue``.
    """

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: Optional[str]
    num_preemptions: int
    ttft: Optional[float]
    latency: Optional[float]
    logprobs: Optional[list] = None
    top_logprobs: Optional[list] = None
    metrics: Optional[RequestMetrics] = None


class HandleOwner(Protocol):
    """What a ``RequestHandle`` needs of the engine that queued its request (its ``EngineDriver``)."""

    @property
    def blocking_calls_drive(self) -> bool:
        """Whether a blocking wait should run the engine's iterations in its own thread."""
        ...

    def in_iteration(self) -> bool:
        """True when called from inside an iteration."""
        ...

    def drive(self, until: Callable[[], bool]) -> None:
        """Run iterations in the calling thread until ``until()`` is true."""
        ...

    def cancel(self, request_id: int) -> None:
        """Ask for the request to stop at the next reap step."""
        ...

    def cancel_now(self, handles: Sequence["RequestHandle"]) -> None:
        """Cancel these requests and release them before returning."""
        ...


class RequestHandle:
    """A submitted request: wait for it, stream its tokens, or cancel it.

    Args:
        owner: the engine that queued ``request``.
        request: the request (the engine changes it; read it, do not change it).
    """

    def __init__(self, owner: HandleOwner, request: Request) -> None:
        self._owner = owner
        self.request = request
        self._done = threading.Event()
        self._stream: "queue.SimpleQueue[Optional[list[int]]]" = queue.SimpleQueue()
        self._callbacks: list[Callable[["RequestHandle"], None]] = []
        self._lock = threading.Lock()

    @property
    def request_id(self) -> int:
        """The engine-local id of the request."""
        return self.request.request_id

    def done(self) -> bool:
        """True once the request finished (any reason: stop, length, cancelled, error); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the request finished or ``timeout`` seconds passed (None: no limit).

        Returns True if it finished. Waits on the background thread (never drives the engine);
        raises nothing, an engine error surfaces from ``result()``.
        """
        return self._done.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> RequestOutput:
        """Block until finished; return the output. Meanwhile this thread runs the engine's
        iterations (``EngineDriver.drive``; with ``timeout`` too, up to the deadline) unless
        ``EngineConfig.drive_in_caller`` is off or a live view runs.

        Raises:
            EngineError: the engine failed the request (``.output`` holds its partial tokens).
            TimeoutError: not finished after ``timeout`` seconds (the request keeps running).
            KeyboardInterrupt: interrupted while waiting; the request is cancelled first (its
                output then has ``finish_reason="cancelled"``), other requests keep running.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # timeout=0 polls; inside an iteration (a done-callback) a timed wait stays a wait.
            if (
                not self._done.is_set()
                and self._owner.blocking_calls_drive
                and timeout != 0
                and (timeout is None or not self._owner.in_iteration())
            ):
                # Drive in this thread (one OpenMP team, see EngineDriver.drive) until done or the
                # deadline; the iteration running at the deadline finishes first.
                self._owner.drive(
                    lambda: self._done.is_set() or (deadline is not None and time.monotonic() >= deadline)
                )
            finished = self._done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            self._owner.cancel_now([self])
            raise
        if not finished:
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self.request.error is not None:
            raise EngineError(
                f"request {self.request_id} failed in the engine after {len(self.request.output_token_ids)} "
                f"generated tokens: {self.request.error!r}",
                self.output(),
            ) from self.request.error
        return self.output()

    def output(self) -> RequestOutput:
        """The request's state now, without waiting or raising: the tokens so far and
        ``finish_reason`` (None while it runs; "error" when the engine failed it)."""
        r = self.request
        metrics = RequestMetrics.of(r)
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=list(r.prompt_token_ids),
            output_token_ids=list(r.output_token_ids),
            finish_reason=r.finish_reason,
            num_preemptions=r.num_preemptions,
            ttft=metrics.ttft,
            latency=metrics.latency,
            logprobs=list(r.output_logprobs) if r.sampling.logprobs is not None else None,
            top_logprobs=list(r.output_top_logprobs) if r.sampling.logprobs else None,
            metrics=metrics,
        )

    def cancel(self) -> None:
        """Ask the engine to stop this request; it is freed at the next reap step (its tokens so far
        are kept, ``finish_reason`` becomes "cancelled"). A finished request is left as it is;
        never raises."""
        self._owner.cancel(self.request_id)

    def add_done_callback(self, fn: Callable[["RequestHandle"], None]) -> None:
        """Call ``fn(handle)`` when finished (from the engine thread; keep it short)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def token_stream(self) -> Iterator[list[int]]:
        """Yields lists of new token ids as the engine produces them, until the request finishes."""
        while True:
            item = self._stream.get()
            if item is None:
                return
            yield item

    # --- engine side: called by the engine that owns the request --------------------------------
    def push_tokens(self, tokens: Sequence[int]) -> None:
        """Hand new token ids to ``token_stream()`` readers (the engine, after each new token)."""
        self._stream.put(list(tokens))

    def finish(self) -> None:
        """Mark the request done: end the token stream, wake waiters, run the done-callbacks (the
        engine, once the request left it: finished, cancelled or failed). A callback that raises is
        logged, never propagated."""
        with self._lock:
            self._stream.put(None)
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a user callback must not take the engine down
                logger.exception("done-callback of request %s raised", self.request_id)


class HandleRegistry:
    """The handles of one engine's requests, by request id, from queueing until they finish.

    Args:
        owner: the engine whose requests these are.
    """

    def __init__(self, owner: HandleOwner) -> None:
        self._owner = owner
        self._handles: dict[int, RequestHandle] = {}

    def open(self, requests: Sequence[Request]) -> list[list[RequestHandle]]:
        """New handles for ``requests``: per request, its own handle, then its pending forks'."""
        handles = [[RequestHandle(self._owner, r) for r in (req, *req.pending_forks)] for req in requests]
        for h in (h for hs in handles for h in hs):
            self._handles[h.request_id] = h
        return handles

    def discard(self, handles: Sequence[Sequence[RequestHandle]]) -> None:
        """Forget handles whose requests were never queued."""
        for h in (h for hs in handles for h in hs):
            self._handles.pop(h.request_id, None)

    def request_cancel(self, request_id: int) -> None:
        """Mark an unfinished request for cancellation (the next reap frees it); unknown or finished
        ids are ignored."""
        handle = self._handles.get(request_id)
        if handle is not None and not handle.request.status.is_finished:
            handle.request.cancel_requested = True

    def push(self, request_id: int, token: int) -> None:
        """Stream ``token``, just appended to request ``request_id``, to its handle."""
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.push_tokens([token])

    def finish(self, request: Request) -> None:
        """Finish the handle of ``request`` (it left the engine) and forget it."""
        handle = self._handles.pop(request.request_id, None)
        if handle is not None:
            handle.finish()
