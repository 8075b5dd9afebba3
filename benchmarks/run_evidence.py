"""What else happened while one timed repeat ran: evidence for a slow repeat (issue 47, item 4).

A repeat that takes 1.7x the others has one of a few causes, and each leaves a trace:

- **the machine**: a VM's vCPU descheduled by the host shows as *steal* time in ``/proc/stat``; other
  processes on the guest show as busy CPU time that is not ours; either way our process gets less
  CPU than ``wall x threads`` (``cpu_share`` below 1) and more involuntary context switches;
- **a re-time**: the engine's GEMM tuner measuring or re-checking kernel timings during the repeat
  (``tuning_s``, from ``engine.packed_linears.choices``);
- **a preemption storm**: preemptions, swapped blocks, more engine iterations for the same work;
- **a choice flip**: a different kernel per linear shape after the repeat than before it.

``RepeatEvidence.begin(engine)`` before the repeat, ``.end(engine)`` after it; :func:`explain`
names, for each repeat slower than the median by more than a margin, which of these differed.
Linux only for the machine figures (``/proc/stat``); elsewhere they are ``None``.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Optional


def _proc_stat_seconds() -> Optional[tuple[float, float]]:
    """(busy seconds, steal seconds) summed over the machine's CPUs since boot, or None off Linux.
    ``/proc/stat``'s first line counts clock ticks (``SC_CLK_TCK`` a second) per state: user nice
    system idle iowait irq softirq steal guest guest_nice; guest time is already inside user."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    ticks = [int(x) for x in fields[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq) / hz, steal / hz


def _tuning_seconds(engine) -> float:
    """Seconds the engine's GEMM tuner has spent measuring and re-checking timings so far."""
    choices = getattr(getattr(engine, "packed_linears", None), "choices", None)
    if choices is None:
        return 0.0
    return float(getattr(choices, "measured_seconds", 0.0)) + float(getattr(choices, "recheck_seconds", 0.0))


def _kernel_choices(engine) -> dict:
    choices = getattr(getattr(engine, "packed_linears", None), "choices", None)
    try:
        return dict(choices.summary()) if choices is not None else {}
    except Exception:  # an older tree's choices object: no flips reported, nothing else lost
        return {}


class RepeatEvidence:
    """Counters read around one timed repeat of an engine. ``threads``: the torch threads the
    engine computes with (the CPU time it could use is ``wall x threads``)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def begin(self, engine=None) -> None:
        self._t0 = time.perf_counter()
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self._stat0 = _proc_stat_seconds()
        self._engine0 = self._engine_counts(engine)

    @staticmethod
    def _engine_counts(engine) -> dict:
        if engine is None:
            return {}
        st = engine.stats()
        return {
            "iterations": st.num_iterations,
            "preemptions": st.num_preemptions,
            "blocks_swapped_out": st.num_blocks_swapped_out,
            "prefix_evictions": st.num_prefix_evictions,
            "tuning_s": _tuning_seconds(engine),
            "choices": _kernel_choices(engine),
        }

    def end(self, engine=None) -> dict:
        """The repeat's figures: ``wall_s``; ``cpu_s`` (this process, user + system, all threads)
        and ``cpu_share`` (``cpu_s / (wall_s x threads)``); ``steal_s`` and ``others_cpu_s`` (the
        machine's steal time and busy CPU time not ours, seconds, None off Linux);
        ``involuntary_switches``; ``loadavg_1m``; and from the engine the deltas of ``iterations``,
        ``preemptions``, ``blocks_swapped_out``, ``prefix_evictions``, ``tuning_s`` and ``choice_flips`` (linear shapes
        whose kernel changed)."""
        wall = time.perf_counter() - self._t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (ru.ru_utime - self._ru0.ru_utime) + (ru.ru_stime - self._ru0.ru_stime)
        stat = _proc_stat_seconds()
        out = {
            "wall_s": wall,
            "cpu_s": cpu,
            "cpu_share": cpu / (wall * self.threads) if wall > 0 else None,
            "steal_s": stat[1] - self._stat0[1] if stat and self._stat0 else None,
            "others_cpu_s": max(0.0, stat[0] - self._stat0[0] - cpu) if stat and self._stat0 else None,
            "involuntary_switches": ru.ru_nivcsw - self._ru0.ru_nivcsw,
            "loadavg_1m": os.getloadavg()[0],
        }
        after = self._engine_counts(engine)
        for key in ("iterations", "preemptions", "blocks_swapped_out", "prefix_evictions", "tuning_s"):
            if key in after:
                out[key] = after[key] - self._engine0[key]
        if "choices" in after:
            before = self._engine0["choices"]
            out["choice_flips"] = sorted(k for k, v in after["choices"].items() if before.get(k, v) != v)
        return out


def explain(repeats: list[dict], margin: float = 0.15) -> list[str]:
    """One line per repeat whose wall exceeds the median wall by more than ``margin``: which of the
    recorded causes differ from the median repeat's (more steal or others' CPU than 5% of the wall,
    a lower CPU share, tuning time, more preemptions or iterations, choice flips), or "no recorded
    cause" when none does."""
    if len(repeats) < 2:
        return []
    numeric = [k for k in repeats[0] if k != "choice_flips" and all(r.get(k) is not None for r in repeats)]
    med = {k: statistics.median(r[k] for r in repeats) for k in numeric}
    lines = []
    for i, r in enumerate(repeats):
        if r["wall_s"] <= (1 + margin) * med["wall_s"]:
            continue
        extra = r["wall_s"] - med["wall_s"]
        why = []
        for key, label in (("steal_s", "steal"), ("others_cpu_s", "other processes' CPU")):
            if key in med and r[key] - med[key] > 0.05 * r["wall_s"]:
                why.append(f"{label} {r[key]:.2f} s (median {med[key]:.2f})")
        if "cpu_share" in med and r["cpu_share"] < 0.9 * med["cpu_share"]:
            why.append(f"our CPU share {r['cpu_share']:.2f} (median {med['cpu_share']:.2f})")
        if r.get("tuning_s", 0) > 0.01:
            why.append(f"kernel timing {r['tuning_s']:.2f} s")
        for key in ("preemptions", "blocks_swapped_out", "prefix_evictions", "iterations"):
            if key in med and r[key] > 1.1 * med[key] + 1:
                why.append(f"{key} {r[key]} (median {med[key]:g})")
        if r.get("choice_flips"):
            why.append(f"kernel choice changed for {', '.join(r['choice_flips'])}")
        cause = "; ".join(why) if why else "no recorded cause"
        lines.append(f"repeat {i}: {r['wall_s']:.2f} s, +{extra:.2f} s over the median: {cause}")
    return lines
