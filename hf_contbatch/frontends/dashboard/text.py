"""The text form of a stats snapshot (:func:`format_stats`), for scripts, logs and terminals."""

from __future__ import annotations

from typing import Optional

from ...core.phases import PHASES
from ..machine_load import MachineLoad, load_note
from .snapshot import adapter_counts, phase_rows, stat_field


def format_ms(seconds: Optional[float]) -> str:
    """``seconds`` as milliseconds with one decimal and thousands separators, as every count the
    dashboard shows ("5,663.6 ms"; "—" for None)."""
    return "—" if seconds is None else f"{seconds * 1e3:,.1f} ms"


def latest_request_text(stats) -> str:
    """The latest request to get a token (``EngineStats.latest_request``), its own figures:
    "request 3: TTFT 512.0 ms · ITL 61.2 ms per token · 128 tokens"; "" when the snapshot has none."""
    metrics, request_id = stat_field(stats, "latest_request"), stat_field(stats, "latest_request_id")
    if metrics is None:
        return ""
    return (
        f"request {request_id}: TTFT {format_ms(metrics.ttft)} · ITL {format_ms(metrics.itl)} per token"
        f" · {metrics.num_generated_tokens:,} tokens"
    )


def latency_text(stats) -> str:
    """Medians and 90th percentiles of TTFT and ITL over the engine's recent samples, then the
    latest request's own (``latest_request_text``); "" when the snapshot has no latency yet."""
    parts = []
    for name, field in (("TTFT", "ttft"), ("ITL", "itl")):
        median, p90 = stat_field(stats, f"median_{field}_s"), stat_field(stats, f"p90_{field}_s")
        if median is not None:
            parts.append(f"{name} median {format_ms(median)}, p90 {format_ms(p90)}")
    latest = latest_request_text(stats)
    if latest:
        parts.append(f"latest {latest}")
    return " · ".join(parts)


def preemption_kinds(stats, template: str = "{}") -> str:
    """Preemptions by kind ("swap N, recompute M") put into ``template``; "" when the snapshot has
    no counts by kind."""
    swap, recompute = stat_field(stats, "num_preemptions_swap"), stat_field(stats, "num_preemptions_recompute")
    if swap is None and recompute is None:
        return ""
    return template.format(f"swap {swap or 0:,}, recompute {recompute or 0:,}")


def logical_tokens_note(stats) -> str:
    """ " (N logical: shared blocks once per request)" when blocks shared by forks or prefix-cache
    hits make the requests see more tokens than the pool's slots hold; else ""."""
    logical, held = stat_field(stats, "num_logical_kv_tokens", 0), stat_field(stats, "num_kv_tokens", 0)
    return f" ({logical:,} logical: shared blocks once per request)" if logical > held else ""


def format_stats(
    stats, tokens_per_s_now: Optional[float] = None, width: int = 30, load: Optional[MachineLoad] = None
) -> str:
    """A few lines describing one ``EngineStats`` snapshot (for scripts, logs and terminals). The
    speed line ends with the machine's load, and a line follows it when the machine is busy
    (``machine_load.load_note``): the speeds depend on it.

    Args:
        stats: an ``EngineStats`` (or any object with its fields).
        tokens_per_s_now: a recent generation rate to show beside the engine's average.
        width: characters of the usage bar.
        load: the load reading to show (default: this machine's now; none where the OS has none).
    """
    n = max(stats.num_blocks, 1)
    used = stats.num_used_blocks
    filled = round(width * used / n)
    bar = "#" * filled + "." * (width - filled)
    kv_tokens = stat_field(stats, "num_kv_tokens")
    tokens = (
        f"{kv_tokens:,}/{stats.capacity_tokens:,} tokens{logical_tokens_note(stats)}"
        if kv_tokens is not None
        else f"{used * stats.block_size:,}/{stats.capacity_tokens:,} token slots"
    )
    lines = [
        f"KV blocks  [{bar}] {used:,}/{stats.num_blocks:,} used ({100 * used / n:.0f}%), "
        f"peak {stats.peak_used_blocks:,}, {tokens}"
        + (f", {stats.kv_cache_dtype} KV" if stat_field(stats, "kv_cache_dtype") else ""),
    ]
    swap_blocks = stat_field(stats, "num_swap_blocks", 0)
    if swap_blocks:
        lines.append(f"swap pool  {stat_field(stats, 'num_swapped_blocks', 0):,}/{swap_blocks:,} blocks used")
    if stat_field(stats, "prefix_caching", False):
        shared = sum(1 for r in stat_field(stats, "block_ref_counts", ()) if r > 1)
        lines.append(
            f"prefix     hits {100 * stat_field(stats, 'prefix_cache_hit_rate', 0.0):.0f}% of prompt tokens · {shared:,} shared blocks"
            f" · {stat_field(stats, 'num_cached_blocks', 0):,} free blocks holding cached prefixes"
        )
    lines.append(
        f"queues     waiting {stats.num_waiting:,} · running {stats.num_running:,} · swapped {stats.num_swapped:,}"
        f" · finished {stats.num_finished:,} · preempted {stats.num_preemptions:,}{preemption_kinds(stats, ' ({})')}"
    )
    adapters = adapter_counts(stats)
    if adapters:
        lines.append("adapters   " + " · ".join(f"{name}: {detail}" for name, _, detail in adapters))
    now = "" if tokens_per_s_now is None else f"{tokens_per_s_now:,.1f} tok/s now, "
    note, busy = load_note(" · ", load)
    lines.append(
        f"speed      {now}{stats.throughput_tokens_per_s:,.1f} tok/s average · TTFT {format_ms(stats.mean_ttft_s)}"
        f" · ITL {format_ms(stats.mean_itl_s)} · {stats.num_generated_tokens:,} tokens in {stats.num_iterations:,} iterations"
        + note
    )
    if busy:
        lines.append(f"           {busy}")
    latency = latency_text(stats)
    if latency:
        lines.append(f"latency    {latency}")
    rows = phase_rows(stats.recent_phases)
    if rows:
        means = {p: sum(r.get(p, 0.0) for r in rows) / len(rows) for p in PHASES}
        lines.append(
            f"phases     mean of last {len(rows)} iterations: "
            + " · ".join(f"{p} {means[p] * 1e3:,.2f} ms" for p in PHASES)
        )
    return "\n".join(lines)
