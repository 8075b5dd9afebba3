"""The one tuner of every timed kernel choice: which GEMM serves a linear shape
(``linears.autotune.KernelTuner``), whether the compiled CPU decode and prefill attention kernels
serve or the torch path does (``attention.decode_choice``, ``attention.cpu_prefill``).

A :class:`Tuner` keeps, per entry (a GEMM shape class, an attention geometry), the seconds per call
of each candidate at each bucket (row counts; one bucket for a fixed workload), measured once per
CPU, torch version, kernel build and thread count and cached on disk beside the C kernels
(``native_build.cache_dir()``), so only the first process on a machine pays for them. Figures that
cannot be right (a bucket far slower than a larger one) are re-timed; with ``recheck`` the buckets
that decide a cached choice are re-timed once and confirmed, so one noisy first run does not fix a
choice for good. Timing itself is interleaved and robust to load elsewhere (:func:`time_interleaved`).

Cache files: ``{prefix}_{key}.json``, ``{entry: {candidate: {bucket: seconds}}, "_confirmed":
{entry: [bucket, ...]}}``. The GEMM's (``gemm_timings_*``) keep the layout they had before this
module; the attention choices' are ``attention_timings_*`` (their older ``decode_choice_*`` and
``prefill_choice_*`` files, one pair of numbers each, are no longer read: measured again once).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Callable, Collection, Optional, Sequence

from . import native_build

logger = logging.getLogger(__name__)

RECHECK_MARGIN = 0.10
"""A re-time overrides a cached winner only when its new winner is faster by more than this."""
_IMPLAUSIBLE = 3.0  # a bucket timed this much slower than a larger one was disturbed
# A table reaching this many rows whose fastest time there is less than _FLAT_GROWTH times its fastest
# at the smallest bucket, every bucket's candidates within _FLAT_SPREAD of each other, is disturbed as
# a whole (see flat_table).
_FLAT_FROM = 64
_FLAT_GROWTH = 2.0
_FLAT_SPREAD = 0.05
# The timings file's entry listing, per entry, the buckets whose cached figures a re-time has
# confirmed (no entry key starts with an underscore).
_CONFIRMED = "_confirmed"

Table = dict  # {candidate: {bucket: seconds per call}}
MeasureBuckets = Callable[[Sequence[int]], Table]


def robust_seconds(samples: Sequence[float]) -> float:
    """The fastest of ``samples`` (``inf`` for none). A kernel call does fixed work, so load
    elsewhere (another process on the cores, its cache and memory traffic) only ever adds time: the
    fastest round is the least disturbed one, and it stays right while at least one round of each
    candidate ran undisturbed. A median needs most rounds undisturbed, which a 2-core machine shared
    by a few busy processes does not give (timings 3-10x off were cached and kept). The same
    reasoning is why Python's ``timeit`` documentation recommends the minimum of repeats."""
    return min(samples, default=math.inf)


