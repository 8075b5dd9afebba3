"""Views of an engine's stats snapshots: a live ipywidgets dashboard for notebooks, and a text
summary (``format_stats``) for scripts and terminals.

The engine publishes immutable ``EngineStats`` snapshots; this module only reads them. A
``Dashboard`` is built on the calling (main) thread; once displayed, a daemon thread wakes a few
times a second (it sleeps in between: a spinning thread starves torch's OpenMP threads on small
machines), takes a snapshot and sets widget values inside ``hold_sync()`` so each widget sends at
most one message per refresh, and only when something changed. ipywidgets is imported only when a
``Dashboard`` is built, so ``import hf_contbatch`` and ``format_stats`` work without it.

Fields beyond the core ``EngineStats`` ones are optional -- looked up as attributes, with
defaults -- so the view also reads snapshots that publish fewer:

- ``num_kv_tokens``: tokens whose KV the running requests hold (the tokens bar; else block slots);
- ``num_swap_blocks``, ``num_swapped_blocks``: the CPU swap pool's size and blocks in use;
- ``block_ref_counts``: per device block; above 1 the block is shared (prefix cache or fork);
- ``prefix_caching``, ``num_cached_blocks`` (free blocks still holding a reusable prefix),
  ``prefix_cache_hit_rate``;
- ``num_preemptions_swap``, ``num_preemptions_recompute``: preemptions by kind;
- ``reserved_blocks``, ``watermark_blocks``: the last budget step;
- ``phase_seconds``: total seconds per phase since the engine started.
"""

from __future__ import annotations

import collections
import contextlib
import html
import logging
import math
import threading
import time
import weakref
from typing import Any, Iterable, Optional, Sequence

from ..config import check_int, is_int
from ..core.phases import PHASES

logger = logging.getLogger(__name__)

PHASE_COLOURS = {"reap": "#94a3b8", "budget": "#a78bfa", "admit": "#38bdf8", "preempt": "#f87171", "decode": "#34d399"}
FREE_COLOUR = "#e5e7eb"
CACHED_COLOUR = "#f59e0b"
SWAPPED_COLOUR = "#a78bfa"  # host blocks in use (the engine publishes counts, not owners)

# One <style> for every dashboard; class names carry a prefix because JupyterLab applies it page-wide.
_STYLE = """<style>
.hfcb-pools{display:flex;gap:24px;align-items:flex-start;flex-wrap:wrap;font:12px sans-serif}
.hfcb-pool h4{margin:0 0 4px 0;font:600 12px sans-serif}
.hfcb-grid{display:grid;gap:1px}
.hfcb-grid i{display:block;width:100%;aspect-ratio:1;background:#e5e7eb;border-radius:2px}
.hfcb-grid i.c{background:#f59e0b}
.hfcb-legend{display:flex;gap:10px;margin-top:4px;color:#555;flex-wrap:wrap;max-width:640px}
.hfcb-note{color:#666;margin:0 0 3px 0}
.hfcb-legend span i{display:inline-block;width:9px;height:9px;margin-right:3px;vertical-align:middle}
.hfcb-tiles{display:flex;gap:6px;flex-wrap:wrap;font:12px sans-serif}
.hfcb-tile{border:1px solid #ddd;border-radius:4px;padding:3px 8px;min-width:64px}
.hfcb-tile b{display:block;font-size:16px}
.hfcb-tile small{color:#666}
.hfcb-phases{font:12px sans-serif;display:flex;gap:16px;align-items:flex-end;flex-wrap:wrap}
.hfcb-phases table td{padding:0 6px 0 0}
</style>"""


# --- reading snapshots ---------------------------------------------------------------------------
def _field(stats, name: str, default: Any = None) -> Any:
    """``stats.name``, else ``default`` (also when it is None)."""
    value = getattr(stats, name, None)
    return default if value is None else value


