"""Who runs the engine's iterations: a background thread, or a blocking caller's own thread.

``EngineDriver`` holds the inbox (requests and cancellations queued by any thread), the worker
thread that runs while there is work and nobody drives, and ``drive`` that lends a blocking
caller's thread to the engine. It reaches the engine only through ``DrivenEngine``; whoever runs
it, an iteration is the engine's ``step``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, Union

import torch

from ..request import Request
from .reliability import DeferredInterrupt

logger = logging.getLogger("hf_contbatch.engine")


@dataclass(frozen=True)
class Cancel:
    """An inbox item: stop request ``request_id`` at the next reap step."""

    request_id: int


InboxItem = Union[Request, Cancel]  # a new request (its pending forks with it), or a cancellation


class DrivenEngine(Protocol):
    """What the driver needs of the engine it runs (``LLMEngine`` provides it)."""

    def has_requests(self) -> bool:
        """True while the scheduler holds requests (waiting, running or swapped)."""
        ...

    def take_inbox(self, items: Sequence[InboxItem]) -> None:
        """Hand new requests and cancellations to the scheduler, in arrival order."""
        ...

    def step(self) -> object:
        """One iteration: reap, budget, admit, preempt, decode."""
        ...

    def release_finished(self) -> None:
        """Free finished and cancelled requests now and finish their handles (a reap)."""
        ...

    def fail_all(self, exc: BaseException) -> None:
        """Fail every request the scheduler holds with ``exc``; the engine then serves new ones."""
        ...


class EngineDriver:
    """Runs an engine's iterations: on a background thread while nobody else does, or in a blocking
    caller's thread (``drive``).

    Args:
        engine: the engine whose iterations this runs.
        drive_in_caller: whether blocking calls run iterations in their own thread
            (``EngineConfig.drive_in_caller``).
        num_threads: torch threads of the background thread (``EngineConfig.num_threads``); None
            leaves torch's setting.
    """

    def __init__(self, engine: DrivenEngine, *, drive_in_caller: bool, num_threads: Optional[int] = None) -> None:
        self._engine = engine
        self._drive_in_caller = drive_in_caller
        self._num_threads = num_threads
        self._inbox: list[InboxItem] = []  # in arrival order
        self._cv = threading.Condition()
        self._drive_lock = threading.Lock()  # held for one iteration by whichever thread drives
        self._num_drivers = 0  # blocking callers currently driving (the background thread leaves)
        self._iterating_thread: Optional[int] = None  # id of the thread inside an iteration
        self._live_views: "weakref.WeakSet" = weakref.WeakSet()  # see add_live_view
        self._idle = threading.Event()
        self._idle.set()
        self._stopped = False
        # The background thread runs only while there is work and no blocking caller drives; it
        # exits when idle. Why: each thread that runs torch ops keeps an OpenMP team, and with two
        # teams alive libgomp stops spin-waiting, which slows every op on a small CPU.
        self.thread = threading.Thread(target=lambda: None, name="hf_contbatch-engine")
        self._worker_alive = False

    # --- queueing (any thread) -------------------------------------------------------------------
    def add(self, requests: Sequence[Request]) -> None:
        """Queue new requests for the next iteration, all at once, and make sure a thread runs it.
        They arrive now: their ``arrival_time`` (and their pending forks') is set here.

        Raises:
            RuntimeError: the driver was stopped (the engine is closed); nothing is queued then.
        """
        if not requests:
            return  # nothing arrives: the engine stays idle
        with self._cv:
            if self._stopped:
                raise RuntimeError("the engine is closed")
            now = time.monotonic()
            for r in (r for req in requests for r in (req, *req.pending_forks)):
                r.arrival_time = now
            self._inbox.extend(requests)
            self._idle.clear()
            self._start_worker_locked()

    def cancel(self, request_id: int) -> None:
        """Queue a cancellation of ``request_id`` for the next iteration; never raises."""
        with self._cv:
            self._inbox.append(Cancel(request_id))
            self._start_worker_locked()

    def has_work(self) -> bool:
        """True while requests are queued in the inbox or held by the scheduler."""
        with self._cv:
            return self._has_work_locked()

    def _has_work_locked(self) -> bool:
        return bool(self._inbox or self._engine.has_requests())

    # --- who drives --------------------------------------------------------------------------------
    def add_live_view(self, view) -> None:
        """Register a live view (anything with a ``running`` property, held weakly).

        While one is running, blocking callers leave the iterations to the background thread: a
        caller that drives keeps torch's OpenMP workers spin-waiting on every core, which starves
        the kernel's I/O and the browser that render the view.
        """
        self._live_views.add(view)

    def live_views(self) -> list:
        """The registered live views still alive (see ``add_live_view``)."""
        return list(self._live_views)

    @property
    def blocking_calls_drive(self) -> bool:
        """Whether blocking calls run iterations in their own thread (``drive_in_caller``, not
        stopped, and no live view running)."""
        if not self._drive_in_caller or self._stopped:
            return False
        return not any(view.running for view in list(self._live_views))

    def in_iteration(self) -> bool:
        """True when called from inside an iteration (e.g. from a request's done-callback)."""
        return self._iterating_thread == threading.get_ident()

    def check_in_iteration(self, what: str) -> None:
        """Raise ``RuntimeError`` naming ``what`` unless the calling thread is running this engine's
        iteration (``drive`` or the background thread)."""
        if not self.in_iteration():
            raise RuntimeError(
                f"{what} runs inside the engine's driver only (another thread may be iterating): "
                "to iterate in this thread, call LLMEngine.driver.drive(until)"
            )

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until no request is queued or running, or ``timeout`` seconds passed (None: no
        limit). Returns True if idle. Waits on the background thread; never drives."""
        return self._idle.wait(timeout)

    def drive(self, until: Callable[[], bool], after_iteration: Optional[Callable[[], None]] = None) -> None:
        """Run iterations in the calling thread until ``until()`` is true.

        Blocking callers (``ContinuousBatchingPipeline.__call__``, ``RequestHandle.result``, the
        lm-eval integration; see ``hf_contbatch.frontends.progress.wait_for``) lend their thread to the
        engine instead of sleeping: the background thread leaves meanwhile, so one thread runs
        torch. Why: with a second thread's OpenMP team alive, libgomp stops spin-waiting and every
        op of a step runs slower on a small CPU. ``submit()`` + streaming keep working through the
        background thread, which resumes when the caller leaves. Iterations are the same five steps
        whoever runs them.

        Args:
            until: checked before each iteration; driving stops once it returns True (or when
                nothing is left to run).
            after_iteration: called after each iteration in this thread (progress bars).

        A KeyboardInterrupt (SIGINT: Ctrl-C, a notebook's Stop button) that arrives meanwhile is
        held until the current iteration is over, then raised here; the requests in flight are
        untouched (the caller cancels its own, see ``cancel_now``).

        Raises:
            RuntimeError: called from inside an iteration (e.g. a done-callback), which would nest;
                or the engine was closed meanwhile.
            KeyboardInterrupt: an interrupt arrived; the engine's state is whole.
        """
        if self._iterating_thread == threading.get_ident():
            raise RuntimeError("drive()/result() called from inside an engine iteration (a callback)")
        with self._cv:
            self._num_drivers += 1  # a running background thread leaves after its current iteration
        interrupt = DeferredInterrupt()
        try:
            with interrupt:
                while not until() and not interrupt.pending:
                    if self._stopped:
                        raise RuntimeError("the engine is closed")
                    if not self.has_work():
                        break  # nothing left that could satisfy ``until``
                    self._iterate()
                    if after_iteration is not None:
                        after_iteration()
        finally:
            with self._cv:
                self._num_drivers -= 1
                self._start_worker_locked()  # work left by others (submit()) continues in the background
        interrupt.replay()

    def cancel_now(self, handles) -> None:
        """Cancel these requests (``RequestHandle``s) and release them before returning: their
        handles are done with ``finish_reason="cancelled"`` and their partial tokens, their blocks
        are free. For a blocking call that was interrupted; other requests keep running. Waits for
        an iteration in progress in another thread to end."""
        for h in handles:
            self.cancel(h.request_id)
        if self._stopped or self._iterating_thread == threading.get_ident():
            return  # closing fails them anyway; inside an iteration the next reap releases them
        interrupt = DeferredInterrupt()  # a second Stop press must not leave them half released
        with interrupt:
            with self._drive_lock:
                self._take_inbox()
                self._engine.release_finished()
                self._set_idle_if_done()
        interrupt.replay()

    def stop(self) -> list[InboxItem]:
        """Stop the background thread and wait for it; return what the inbox still held (``close``).
        Afterwards ``add`` raises and blocking calls no longer drive."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self.thread.ident is not None:  # the placeholder before any work was never started
            self.thread.join(timeout=60)
        with self._cv:
            left, self._inbox = self._inbox, []
        return left

    # --- the background thread ---------------------------------------------------------------------
    def _start_worker_locked(self) -> None:
        """Start the background thread if there is work, nobody drives, and none runs (cv held)."""
        if self._worker_alive or self._stopped or self._num_drivers:
            return
        if not self._has_work_locked():
            return
        self._worker_alive = True
        self.thread = threading.Thread(target=self._loop, name="hf_contbatch-engine", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        while True:
            with self._cv:
                # Leave when there is nothing to do, when stopping, or when a blocking caller drives
                # (``drive``): the next submit, or the driver leaving with work left, starts a new one.
                has_work = self._has_work_locked()
                if self._stopped or self._num_drivers or not has_work:
                    if not has_work:
                        self._idle.set()
                    self._worker_alive = False
                    self._cv.notify_all()
                    return
            self._iterate(as_worker=True)

    def _iterate(self, as_worker: bool = False) -> None:
        """Take new requests and cancellations, then run one iteration (in whichever thread drives)."""
        with self._drive_lock:
            if as_worker and self._num_drivers:
                return  # a blocking caller arrived while we waited for the lock: leave it the work
            self._iterating_thread = threading.get_ident()
            try:
                self._take_inbox()
                if self._engine.has_requests():
                    try:
                        self._engine.step()
                    except Exception as exc:  # noqa: BLE001 - every error must reach the callers
                        logger.exception("engine step failed")
                        self._engine.fail_all(exc)
                    except BaseException as exc:  # KeyboardInterrupt in a driving caller: stay consistent
                        self._engine.fail_all(exc)
                        raise
                self._set_idle_if_done()
            finally:
                self._iterating_thread = None

    def _take_inbox(self) -> None:
        """Hand new requests and cancellations to the engine (with the drive lock held)."""
        with self._cv:
            inbox, self._inbox = self._inbox, []
        self._engine.take_inbox(inbox)

    def _set_idle_if_done(self) -> None:
        with self._cv:
            if not self._has_work_locked():
                self._idle.set()
