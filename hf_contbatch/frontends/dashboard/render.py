"""HTML views of a stats snapshot, pure functions each returning one HTML string: the block grid
of each pool (:func:`render_pools`), the queue, speed and latency tiles with sparklines
(:func:`render_tiles`) and the phases of recent iterations (:func:`render_phases`)."""

from __future__ import annotations

import collections
import html
import math
from typing import Optional, Sequence

from ...core.phases import PHASES
from .snapshot import adapter_counts, device_owners, phase_rows, stat_field, swap_owners
from .text import format_ms, preemption_kinds

PHASE_COLOURS = {
    "reap": "#94a3b8",
    "budget": "#a78bfa",
    "admit": "#38bdf8",
    "preempt": "#f87171",
    "decode": "#34d399",
    "wait": "#fbbf24",
    "output": "#f472b6",
}
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


# Request colours: Paul Tol's colour-blind-safe "muted" scheme (https://personal.sron.nl/~pault/)
# without its sand and olive, which read as the prefix-cached amber; in the order that keeps
# consecutive request ids farthest apart. None is near FREE_COLOUR, CACHED_COLOUR or SWAPPED_COLOUR,
# also for colour-blind readers (tests/frontends/test_dashboard_colours.py).
REQUEST_COLOURS = ("#332288", "#44aa99", "#882255", "#117733", "#aa4499", "#88ccee", "#cc6677")