def phase_rows(recent_phases: Iterable) -> list[dict[str, float]]:
    """Per-iteration phase durations, oldest first, as ``{phase: seconds}`` dicts.

    Accepts the engine's ``((iteration, ((phase, seconds), ...)), ...)`` and a flat
    ``((phase, seconds), ...)`` stream (a new iteration starts when a phase repeats).
    """
    rows: list[dict[str, float]] = []
    current: Optional[dict[str, float]] = None
    for entry in recent_phases or ():
        if len(entry) == 2 and isinstance(entry[0], str):
            name, seconds = entry
            if current is None or name in current:
                current = {}
                rows.append(current)
            current[name] = float(seconds)
        elif len(entry) == 2 and isinstance(entry[1], (tuple, list)):
            row: dict[str, float] = {}
            for name, seconds in entry[1]:
                row[name] = row.get(name, 0.0) + float(seconds)
            rows.append(row)
            current = None
    return rows


def _ms(seconds: Optional[float]) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _preemption_kinds(stats, template: str = "{}") -> str:
    swap, recompute = _field(stats, "num_preemptions_swap"), _field(stats, "num_preemptions_recompute")
    if swap is None and recompute is None:
        return ""
    return template.format(f"swap {swap or 0}, recompute {recompute or 0}")


def format_stats(stats, tokens_per_s_now: Optional[float] = None, width: int = 30) -> str:
    """A few lines describing one ``EngineStats`` snapshot (for scripts, logs and terminals).

    Args:
        stats: an ``EngineStats`` (or any object with its fields).
        tokens_per_s_now: a recent generation rate to show beside the engine's average.
        width: characters of the usage bar.
    """
    n = max(stats.num_blocks, 1)
    used = stats.num_used_blocks
    filled = round(width * used / n)
    bar = "#" * filled + "." * (width - filled)
    kv_tokens = _field(stats, "num_kv_tokens")
    tokens = (
        f"{kv_tokens}/{stats.capacity_tokens} tokens"
        if kv_tokens is not None
        else f"{used * stats.block_size}/{stats.capacity_tokens} token slots"
    )
    lines = [
        f"KV blocks  [{bar}] {used}/{stats.num_blocks} used ({100 * used / n:.0f}%), "
        f"peak {stats.peak_used_blocks}, {tokens}",
    ]
    swap_blocks = _field(stats, "num_swap_blocks", 0)
    if swap_blocks:
        lines.append(f"swap pool  {_field(stats, 'num_swapped_blocks', 0)}/{swap_blocks} blocks used")
    if _field(stats, "prefix_caching", False):
        shared = sum(1 for r in _field(stats, "block_ref_counts", ()) if r > 1)
        lines.append(
            f"prefix     hit rate {100 * _field(stats, 'prefix_cache_hit_rate', 0.0):.0f}% · {shared} shared blocks"
            f" · {_field(stats, 'num_cached_blocks', 0)} free blocks holding cached prefixes"
        )
    lines.append(
        f"queues     waiting {stats.num_waiting} · running {stats.num_running} · swapped {stats.num_swapped}"
        f" · finished {stats.num_finished} · preempted {stats.num_preemptions}{_preemption_kinds(stats, ' ({})')}"
    )
    now = "" if tokens_per_s_now is None else f"{tokens_per_s_now:.1f} tok/s now, "
    lines.append(
        f"speed      {now}{stats.throughput_tokens_per_s:.1f} tok/s average · TTFT {_ms(stats.mean_ttft_s)}"
        f" · ITL {_ms(stats.mean_itl_s)} · {stats.num_generated_tokens} tokens in {stats.num_iterations} iterations"
    )
    rows = phase_rows(stats.recent_phases)
    if rows:
        means = {p: sum(r.get(p, 0.0) for r in rows) / len(rows) for p in PHASES}
        lines.append(
            f"phases     mean of last {len(rows)} iterations: "
            + " · ".join(f"{p} {means[p] * 1e3:.2f} ms" for p in PHASES)
        )
    return "\n".join(lines)


# --- rendering (pure functions of a snapshot; each returns one HTML string) ----------------------
def request_colour(request_id: int, lightness: int = 48) -> str:
    """A stable, well-spread colour for a request id (golden-angle hues)."""
    return f"hsl({(request_id * 137.508) % 360:.0f},62%,{lightness}%)"


def _columns(num_cells: int) -> int:
    return max(1, min(num_cells, 64, max(8, math.ceil(math.sqrt(3 * num_cells)))))


def _cell_px(num_cells: int) -> int:
    return 16 if num_cells <= 64 else 13 if num_cells <= 256 else 10


