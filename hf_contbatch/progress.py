"""Waiting for many requests with a progress bar: the one blocking wait of the pipeline and the
lm-eval integration.

Where the engine lets blocking callers drive (``LLMEngine.blocking_calls_drive``), the waiting
thread runs the iterations itself (see ``LLMEngine.drive`` for why that is faster on CPU);
otherwise it sleeps on the requests' completion events. Either way the bar advances once per
finished request and shows the generated tokens per second.
"""

from __future__ import annotations

import queue
import time
from typing import Sequence

from .handles import RequestHandle


def wait_for(engine, handles: Sequence[RequestHandle], *, desc: str = "hf_contbatch", show: bool = True) -> int:
    """Block until every handle in ``handles`` finished; return their generated tokens in total.

    Args:
        engine: the ``LLMEngine`` the handles belong to.
        handles: the requests to wait for.
        desc: the bar's label.
        show: draw a ``tqdm.auto`` bar (a widget in notebooks).

    Raises:
        RuntimeError: the engine was closed while driving. On any exception (``KeyboardInterrupt``
            included) every request in ``handles`` is cancelled and released first (handles done
            with "cancelled" and their partial tokens, blocks free), so nothing of this wait keeps
            running; other requests are untouched.
    """
    t0 = time.monotonic()
    done_q: "queue.SimpleQueue[RequestHandle]" = queue.SimpleQueue()
    for h in handles:
        h.add_done_callback(done_q.put)
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(handles), desc=desc, unit="req")
    tokens = 0
    finished = 0

    def record(h: RequestHandle) -> None:
        nonlocal tokens, finished
        finished += 1
        tokens += len(h.request.output_token_ids)
        if bar is not None:
            elapsed = max(time.monotonic() - t0, 1e-9)
            bar.set_postfix_str(f"{tokens / elapsed:.0f} tok/s", refresh=False)
            bar.update(1)

    def drain() -> None:
        while True:
            try:
                record(done_q.get_nowait())
            except queue.Empty:
                return

    try:
        if engine.blocking_calls_drive:
            engine.drive(lambda: all(h.done() for h in handles), after_iteration=drain)
            drain()
        while finished < len(handles):
            record(done_q.get())  # blocks without spinning
    except BaseException:
        engine.cancel_now(handles)
        raise
    finally:
        if bar is not None:
            bar.close()
    return tokens