def request_colour(request_id: int) -> str:
    """The colour of a request's blocks: ``REQUEST_COLOURS`` in turn, so consecutive ids differ;
    never a colour the legend reserves (free, prefix-cached, swapped out)."""
    return REQUEST_COLOURS[request_id % len(REQUEST_COLOURS)]


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
    colour: Optional[str] = None,
    region: Optional[int] = None,
) -> str:
    """One ``<div>`` with a cell per block (request id on hover), or per group of blocks when the
    drawn region has more than ``max_cells`` blocks.

    Args:
        owners: per block, the owning request id or -1 when free.
        ref_counts: per block (optional); above 1 the block is shared (prefix cache or fork).
        max_cells: most cells drawn; larger regions aggregate ``ceil(n / max_cells)`` blocks a cell.
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
                cells.append(f'<i style="background:{request_colour(rid)}" title="block {start} · request {rid}"></i>')
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
            # Fuller groups are more opaque: the grid reads as a heat map of occupancy.
            fill = colour if colour is not None else request_colour(in_use.most_common(1)[0][0])
            cells.append(f'<i style="background:{fill};opacity:{0.3 + 0.7 * num_used / size:.2f}" title="{title}"></i>')
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
    owners = device_owners(stats)
    refs = tuple(stat_field(stats, "block_ref_counts", ()))
    cached_free = ""
    if stat_field(stats, "prefix_caching", False):
        cached_free = f" · {stat_field(stats, 'num_cached_blocks', 0):,} free blocks hold cached prefixes"
    drawn = min(len(owners), regions.get("kv") or in_use_region(owners))
    why = f'<div class="hfcb-note">size: {html.escape(sizing["kv"])}</div>' if sizing.get("kv") else ""
    device = (
        f'<div class="hfcb-pool hfcb-device"><h4>KV blocks · {stats.num_used_blocks:,}/{stats.num_blocks:,} in use'
        f" · block size {stats.block_size}{cached_free}</h4>{why}"
        f"{render_block_grid(owners, refs, max_cells, region=drawn)}{_region_note(drawn, len(owners))}"
        f"{_legend(blocks_per_cell(drawn, max_cells))}</div>"
    )
    swap_blocks = int(stat_field(stats, "num_swap_blocks", 0))
    if swap_blocks:
        swap_used = int(stat_field(stats, "num_swapped_blocks", 0))
        # Owners unknown (the engine publishes the host pool's counts): the used blocks in one colour.
        owners = swap_owners(stats)
        swap_drawn = min(swap_blocks, regions.get("swap") or in_use_region(owners))
        swap_grid = render_block_grid(owners, (), max_cells, colour=SWAPPED_COLOUR, region=swap_drawn)
        why = f'<div class="hfcb-note">size: {html.escape(sizing["swap"])}</div>' if sizing.get("swap") else ""
        swap = (
            f'<div class="hfcb-pool hfcb-swap"><h4>CPU swap pool · {swap_used:,}/{swap_blocks:,} in use</h4>{why}'
            f"{swap_grid}{_region_note(swap_drawn, swap_blocks)}"
            f"{_legend(blocks_per_cell(swap_drawn, max_cells), swap=True)}</div>"
        )
    else:
        swap = '<div class="hfcb-pool hfcb-swap"><h4>CPU swap pool · none</h4></div>'
    return _STYLE + f'<div class="hfcb-pools">{device}{swap}</div>'


def _tile(label: str, value: str, note: str = "") -> str:
    note = f"<small>{html.escape(note)}</small>" if note else ""
    return f'<div class="hfcb-tile"><small>{label}</small><b>{value}</b>{note}</div>'


def _median_p90(stats, name: str) -> str:
    """ "median X · p90 Y" of ``median_{name}_s``/``p90_{name}_s``; "" when the snapshot has none."""
    median = stat_field(stats, f"median_{name}_s")
    return "" if median is None else f"median {format_ms(median)} · p90 {format_ms(stat_field(stats, f'p90_{name}_s'))}"


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
    kinds = preemption_kinds(stats)
    hit = stat_field(stats, "prefix_cache_hit_rate") if stat_field(stats, "prefix_caching", False) else None
    tiles = [
        _tile("waiting", f"{stats.num_waiting:,}"),
        _tile("running", f"{stats.num_running:,}"),
        _tile("swapped", f"{stats.num_swapped:,}"),
        _tile("finished", f"{stats.num_finished:,}"),
        _tile("preempted", f"{stats.num_preemptions:,}", kinds),
        _tile(
            "tokens/s now",
            "—" if tokens_per_s_now is None else f"{tokens_per_s_now:,.1f}",
            f"avg {stats.throughput_tokens_per_s:,.1f}",
        ),
        _tile("TTFT (mean)", format_ms(stats.mean_ttft_s), _median_p90(stats, "ttft")),
        _tile("ITL (mean)", format_ms(stats.mean_itl_s), _median_p90(stats, "itl")),
        _tile("generated", f"{stats.num_generated_tokens:,}", f"{stats.num_iterations:,} iterations"),
    ]
    latest = stat_field(stats, "latest_request")
    if latest is not None:  # one request's own figures: what a one-prompt cell's user waited for
        which = f"request {stat_field(stats, 'latest_request_id')}"
        tiles.append(_tile(f"TTFT · {which}", format_ms(latest.ttft), "latest request to get a token"))
        tiles.append(
            _tile(
                f"ITL · {which}",
                format_ms(latest.itl),
                f"per token after the first · {latest.num_generated_tokens:,} tokens",
            )
        )
    if hit is not None:
        tiles.append(
            _tile("prefix hits", f"{100 * hit:.0f}%", "prompt tokens found cached / looked up (whole blocks only)")
        )
    for name, requests, detail in adapter_counts(stats):  # requests per LoRA adapter (a peft.PeftModel)
        tiles.append(_tile(f"adapter {html.escape(name)}", f"{requests:,}", detail))
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
                f'fill="{PHASE_COLOURS[phase]}"><title>{phase} {row[phase] * 1e3:,.2f} ms</title></rect>'
            )
    svg = f'<svg width="{width}" height="{height}" style="background:#fafafa">' + "".join(rects) + "</svg>"
    totals_by_phase = dict(stat_field(stats, "phase_seconds", ()))
    grand_total = sum(totals_by_phase.values())

    def share(p: str) -> str:
        return f'<td align="right">{100 * totals_by_phase.get(p, 0.0) / grand_total:.1f}%</td>' if grand_total else ""

    cells = "".join(
        f'<tr><td><span style="color:{PHASE_COLOURS[p]}">■</span> {p}</td>'
        f'<td align="right">{sum(r.get(p, 0.0) for r in rows) / len(rows) * 1e3:,.2f} ms</td>'
        f'<td align="right">{rows[-1].get(p, 0.0) * 1e3:,.2f} ms</td>{share(p)}</tr>'
        for p in PHASES
    )
    head = "<th></th><th>mean</th><th>last</th>" + ("<th>% of all</th>" if grand_total else "")
    table = f"<table><tr>{head}</tr>{cells}</table>"
    return (
        f'<div class="hfcb-phases"><div><small>phase durations, last {len(rows)} iterations '
        f"(tallest {top * 1e3:,.1f} ms)</small><br>{svg}</div>{table}</div>"
    )