def in_use_region(owners: Sequence[int], high_water: int = 0, minimum: int = 64) -> int:
    """How many leading blocks of a pool the grid draws: a power of two covering every block in use
    now and the ``high_water`` mark of earlier snapshots, at least ``minimum``, at most the pool.

    Blocks are handed out lowest index first (freed blocks go back to the front of the free queue),
    so the blocks past the highest ever used have never held KV; drawing them would shrink the
    in-use cells to specks in a pool sized for the model's full context. Powers of two keep the grid
    from changing shape at every refresh.
    """
    n = len(owners)
    top = max((i + 1 for i in range(n - 1, -1, -1) if owners[i] >= 0), default=0)
    need = max(top, high_water, min(minimum, n), 1)
    return min(n, 1 << (need - 1).bit_length())


def render_block_grid(
    owners: Sequence[int],
    ref_counts: Sequence[int] = (),
    max_cells: int = 512,
    lightness: int = 48,
    colour: Optional[str] = None,
    region: Optional[int] = None,
) -> str:
    """One ``<div>`` with a cell per block (request id on hover), or per group of blocks when the
    drawn region has more than ``max_cells`` blocks.

    Args:
        owners: per block, the owning request id or -1 when free.
        ref_counts: per block (optional); above 1 the block is shared (prefix cache or fork).
        max_cells: most cells drawn; larger regions aggregate ``ceil(n / max_cells)`` blocks a cell.
        lightness: HSL lightness of request colours (the swap pool uses a lighter shade).
        colour: one colour for every block in use instead of one per request (owners unknown).
        region: draw only the first ``region`` blocks (see ``in_use_region``); None draws all.
    """
    n = len(owners) if region is None else max(0, min(region, len(owners)))
    refs = ref_counts if len(ref_counts) == len(owners) else (1,) * len(owners)
    group = blocks_per_cell(n, max_cells)
    cells = []
    for start in range(0, n, group):
        stop = min(n, start + group)
        if group == 1:
            rid = owners[start]
            if rid < 0:
                cells.append("<i></i>")
            elif refs[start] > 1:
                cells.append(
                    f'<i class="c" title="block {start} · shared by {refs[start]} requests '
                    f'(prefix cache), e.g. request {rid}"></i>'
                )
            elif colour is not None:
                cells.append(f'<i style="background:{colour}" title="block {start} · in use"></i>')
            else:
                cells.append(
                    f'<i style="background:{request_colour(rid, lightness)}" title="block {start} · request {rid}"></i>'
                )
            continue
        in_use = collections.Counter(owners[b] for b in range(start, stop) if owners[b] >= 0)
        num_used = sum(in_use.values())
        num_shared = sum(1 for b in range(start, stop) if owners[b] >= 0 and refs[b] > 1)
        size = stop - start
        title = f"blocks {start}–{stop - 1}: {num_used} in use"
        if in_use and colour is None:
            top = ", ".join(str(r) for r, _ in in_use.most_common(4))
            title += f" (requests {top}{', …' if len(in_use) > 4 else ''})"
        title += f", {num_shared} shared, {size - num_used} free"
        if num_shared * 2 > num_used:
            cells.append(f'<i class="c" title="{title}"></i>')
        elif num_used:
            rid = in_use.most_common(1)[0][0]
            # Fuller groups are darker: the grid reads as a heat map of occupancy.
            light = round(88 - (88 - lightness) * num_used / size)
            fill = (
                request_colour(rid, light) if colour is None else f"{colour};opacity:{0.3 + 0.7 * num_used / size:.2f}"
            )
            cells.append(f'<i style="background:{fill}" title="{title}"></i>')
        else:
            cells.append(f'<i title="{title}"></i>')
    cols, px = _columns(len(cells)), _cell_px(len(cells))
    note = "" if group == 1 else f' data-blocks-per-cell="{group}"'
    return (
        f'<div class="hfcb-grid" style="grid-template-columns:repeat({cols},{px}px)"{note}>' + "".join(cells) + "</div>"
    )


def blocks_per_cell(num_drawn: int, max_cells: int) -> int:
    """Blocks one grid cell stands for when ``num_drawn`` blocks are drawn in at most ``max_cells``."""
    return max(1, math.ceil(num_drawn / max(1, max_cells)))


