"""Reading ``EngineStats`` snapshots: optional fields, phase rows, block owners, activity.

Fields beyond the core ``EngineStats`` ones are optional, looked up as attributes with defaults
(:func:`stat_field`), so the views also read snapshots that publish fewer.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional


def stat_field(stats, name: str, default: Any = None) -> Any:
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


def device_owners(stats) -> tuple:
    """Per device block its owner (-1 free); used blocks first when the engine publishes only counts."""
    return tuple(stats.block_owner) or (0,) * stats.num_used_blocks + (-1,) * stats.num_free_blocks


def swap_owners(stats) -> tuple:
    """Per CPU swap-pool block 0 (in use) or -1 (free), used blocks first: the engine publishes the
    host pool's counts, not owners. Empty without a swap pool."""
    used = int(stat_field(stats, "num_swapped_blocks", 0))
    return (0,) * used + (-1,) * (int(stat_field(stats, "num_swap_blocks", 0)) - used)


def num_active(stats) -> int:
    """Requests waiting, running or swapped out in a snapshot."""
    return stats.num_waiting + stats.num_running + stats.num_swapped


def adapter_counts(stats) -> list[tuple[str, int, str]]:
    """Requests per LoRA adapter in flight (``EngineStats.requests_per_adapter``), as
    ``(name, requests, "2 running, 1 waiting")``; empty for a plain model."""
    entries = []
    for name, waiting, running, swapped in stat_field(stats, "requests_per_adapter", ()):
        parts = [f"{n} {state}" for n, state in ((running, "running"), (waiting, "waiting"), (swapped, "swapped")) if n]
        entries.append((name, waiting + running + swapped, ", ".join(parts)))
    return entries
