"""Waiting for many requests with a progress bar: the one blocking wait of the pipeline and the
lm-eval integration.

Where the engine lets blocking callers drive (``EngineDriver.blocking_calls_drive``), the waiting
thread runs the iterations itself (see ``EngineDriver.drive`` for why that is faster on CPU);
otherwise it sleeps on the requests' completion events. Either way the bar advances once per
finished request, and its rate counts every token generated so far, running requests' included
(refreshed at most every ``_LIVE_INTERVAL_S``), so a call of long requests does not look frozen.
"""

from __future__ import annotations

import queue
import time
from typing import Callable, Optional, Sequence

from ..engine.handles import RequestHandle
from .machine_load import MachineLoad

# Seconds between two refreshes of the bar's rate while no request finishes (tqdm's own default
# minimum interval between redraws is 0.1 s; a rate needs no more than two updates a second).
_LIVE_INTERVAL_S = 0.5


def wait_for(
    engine,
    handles: Sequence[RequestHandle],
    *,
    desc: str = "hf_contbatch",
    show: bool = True,
    on_finished: Optional[Callable[[RequestHandle], None]] = None,
) -> int:
    """Block until every handle in ``handles`` finished; return their generated tokens in total.

    Args:
        engine: the ``LLMEngine`` the handles belong to.
        handles: the requests to wait for.
        desc: the bar's label.
        show: draw a ``tqdm.auto`` bar (a widget in notebooks).
        on_finished: called in this thread with each handle as it finishes (between iterations,
            never inside one): where a caller keeps each result as it comes (lm-eval's cache).

    Raises:
        RuntimeError: the engine was closed while driving. On any exception (``KeyboardInterrupt``
            included) every request in ``handles`` is cancelled and released first (handles done
            with "cancelled" and their partial tokens, blocks free), so nothing of this wait keeps
            running; other requests are untouched. The bar closes marked "interrupted" or
            "failed" with the count cancelled.
        KeyboardInterrupt: a fresh one naming what was cancelled (a short traceback).
    """
    t0 = time.monotonic()
    done_q: "queue.SimpleQueue[RequestHandle]" = queue.SimpleQueue()
    bar = None
    tokens = 0  # of the finished requests: the return value
    finished = 0
    last_live = t0

    def generated_so_far() -> int:
        # Running requests' tokens too: list lengths are read without the engine's lock (an
        # append racing this read is off by one token for half a second, which a rate can bear).
        return sum(len(h.request.output_token_ids) for h in handles)

    def record(h: RequestHandle) -> None:
        nonlocal tokens, finished
        finished += 1
        tokens += len(h.request.output_token_ids)
        if bar is not None:
            bar.set_postfix_str(_rates(finished, generated_so_far(), time.monotonic() - t0), refresh=False)
            bar.update(1)
        if on_finished is not None:
            on_finished(h)

    def show_live_rate() -> None:
        nonlocal last_live
        now = time.monotonic()
        if bar is None or now - last_live < _LIVE_INTERVAL_S:
            return
        last_live = now
        bar.set_postfix_str(_rates(finished, generated_so_far(), now - t0), refresh=True)

    def drain() -> None:
        while True:
            try:
                record(done_q.get_nowait())
            except queue.Empty:
                show_live_rate()
                return

    try:  # from here on, any exception (an interrupt during the first tqdm import too) cancels them
        for h in handles:
            h.add_done_callback(done_q.put)
        if show:
            from tqdm.auto import tqdm

            # Rates in our own words: tqdm writes "3.78s/req" below one request a second.
            bar = tqdm(
                total=len(handles),
                desc=desc,
                unit="req",
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
            )
        if engine.driver.blocking_calls_drive:
            engine.driver.drive(lambda: all(h.done() for h in handles), after_iteration=drain)
            drain()
        while finished < len(handles):
            try:  # blocks without spinning; wakes to refresh the rate while nothing finishes
                record(done_q.get(timeout=_LIVE_INTERVAL_S))
            except queue.Empty:
                show_live_rate()
    except BaseException as exc:
        drain()
        unfinished = sum(1 for h in handles if not h.done())
        engine.driver.cancel_now(handles)
        interrupted = isinstance(exc, KeyboardInterrupt)
        if bar is not None:  # close the bar with the outcome, not a silent 0/N
            bar.set_description(f"{desc} {'interrupted' if interrupted else 'failed'}", refresh=False)
            bar.set_postfix_str(
                f"{_rates(finished, generated_so_far(), time.monotonic() - t0)}, {unfinished} cancelled", refresh=False
            )
        if interrupted:
            # A fresh exception: the traceback a notebook shows ends here instead of running
            # thousands of characters into torch where the interrupt happened to land.
            raise KeyboardInterrupt(
                f"generation interrupted; {unfinished} of this call's {len(handles)} requests cancelled"
            ) from None
        raise
    finally:
        if bar is not None:
            bar.close()
        _refresh_live_views(engine)
    return tokens


def _refresh_live_views(engine) -> None:
    """Refresh each running live view (a dashboard) once, now that the call has ended: its
    refresher thread ticks at most a few times a second (once a second when quiet), so a cell that
    returned could otherwise show its last step's state ("busy, 34 running") for a while."""
    for view in engine.driver.live_views():
        if getattr(view, "running", False):
            try:
                view.refresh()
            except Exception:  # noqa: BLE001 - a view must never fail the call it watched
                pass


def _rates(requests: int, tokens: int, seconds: float) -> str:
    """Progress-bar postfix: requests and generated tokens per second, and the machine's load
    (these rates depend on it; ``machine_load``)."""
    seconds = max(seconds, 1e-9)
    load = MachineLoad.now()
    return f"{requests / seconds:.2f} req/s, {tokens / seconds:.0f} tok/s" + (f", {load.short()}" if load else "")