def _legend(group: int, swap: bool = False) -> str:
    """The legend of one grid (device or swap pool): what its colours and one cell mean."""
    per = "1 block" if group == 1 else f"{group} blocks (darker = fuller)"
    if swap:
        used = f'<span><i style="background:{SWAPPED_COLOUR}"></i>swapped out</span>'

        shared = ""
    else:
        used = (
            f'<span><i style="background:{request_colour(1)}"></i><i style="background:{request_colour(2)}"></i>'
            "in use (colour = request, hover for id)</span>"
        )
        shared = f'<span><i style="background:{CACHED_COLOUR}"></i>prefix-cached (shared)</span>'
    return (
        f'<div class="hfcb-legend"><span><i style="background:{FREE_COLOUR}"></i>free</span>{used}{shared}'
        f"<span>one cell = {per}</span></div>"
    )


def _region_note(drawn: int, total: int) -> str:
    if drawn >= total:
        return ""
    return (
        f'<div class="hfcb-note">blocks 0–{drawn - 1} drawn; the other {total - drawn:,} have never been '
        "used (free)</div>"
    )


def _device_owners(stats) -> tuple:
    """Per device block its owner (-1 free); used blocks first when the engine publishes only counts."""
    return tuple(stats.block_owner) or (0,) * stats.num_used_blocks + (-1,) * stats.num_free_blocks


def render_pools(stats, max_cells: int = 512, regions: Optional[dict] = None, sizing: Optional[dict] = None) -> str:
    """The device pool grid and, beside it, the CPU swap pool grid (one HTML value), each with its
    own legend.

    Args:
        stats: an ``EngineStats``.
        max_cells: most cells per grid.
        regions: leading blocks to draw per pool (``{"kv": n, "swap": m}``); by default the
            ``in_use_region`` of this snapshot alone.
        sizing: why each pool has its size (``LLMEngine.pool_sizing``), shown under its title.
    """
    regions, sizing = regions or {}, sizing or {}
    owners = _device_owners(stats)
    refs = tuple(_field(stats, "block_ref_counts", ()))
    cached_free = ""
    if _field(stats, "prefix_caching", False):
        cached_free = f" · {_field(stats, 'num_cached_blocks', 0)} free blocks hold cached prefixes"
    drawn = min(len(owners), regions.get("kv") or in_use_region(owners))
    why = f'<div class="hfcb-note">size: {html.escape(sizing["kv"])}</div>' if sizing.get("kv") else ""
    device = (
        f'<div class="hfcb-pool hfcb-device"><h4>KV blocks · {stats.num_used_blocks}/{stats.num_blocks:,} in use'
        f" · block size {stats.block_size}{cached_free}</h4>{why}"
        f"{render_block_grid(owners, refs, max_cells, region=drawn)}{_region_note(drawn, len(owners))}"
        f"{_legend(blocks_per_cell(drawn, max_cells))}</div>"
    )
    swap_blocks = int(_field(stats, "num_swap_blocks", 0))
    if swap_blocks:
        swap_used = int(_field(stats, "num_swapped_blocks", 0))
        # The engine publishes the host pool's counts, not owners: the used blocks first, in one colour.
        swap_owners = (0,) * swap_used + (-1,) * (swap_blocks - swap_used)
        swap_drawn = min(swap_blocks, regions.get("swap") or in_use_region(swap_owners))
        swap_grid = render_block_grid(swap_owners, (), max_cells, colour=SWAPPED_COLOUR, region=swap_drawn)
        why = f'<div class="hfcb-note">size: {html.escape(sizing["swap"])}</div>' if sizing.get("swap") else ""
        swap = (
            f'<div class="hfcb-pool hfcb-swap"><h4>CPU swap pool · {swap_used}/{swap_blocks:,} in use</h4>{why}'
            f"{swap_grid}{_region_note(swap_drawn, swap_blocks)}"
            f"{_legend(blocks_per_cell(swap_drawn, max_cells), swap=True)}</div>"
        )
    else:
        swap = '<div class="hfcb-pool hfcb-swap"><h4>CPU swap pool · none</h4></div>'
    return _STYLE + f'<div class="hfcb-pools">{device}{swap}</div>'