def time_interleaved(
    runs: dict[str, Callable[[], Optional[int]]], rounds: int, timer: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Seconds per call of each of ``runs`` (name -> a callable doing ``k`` calls and returning
    ``k``, or None for one): ``rounds`` rounds, each calling every candidate once, round-robin
    (round ``i`` starts at candidate ``i mod n``, so none always runs first, right after another's
    cache-evicting pass), then the :func:`robust_seconds` of each one's rounds. ``timer``: a clock
    in seconds (tests pass a fake one)."""
    names = list(runs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            t0 = timer()
            calls = runs[name]() or 1
            samples[name].append((timer() - t0) / calls)
    return {n: robust_seconds(s) for n, s in samples.items()}


def implausible_buckets(seconds: dict[int, float], ratio: float = _IMPLAUSIBLE) -> list[int]:
    """Buckets whose time is more than ``ratio`` times the time at a larger bucket: more rows cannot
    cost that much less, so the timing there was disturbed (a 1-row call timed at 6.3 ms beside
    0.22 ms for 2 rows). ``inf`` (not timed) is never implausible."""
    bad = []
    for b, s in seconds.items():
        if math.isinf(s):
            continue
        if any(c > b and not math.isinf(t) and s > ratio * t for c, t in seconds.items()):
            bad.append(b)
    return sorted(bad)


def flat_table(
    table: Table, from_bucket: int = _FLAT_FROM, growth: float = _FLAT_GROWTH, spread: float = _FLAT_SPREAD
) -> bool:
    """Whether a table of two or more candidates over row buckets reads as disturbed as a whole: it
    reaches ``from_bucket`` rows, the fastest time at its largest bucket is less than ``growth``
    times the fastest at its smallest (a GEMM of 64 rows does 64 times the arithmetic of one row,
    which streams the same weight: at least several times longer on any CPU), and at every bucket
    the candidates' finite times are within ``spread`` of each other. A run where every call waited
    on the same thing (a scheduler tick of a loaded machine, each call's threads meeting at a
    barrier) gives such a table, and :func:`implausible_buckets` (a bucket slower than a larger one)
    misses it. A flat table of few rows (decode: every candidate streaming the weight at the
    memory's speed) is plausible and never flat here."""
    finite = {n: t for n, t in table.items() if not all(math.isinf(s) for s in t.values())}
    buckets = sorted(next(iter(table.values()))) if table else []
    if len(finite) < 2 or not buckets or buckets[-1] < from_bucket or buckets[0] >= buckets[-1]:
        return False

    def fastest(b: int) -> float:
        return min(t[b] for t in finite.values())

    if not fastest(buckets[-1]) < growth * fastest(buckets[0]):
        return False
    for b in buckets:
        times = [t[b] for t in finite.values() if not math.isinf(t[b])]
        if len(times) >= 2 and max(times) > (1 + spread) * min(times):
            return False
    return True


def deciding_buckets(times: dict[str, dict[int, float]], most: int = 2) -> list[int]:
    """The buckets worth re-timing to confirm a cached choice: the smallest (decode steps) and those
    where the two fastest candidates are closest (relative gap), ``most`` in all, in bucket order."""
    buckets = sorted(next(iter(times.values()))) if times else []
    if not buckets:
        return []

    def gap(b: int) -> float:
        ranked = sorted(t[b] for t in times.values())
        if len(ranked) < 2 or math.isinf(ranked[1]):
            return math.inf
        return ranked[1] / ranked[0] - 1 if ranked[0] > 0 else 0.0

    chosen = [buckets[0]]
    for b in sorted(buckets[1:], key=gap):
        if len(chosen) >= most or math.isinf(gap(b)):
            break
        chosen.append(b)
    return sorted(chosen)


def cache_file(prefix: str, *parts) -> str:
    """``{prefix}_{key}.json`` in ``native_build.cache_dir()``, the key a hash of this CPU
    (``native_build.cpu_id``), the torch version and ``parts`` (the kernels' builds, the thread
    count: whatever else the timings depend on)."""
    import torch

    text = "|".join(map(str, (native_build.cpu_id(), torch.__version__, *parts)))
    return str(native_build.cache_dir() / f"{prefix}_{hashlib.sha256(text.encode()).hexdigest()[:16]}.json")


def attention_tuner(source, threads: int, what: str) -> "Tuner":
    """The tuner of a compiled attention kernel against the torch path it may replace (candidates
    "kernel" and "torch", a tie to the kernel), its timings cached per CPU, torch version, the
    kernel's C ``source`` (a path: its bytes are hashed) and ``threads``. Measured once: no
    re-check of a cached choice (a measurement costs a second or two of one layer's attention)."""
    source_hash = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]
    return Tuner(("kernel", "torch"), cache_file("attention_timings", source_hash, threads), recheck=False, what=what)


def attention_choice_key(path: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> str:
    """An attention choice's entry in its tuner: ``"decode 8/2x64 b16 float32"``."""
    return f"{path} {num_heads}/{num_kv_heads}x{head_dim} b{block_size} {str(dtype).removeprefix('torch.')}"


class Tuner:
    """Seconds per call of named candidates per entry and bucket, measured when missing, cached on
    disk, disturbed figures re-timed (see the module docstring).

    Args:
        candidates: the candidates' names (every table has one row per name), read at every call: a
            caller may drop one that failed (``KernelTuner`` passes its candidate dict).
        cache_path: the timings file (:func:`cache_file`); None keeps timings in memory only.
        recheck: re-time a cached choice's deciding buckets once per entry (see :meth:`timings`).
        what: names the entries in the log ("GEMM", "decode attention").

    Attributes:
        measured_seconds: wall time spent measuring missing figures (0 when all came from the cache).
        recheck_seconds: wall time spent re-timing cached or disturbed figures.
        rechecked: entry -> buckets whose figures a re-time replaced.
    """

    def __init__(
        self, candidates: Collection[str], cache_path: Optional[str], recheck: bool = True, what: str = "kernel"
    ) -> None:
        self.candidates = candidates
        self.cache_path = cache_path
        self.recheck = recheck
        self.what = what
        data = native_build.read_json(cache_path) if cache_path else None
        self._timings: dict = data if isinstance(data, dict) else {}
        self.measured_seconds = 0.0
        self.recheck_seconds = 0.0
        self.rechecked: dict[str, list[int]] = {}
        self._checked: set[str] = set()

    def timings(self, key: str, buckets: Sequence[int], measure: MeasureBuckets) -> Table:
        """``{candidate: {bucket: seconds per call}}`` for entry ``key`` at ``buckets`` (``inf``
        where a candidate cannot run or was left out as far too slow): read from the cache, the
        missing buckets measured by ``measure(buckets)`` (same layout; a missing figure counts as
        ``inf``) and cached. Then, once per entry and tuner, two cheap checks re-time a few buckets:

        - disturbed figures (:func:`implausible_buckets`: a candidate far slower at a bucket than at
          a larger one; :func:`flat_table`: the whole table, every bucket), fresh or cached:
          re-timed and replaced;
        - with ``recheck``, a choice read from the cache: its :func:`deciding_buckets` re-timed; where
          the re-time names another winner, faster than the cached winner by more than
          :data:`RECHECK_MARGIN`, the re-timed figures replace the cached ones there. A bucket whose
          re-time agreed is recorded as confirmed in the cache and not re-timed by later starts.
        """
        known = self._timings.setdefault(key, {})
        missing = [b for b in buckets if any(str(b) not in known.get(n, {}) for n in self.candidates)]
        if missing:
            self._store(known, self._timed(measure, missing, full=True), missing)
        if key not in self._checked:
            self._checked.add(key)
            self._check(key, known, buckets, measure, fresh=set(missing))
        return {n: {b: float(known[n][str(b)]) for b in buckets} for n in self.candidates}

    def fastest(self, key: str, measure: Callable[[], dict[str, float]]) -> tuple[str, dict[str, float]]:
        """The fastest candidate of a fixed workload (one bucket) and the seconds of each:
        ``measure()`` returns ``{candidate: seconds}``; a tie goes to the first candidate."""
        table = self.timings(key, (1,), lambda buckets: {n: {1: s} for n, s in measure().items()})
        seconds = {n: t[1] for n, t in table.items()}
        return min(self.candidates, key=lambda n: seconds[n]), seconds

    def _timed(self, measure: MeasureBuckets, buckets: Sequence[int], full: bool) -> Table:
        t0 = time.perf_counter()
        measured = measure(buckets)
        if full:
            self.measured_seconds += time.perf_counter() - t0
        else:
            self.recheck_seconds += time.perf_counter() - t0
        return measured

    def _store(self, known: dict, measured: Table, buckets: Sequence[int]) -> None:
        for name in self.candidates:
            got = measured.get(name, {})
            known.setdefault(name, {}).update({str(b): float(got.get(b, math.inf)) for b in buckets})
        self._save()

    def _save(self) -> None:
        if self.cache_path:
            native_build.write_json(self.cache_path, self._timings)

    def _check(self, key: str, known: dict, buckets: Sequence[int], measure: MeasureBuckets, fresh: set) -> None:
        table = {n: {b: float(known[n][str(b)]) for b in buckets} for n in self.candidates}
        suspect = sorted({b for t in table.values() for b in implausible_buckets(t)})
        if flat_table(table):
            suspect = list(buckets)  # disturbed as a whole: every bucket re-timed
        # A deciding bucket one earlier re-time already confirmed is not re-timed again: the check
        # is meant to catch one noisy first run, and re-timing on every start costs seconds each.
        confirmed = self._timings.setdefault(_CONFIRMED, {}).setdefault(key, [])
        cached = [b for b in buckets if b not in fresh]
        confirm = deciding_buckets({n: {b: t[b] for b in cached} for n, t in table.items()}) if self.recheck else []
        confirm = [b for b in confirm if str(b) not in confirmed]
        again = sorted(set(suspect) | set(confirm))
        if not again:
            return
        measured = self._timed(measure, again, full=False)
        replace = []
        for b in again:
            new = {n: float(measured.get(n, {}).get(b, math.inf)) for n in self.candidates}
            old_winner = min(table, key=lambda n: table[n][b])
            new_winner = min(new, key=new.get)
            flipped = new_winner != old_winner and new[new_winner] < (1 - RECHECK_MARGIN) * new[old_winner]
            if b in suspect or flipped:
                replace.append(b)
        # Agreeing re-times confirm their bucket for later starts; a replaced figure is checked again.
        confirmed[:] = sorted({*confirmed, *(str(b) for b in confirm if b not in replace)} - {str(b) for b in replace})
        if replace:
            self.rechecked[key] = replace
            logger.info("%s timings of %s re-timed at %s (disturbed or contradicted)", self.what, key, replace)
            self._store(known, measured, replace)
        else:
            self._save()
