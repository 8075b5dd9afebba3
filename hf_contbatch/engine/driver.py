"""Who runs the engine's iterations: a background thread, or a blocking caller's own thread.

A mixin of ``LLMEngine``: the inbox (submits and cancellations queued by any thread), the worker
thread that runs while there is work and nobody drives, and ``drive`` that lends a blocking
caller's thread to the engine. Whoever runs it, an iteration is ``LLMEngine.step``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable, Optional

import torch

from .reliability import DeferredInterrupt

logger = logging.getLogger("hf_contbatch.engine")


class EngineDriver:
    """Inbox, worker thread and caller driving for ``LLMEngine`` (uses its ``config``,
    ``scheduler``, ``step``, ``_apply_cancel``, ``_fail_all`` and ``_state_lock``)."""

    def _init_driver(self) -> None:
        self._inbox: list = []  # ("add", Request) or ("cancel", request_id), in arrival order
        self._cv = threading.Condition()
        self._drive_lock = threading.Lock()  # held for one iteration by whichever thread drives
        self._num_drivers = 0  # blocking callers currently driving (the background thread leaves)
        self._iterating_thread: Optional[int] = None  # id of the thread inside an iteration
        self._live_views: "weakref.WeakSet" = weakref.WeakSet()  # see add_live_view
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        # The background thread runs only while there is work and no blocking caller drives; it
        # exits when idle. Why: each thread that runs torch ops keeps an OpenMP team, and with two
        # teams alive on 2 cores libgomp stops spin-waiting, which made every op ~2x slower here.
        self._thread = threading.Thread(target=lambda: None, name="hf_contbatch-engine")
        self._worker_alive = False

    def _has_work_locked(self) -> bool:
        """Requests queued in the inbox or held by the scheduler (call with ``_cv`` held)."""
        return bool(self._inbox or self.scheduler.has_work)

    def add_live_view(self, view) -> None:
        """Register a live view (anything with a ``running`` property, held weakly).

        While one is running, blocking callers leave the iterations to the background thread:
        driving in the caller is fast on 2 cores because torch's OpenMP workers spin-wait on both,
        which starves the kernel's I/O and the browser that render the view (measured: the
        dashboard's browser test froze in about half the runs while the caller drove, never
        otherwise).
        """
        self._live_views.add(view)

    @property
    def blocking_calls_drive(self) -> bool:
        """Whether blocking calls run iterations in their own thread (``EngineConfig.drive_in_caller``,
        the engine open, and no live view running)."""
        if not self.config.drive_in_caller or self._closed:
            return False
        return not any(view.running for view in list(self._live_views))

    drives_callers = blocking_calls_drive  # the former name

    def in_iteration(self) -> bool:
        """True when called from inside an iteration (e.g. from a request's done-callback)."""
        return self._iterating_thread == threading.get_ident()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until no request is queued or running, or ``timeout`` seconds passed (None: no
        limit). Returns True if idle. Waits on the background thread; never drives."""
        return self._idle.wait(timeout)

    def _enqueue(self, item: tuple) -> None:
        """Queue an inbox item for the next iteration and make sure a thread will run it."""
        with self._cv:
            self._inbox.append(item)
            if item[0] == "add":
                self._idle.clear()
            self._start_worker_locked()

    def _start_worker_locked(self) -> None:
        """Start the background thread if there is work, nobody drives, and none runs (cv held)."""
        if self._worker_alive or self._stop or self._num_drivers:
            return
        if not self._has_work_locked():
            return
        self._worker_alive = True
        self._thread = threading.Thread(target=self._loop, name="hf_contbatch-engine", daemon=True)
        self._thread.start()

    def _stop_worker(self) -> None:
        """Stop the background thread and wait for it (``close``)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.ident is not None:  # the placeholder before any work was never started
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        while True:
            with self._cv:
                # Leave when there is nothing to do, when closing, or when a blocking caller drives
                # (``drive``): the next submit, or the driver leaving with work left, starts a new one.
                has_work = self._has_work_locked()
                if self._stop or self._num_drivers or not has_work:
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
                if self.scheduler.has_work:
                    try:
                        self.step()
                    except Exception as exc:  # noqa: BLE001 - every error must reach the callers
                        logger.exception("engine step failed")
                        self._fail_all(exc)
                    except BaseException as exc:  # KeyboardInterrupt in a driving caller: stay consistent
                        self._fail_all(exc)
                        raise
                with self._cv:
                    if not self._has_work_locked():
                        self._idle.set()
            finally:
                self._iterating_thread = None

    def drive(self, until: Callable[[], bool], after_iteration: Optional[Callable[[], None]] = None) -> None:
        """Run iterations in the calling thread until ``until()`` is true.

        Blocking callers (``ContinuousBatchingPipeline.__call__``, ``RequestHandle.result``, the
        lm-eval integration; see ``hf_contbatch.frontends.progress.wait_for``) lend their thread to the
        engine instead of sleeping: the background thread leaves meanwhile, so one thread runs
        torch. Measured on 2 cores: with a second thread's OpenMP team alive, libgomp stops
        spin-waiting and every op of a step runs up to 2x slower (4,384 tokens: 3.6 s driven by the
        caller vs 5.6 s on a background thread). ``submit()`` + streaming keep working through the
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
                    if self._closed:
                        raise RuntimeError("the engine is closed")
                    with self._cv:
                        busy = self._has_work_locked()
                    if not busy:
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
        if self._closed or self._iterating_thread == threading.get_ident():
            return  # closing fails them anyway; inside an iteration the next reap releases them
        interrupt = DeferredInterrupt()  # a second Stop press must not leave them half released
        with interrupt:
            with self._drive_lock:
                self._take_inbox()
                with self._state_lock:
                    reaped = self.scheduler.reap()
                for req in reaped:
                    self._complete(req)
                with self._cv:
                    if not self._has_work_locked():
                        self._idle.set()
        interrupt.replay()

    def _take_inbox(self) -> None:
        """Hand new requests and cancellations to the scheduler (with the drive lock held)."""
        with self._cv:
            inbox = list(self._inbox)
            self._inbox.clear()
        with self._state_lock:
            for kind, item in inbox:
                if kind == "add":
                    self.scheduler.add_request(item)
                else:
                    self._apply_cancel(item)