def _tile(label: str, value: str, note: str = "") -> str:
    note = f"<small>{html.escape(note)}</small>" if note else ""
    return f'<div class="hfcb-tile"><small>{label}</small><b>{value}</b>{note}</div>'


def _sparkline(values: Sequence[float], colour: str, width: int = 160, height: int = 30) -> str:
    if len(values) < 2:
        return f'<svg width="{width}" height="{height}"></svg>'
    top = max(max(values), 1e-9)
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 2 - (height - 4) * v / top:.1f}" for i, v in enumerate(values))
    return (
        f'<svg width="{width}" height="{height}" style="background:#fafafa">'
        f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/></svg>'
    )


def render_tiles(stats, tokens_per_s_now: Optional[float], history: Sequence[tuple[float, float, int]] = ()) -> str:
    """Queue state, speed and latency tiles, with sparklines of tokens/s and blocks in use."""
    kinds = _preemption_kinds(stats)
    hit = _field(stats, "prefix_cache_hit_rate") if _field(stats, "prefix_caching", False) else None
    tiles = [
        _tile("waiting", str(stats.num_waiting)),
        _tile("running", str(stats.num_running)),
        _tile("swapped", str(stats.num_swapped)),
        _tile("finished", str(stats.num_finished)),
        _tile("preempted", str(stats.num_preemptions), kinds),
        _tile(
            "tokens/s now",
            "—" if tokens_per_s_now is None else f"{tokens_per_s_now:.1f}",
            f"avg {stats.throughput_tokens_per_s:.1f}",
        ),
        _tile("TTFT (mean)", _ms(stats.mean_ttft_s)),
        _tile("ITL (mean)", _ms(stats.mean_itl_s)),
        _tile("generated", str(stats.num_generated_tokens), f"{stats.num_iterations} iterations"),
    ]
    if hit is not None:
        tiles.append(_tile("prefix hits", f"{100 * hit:.0f}%"))
    rates = [r for _, r, _ in history]
    used = [u for _, _, u in history]
    spark = (
        f'<div class="hfcb-tile"><small>tokens/s · last {len(history)} refreshes</small><br>'
        f"{_sparkline(rates, '#059669')}</div>"
        f'<div class="hfcb-tile"><small>blocks in use</small><br>{_sparkline(used, "#2563eb")}</div>'
    )
    return '<div class="hfcb-tiles">' + "".join(tiles) + spark + "</div>"


def render_phases(stats, width: int = 320, height: int = 60) -> str:
    """Stacked bars of the five phases for each recent iteration, and their mean durations."""
    rows = phase_rows(stats.recent_phases)
    if not rows:
        return '<div class="hfcb-phases"><small>no iterations yet</small></div>'
    totals = [sum(r.values()) for r in rows]
    top = max(max(totals), 1e-9)
    bar_w = width / len(rows)
    rects = []
    for i, row in enumerate(rows):
        y = float(height)
        for phase in PHASES:
            h = height * row.get(phase, 0.0) / top
            if h < 0.05:  # under a tenth of a pixel: invisible, skip the bytes
                continue
            y -= h
            rects.append(
                f'<rect x="{i * bar_w:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 1):.1f}" height="{h:.1f}" '
                f'fill="{PHASE_COLOURS[phase]}"><title>{phase} {row[phase] * 1e3:.2f} ms</title></rect>'
            )
    svg = f'<svg width="{width}" height="{height}" style="background:#fafafa">' + "".join(rects) + "</svg>"
    totals_by_phase = dict(_field(stats, "phase_seconds", ()))
    grand_total = sum(totals_by_phase.values())

    def share(p: str) -> str:
        return f'<td align="right">{100 * totals_by_phase.get(p, 0.0) / grand_total:.1f}%</td>' if grand_total else ""

    cells = "".join(
        f'<tr><td><span style="color:{PHASE_COLOURS[p]}">■</span> {p}</td>'
        f'<td align="right">{sum(r.get(p, 0.0) for r in rows) / len(rows) * 1e3:.2f} ms</td>'
        f'<td align="right">{rows[-1].get(p, 0.0) * 1e3:.2f} ms</td>{share(p)}</tr>'
        for p in PHASES
    )
    head = "<th></th><th>mean</th><th>last</th>" + ("<th>% of all</th>" if grand_total else "")
    table = f"<table><tr>{head}</tr>{cells}</table>"
    return (
        f'<div class="hfcb-phases"><div><small>phase durations, last {len(rows)} iterations '
        f"(tallest {top * 1e3:.1f} ms)</small><br>{svg}</div>{table}</div>"
    )


