"""The live ipywidgets view (:class:`Dashboard`) and its refresher thread.

A ``Dashboard`` is built on the calling (main) thread; once displayed, a daemon thread wakes a few
times a second (it sleeps in between: a spinning thread starves torch's OpenMP threads on small
machines), takes a snapshot and sets widget values inside ``hold_sync()`` so each widget sends at
most one message per refresh, and only when something changed. ipywidgets is imported only when a
``Dashboard`` is built.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import weakref
from typing import Any, Optional

from ...config import check_int, is_int
from .render import in_use_region, render_phases, render_pools, render_tiles
from .snapshot import device_owners, num_active, stat_field, swap_owners
from .text import format_stats, logical_tokens_note

logger = logging.getLogger(__name__)


def _refresh_loop(dashboard_ref: "weakref.ref[Dashboard]", stop: threading.Event, period: float) -> None:
    """Body of the refresher thread: sleep, refresh, repeat; ends when stopped, when the dashboard
    is garbage, or after the engine has closed (with one last refresh). After two seconds without
    change it polls once a second, and it backs off further while snapshots fail."""
    failures = quiet = 0
    quiet_after = max(1, round(2.0 / period))
    while not stop.wait((period if quiet < quiet_after else max(period, 1.0)) * (1 + min(failures, 20))):
        dash = dashboard_ref()
        if dash is None:
            return
        try:
            _, rendered = dash._refresh(only_if_changed=True)
            quiet = 0 if rendered else quiet + 1
            failures = 0
        except Exception:  # noqa: BLE001 - a view must never take the kernel down
            if failures == 0:
                logger.exception("dashboard refresh failed; retrying with back-off")
            failures += 1
        if dash._source_closed():
            stop.set()  # before the last refresh, so the view says it has stopped
            with contextlib.suppress(Exception):
                dash._refresh(only_if_changed=False)
            return
        del dash


class Dashboard:
    """A live ipywidgets view of a pipeline's (or engine's) stats snapshots.

    Shows the KV block grid (colour per request, hover for its id; prefix-cached blocks; the CPU
    swap pool beside it; each pool drawn up to the highest block it has used, see
    ``in_use_region``), usage bars in blocks and tokens, queue state, tokens/s ("—" while idle),
    TTFT, ITL and the five phases of recent iterations. Display it (last expression of a cell, or
    ``display(dash)``) and it refreshes ``refresh_hz`` times a second from a daemon thread, while
    cells run and after; it costs nothing until displayed and sends nothing while nothing changes.

    Args:
        pipe: a ``ContinuousBatchingPipeline`` or an ``LLMEngine`` (anything with ``stats()``).
        refresh_hz: refreshes per second once displayed, in (0, 30].
        max_cells: most grid cells per pool; a larger drawn region aggregates blocks into cells.
        history: refreshes kept for the sparklines.

    Raises:
        ValueError: a bad ``refresh_hz``/``max_cells``/``history``, or ``pipe`` without ``stats()``.
    """

    def __init__(self, pipe, refresh_hz: float = 4, max_cells: int = 512, history: int = 120) -> None:
        if not callable(getattr(pipe, "stats", None)):
            raise ValueError(f"`pipe` must have a stats() method (a pipeline or an engine), got {type(pipe).__name__}")
        if isinstance(refresh_hz, bool) or not isinstance(refresh_hz, (int, float)) or not 0 < refresh_hz <= 30:
            raise ValueError(f"`refresh_hz` must be a number in (0, 30], got {refresh_hz!r}")
        if not is_int(max_cells) or max_cells < 1:
            raise ValueError(f"`max_cells` must be a positive int, got {max_cells!r}")
        check_int("history", history, 2)
        import ipywidgets as W  # lazily: hf_contbatch must import without ipywidgets

        self.source = pipe
        self.refresh_hz = float(refresh_hz)
        self.max_cells = max_cells
        self.num_refreshes = 0
        self._lock = threading.Lock()
        self._samples: collections.deque = collections.deque(maxlen=history)  # (time, tokens)
        self._history: collections.deque = collections.deque(maxlen=history)  # (time, tok/s, blocks)
        self._last_key: Optional[tuple] = None
        self._last_stats = None
        self._rate: Optional[float] = None
        self._regions = {"kv": 0, "swap": 0}  # high-water marks of the drawn grid regions
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

        bar_layout = W.Layout(width="320px")
        self.header = W.HTML()
        self.grid = W.HTML()
        self.grid.add_class("hfcb-block-grid")
        self.blocks_bar = W.IntProgress(min=0, max=1, description="KV blocks", layout=bar_layout)
        self.blocks_label = W.Label()
        self.tokens_bar = W.IntProgress(min=0, max=1, description="KV tokens", layout=bar_layout)
        self.tokens_label = W.Label()
        self.tiles = W.HTML()
        self.tiles.add_class("hfcb-tiles-widget")
        self.phases = W.HTML()
        self.phases.add_class("hfcb-phases-widget")
        self.widget = W.VBox(
            [
                self.header,
                self.grid,
                W.HBox([self.blocks_bar, self.blocks_label]),
                W.HBox([self.tokens_bar, self.tokens_label]),
                self.tiles,
                self.phases,
            ]
        )
        self.widget.add_class("hfcb-dashboard")
        self._widgets = (
            self.header,
            self.grid,
            self.blocks_bar,
            self.blocks_label,
            self.tokens_bar,
            self.tokens_label,
            self.tiles,
            self.phases,
        )
        self.refresh()

    # --- public ---------------------------------------------------------------------------------
    def refresh(self):
        """Take a snapshot and update every widget now (on the calling thread, each widget's values
        sent in full); returns the snapshot."""
        return self._refresh(only_if_changed=False, resend=True)[0]

    def start(self) -> "Dashboard":
        """Start the refresher thread (done on display); no-op if it runs."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_refresh_loop,
            args=(weakref.ref(self), self._stop, 1.0 / self.refresh_hz),
            name="hf_contbatch-dashboard",
            daemon=True,
        )
        self._thread.start()
        driver = getattr(getattr(self.source, "engine", self.source), "driver", None)
        if driver is not None:
            driver.add_live_view(self)  # blocking calls then leave the CPU time this view needs
        self.refresh()  # the header says "live" from the first frame, not after the first change
        return self

    def stop(self) -> None:
        """End the refresher thread; the view keeps its last values, its header then says "stopped"
        (``refresh()`` updates it once)."""
        was_running = self.running
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        self._thread = None
        if was_running and not self._source_closed():
            with contextlib.suppress(Exception):  # a view must never fail its caller
                self._refresh(only_if_changed=False, resend=True)

    def close(self) -> None:
        """Stop refreshing and close the widgets (their views disappear)."""
        self.stop()
        self.widget.close()
        for w in self._widgets:
            w.close()

    @property
    def running(self) -> bool:
        """Whether the refresher thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def summary(self) -> str:
        """The text form of a snapshot taken now (``format_stats``), never the refresher's last one:
        right after a call returns the refresher may not have run since its requests finished."""
        with self._lock:
            stats = self.source.stats()
            rate = self._recent_rate(time.monotonic(), stats.num_generated_tokens) if num_active(stats) else None
        return format_stats(stats, rate)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        if _in_kernel():
            self.start()  # before the bundle: its first frame already says "live"
        data = self.widget._repr_mimebundle_(**kwargs) or {}
        data["text/plain"] = self.summary()
        return data

    # --- internals ------------------------------------------------------------------------------
    def _source_closed(self) -> bool:
        engine = getattr(self.source, "engine", self.source)
        return bool(getattr(engine, "closed", False))

    def _recent_rate(self, now: float, tokens: int, window_s: float = 2.0) -> Optional[float]:
        self._samples.append((now, tokens))
        old = None
        for t, tok in self._samples:
            if now - t <= window_s:
                old = (t, tok)
                break
        if old is None or now - old[0] < 0.2:
            # Not enough time in the window: average from the oldest sample we have.
            if len(self._samples) < 2:
                return None
            old = self._samples[-2]
        return (tokens - old[1]) / max(now - old[0], 1e-9)

    def _refresh(self, only_if_changed: bool, resend: bool = False) -> tuple[Any, bool]:
        """(snapshot, whether the widgets were updated). ``resend``: send every rendered value, also
        those that did not change. The refresher thread's messages belong to no cell, and a tool
        that records a cell's messages (nbclient, ``jupyter nbconvert --execute``) drops them; an
        unchanged value sends nothing, so without this a saved notebook could keep an older frame
        than the one an explicit refresh() shows."""
        with self._lock:
            stats = self.source.stats()
            now = time.monotonic()
            rate = self._recent_rate(now, stats.num_generated_tokens)
            if not num_active(stats) or self._source_closed():
                rate = None  # idle: a rate would be the last burst's, not "now" ("—" is shown)
                # The next burst's rate counts from here: idle seconds in its window would make
                # a short burst read low.
                self._samples.clear()
                self._samples.append((now, stats.num_generated_tokens))
            key = (
                stats.num_iterations,
                stats.num_used_blocks,
                stats.num_waiting,
                stats.num_running,
                stats.num_swapped,
                stats.num_finished,
                stats.num_generated_tokens,
                stats.num_preemptions,
                stat_field(stats, "num_swapped_blocks", 0),
                None if rate is None else round(rate, 1),
                self._source_closed(),
            )
            if only_if_changed and key == self._last_key:
                return stats, False  # nothing moved: render nothing, send nothing
            self._last_key, self._last_stats, self._rate = key, stats, rate
            self._history.append((now, rate or 0.0, stats.num_used_blocks))
            values = self._render(stats, rate)
            unchanged: dict = {}  # widget -> its traits that setting sends nothing for (resend only)
            with contextlib.ExitStack() as held:
                for w in self._widgets:
                    held.enter_context(w.hold_sync())
                for (widget, trait), value in values.items():
                    if resend and getattr(widget, trait) == value:
                        unchanged.setdefault(widget, []).append(trait)
                    setattr(widget, trait, value)
            for widget, keys in unchanged.items():  # changed values went once, with the hold's sync
                widget.send_state(keys)
            self.num_refreshes += 1
            return stats, True

    @staticmethod
    def _blocks_text(stats) -> str:
        text = f"{stats.num_used_blocks:,}/{stats.num_blocks:,} blocks · peak {stats.peak_used_blocks:,}"
        reserved, watermark = stat_field(stats, "reserved_blocks"), stat_field(stats, "watermark_blocks")
        if reserved is not None:
            text += f" · reserved last step {reserved:,}"
        if watermark:
            text += f" · watermark {watermark:,}"
        return text

    def _grid_regions(self, stats) -> dict:
        """Leading blocks to draw per pool: the in-use region, never shrinking (``in_use_region``)."""
        self._regions["kv"] = in_use_region(device_owners(stats), self._regions["kv"])
        if int(stat_field(stats, "num_swap_blocks", 0)):
            self._regions["swap"] = in_use_region(swap_owners(stats), self._regions["swap"])
        return dict(self._regions)

    def _render(self, stats, rate: Optional[float]) -> dict:
        active = num_active(stats)
        if self._source_closed():
            state, colour = "closed", "#6b7280"
        elif active:
            state, colour = "busy", "#059669"
        else:
            state, colour = "idle", "#6b7280"
        live = "live" if self.running and not self._stop.is_set() else "stopped"
        header = (
            f'<div style="font:600 13px sans-serif">hf_contbatch · continuous batching '
            f'<span style="color:{colour}">● {state}</span> '
            f'<small style="font-weight:400;color:#666">{live}</small></div>'
        )
        kv_tokens = stat_field(stats, "num_kv_tokens")
        slots = stats.num_used_blocks * stats.block_size
        shown_tokens = slots if kv_tokens is None else int(kv_tokens)
        tokens_text = (
            f"{slots:,}/{stats.capacity_tokens:,} token slots allocated"
            if kv_tokens is None
            else f"{shown_tokens:,}/{stats.capacity_tokens:,} tokens (in {slots:,} allocated slots)"
            + logical_tokens_note(stats)
        )
        return {
            (self.header, "value"): header,
            (self.grid, "value"): render_pools(
                stats,
                self.max_cells,
                self._grid_regions(stats),
                getattr(getattr(self.source, "engine", self.source), "pool_sizing", None),
            ),
            (self.blocks_bar, "max"): max(stats.num_blocks, 1),
            (self.blocks_bar, "value"): stats.num_used_blocks,
            (self.blocks_label, "value"): self._blocks_text(stats),
            (self.tokens_bar, "max"): max(stats.capacity_tokens, 1),
            (self.tokens_bar, "value"): min(shown_tokens, stats.capacity_tokens),
            (self.tokens_label, "value"): tokens_text,
            (self.tiles, "value"): render_tiles(stats, rate, list(self._history)),
            (self.phases, "value"): render_phases(stats),
        }


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (where a frontend can show widget updates)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