# --- the live view --------------------------------------------------------------------------------
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
        """Take a snapshot and update every widget now (on the calling thread); returns the snapshot."""
        return self._refresh(only_if_changed=False)[0]

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
        engine = getattr(self.source, "engine", self.source)
        if hasattr(engine, "add_live_view"):
            engine.add_live_view(self)  # blocking calls then leave the CPU time this view needs
        return self

    def stop(self) -> None:
        """End the refresher thread (the view keeps its last values; ``refresh()`` updates it once)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        self._thread = None

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
            rate = self._recent_rate(time.monotonic(), stats.num_generated_tokens) if _active(stats) else None
        return format_stats(stats, rate)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        data = self.widget._repr_mimebundle_(**kwargs) or {}
        data["text/plain"] = self.summary()
        if _in_kernel():
            self.start()
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

    def _refresh(self, only_if_changed: bool) -> tuple[Any, bool]:
        """(snapshot, whether the widgets were updated)."""
        with self._lock:
            stats = self.source.stats()
            now = time.monotonic()
            rate = self._recent_rate(now, stats.num_generated_tokens)
            if not _active(stats) or self._source_closed():
                rate = None  # idle: a rate would be the last burst's, not "now" ("—" is shown)
            key = (
                stats.num_iterations,
                stats.num_used_blocks,
                stats.num_waiting,
                stats.num_running,
                stats.num_swapped,
                stats.num_finished,
                stats.num_generated_tokens,
                stats.num_preemptions,
                _field(stats, "num_swapped_blocks", 0),
                None if rate is None else round(rate, 1),
                self._source_closed(),
            )
            if only_if_changed and key == self._last_key:
                return stats, False  # nothing moved: render nothing, send nothing
            self._last_key, self._last_stats, self._rate = key, stats, rate
            self._history.append((now, rate or 0.0, stats.num_used_blocks))
            values = self._render(stats, rate)
            with contextlib.ExitStack() as held:
                for w in self._widgets:
                    held.enter_context(w.hold_sync())
                for (widget, trait), value in values.items():
                    setattr(widget, trait, value)
            self.num_refreshes += 1
            return stats, True

    @staticmethod
    def _blocks_text(stats) -> str:
        text = f"{stats.num_used_blocks} / {stats.num_blocks} blocks · peak {stats.peak_used_blocks}"
        reserved, watermark = _field(stats, "reserved_blocks"), _field(stats, "watermark_blocks")
        if reserved is not None:
            text += f" · reserved last step {reserved}"
        if watermark:
            text += f" · watermark {watermark}"
        return text

    def _grid_regions(self, stats) -> dict:
        """Leading blocks to draw per pool: the in-use region, never shrinking (``in_use_region``)."""
        self._regions["kv"] = in_use_region(_device_owners(stats), self._regions["kv"])
        swap_blocks = int(_field(stats, "num_swap_blocks", 0))
        if swap_blocks:
            used = int(_field(stats, "num_swapped_blocks", 0))
            owners = (0,) * used + (-1,) * (swap_blocks - used)
            self._regions["swap"] = in_use_region(owners, self._regions["swap"])
        return dict(self._regions)

    def _render(self, stats, rate: Optional[float]) -> dict:
        active = _active(stats)
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
        kv_tokens = _field(stats, "num_kv_tokens")
        slots = stats.num_used_blocks * stats.block_size
        shown_tokens = slots if kv_tokens is None else int(kv_tokens)
        tokens_text = (
            f"{slots} / {stats.capacity_tokens} token slots allocated"
            if kv_tokens is None
            else f"{shown_tokens} / {stats.capacity_tokens} tokens (in {slots} allocated slots)"
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


def _active(stats) -> int:
    """Requests waiting, running or swapped out in a snapshot."""
    return stats.num_waiting + stats.num_running + stats.num_swapped


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (where a frontend can show widget updates)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None
