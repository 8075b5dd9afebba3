"""Choosing the GEMM for each linear shape by timing the candidates on the CPU at hand.

Which GEMM is fastest depends on the CPU (vector width, caches, memory bandwidth), the shape and the
number of rows: on one machine our kernel streams weights best at decode sizes, on another oneDNN's
JIT kernels win, and ``F.linear`` rarely wins but needs no packed copy. So
``linear_backend="auto"`` measures instead of guessing: for every ``(in, out, dtype)`` shape class of
the model's linears (sibling projections fused), it times each candidate at each row bucket
(:data:`ROW_BUCKETS`, up to the most rows a call will have) over enough weight copies (twice the
last-level cache in all, :func:`timing_pool_bytes`) that they stream from memory as a model's layers
do, and keeps per shape:

- the candidate with the lowest geometric mean of its time relative to the fastest one over the
  buckets (``F.linear`` included: a shape it wins is not packed), and
- where another backend is at least :data:`DUAL_MARGIN` faster at two or more buckets, or at one
  row, and memory allows a second copy, both, each serving the buckets it wins
  (:class:`~hf_contbatch.kernels.linears.dispatch_gemm.DispatchGEMM`). ``F.linear`` may be that
  second one (not for int8 weights): over one module's own weight it needs no copy and
  :data:`FREE_DUAL_MARGIN` is enough; over fused siblings it reads their concatenated weight. On
  some CPUs it streams one row fastest (a vendor GEMV) and loses from a few rows on.

Each choice is a :class:`KernelChoice` (kernel names per bucket, never a joined string to split).

Timings are kept by the package's one tuner (:class:`~hf_contbatch.kernels.tuning.Tuner`), cached on
disk per CPU, torch version, GEMM build and thread count (beside the C kernels, in
``native_build.cache_dir()``), so only the first engine on a machine pays for them;
:meth:`KernelTuner.report` says what was measured and chosen.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..tuning import (  # noqa: F401  (re-exported: the timing helpers' former home)
    RECHECK_MARGIN,
    Tuner,
    cache_file,
    deciding_buckets,
    implausible_buckets,
    robust_seconds,
    time_interleaved,
)
from .dispatch_gemm import DispatchGEMM, bucket_of
from .gemm_kernel import GemmKernel, PackedWeight
from .registry import UNPACKED, make_kernel

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Row counts timed per shape; a call with ``m`` rows takes the choice of the smallest bucket >= m."""
DUAL_MARGIN = 0.15
"""A second packed backend serves the buckets where its time is at most ``1 - DUAL_MARGIN`` of the
first's, if there are at least two such buckets (one could be noise) or one is the one-row bucket
(a single sequence's decode, the commonest call in a notebook; re-timed before a cached choice is
trusted: ``tuning.deciding_buckets``), and memory allows it a packed copy of its own."""
FREE_DUAL_MARGIN = 0.05
"""The margin of :data:`DUAL_MARGIN` for ``F.linear`` as the second kernel of one module: it reads
the module's own weight, no copy is kept for it, so only noise-sized gaps are ignored (and the
one-row bucket is re-timed before a cached choice is trusted)."""
_STREAM_BYTES = 96 * 2**20
"""The weight bytes all candidates hold together while timed where the last-level cache size is
unknown (:func:`timing_pool_bytes`)."""
_POOL_CAP = 2**30
"""The most weight bytes all candidates hold together while timed (the copies are freed after each
shape): a 1.4 GB model's step streams more, but a pool twice a 480 MiB cache already misses it."""
# At most this many calls a pass: small weights then add up to less than the pool. Under load every
# call can wait for a scheduler tick (its threads' barrier), so the tuning time grows with the calls
# (256 copies of a 960x960 bf16 weight took 54 s to re-time one bucket with other jobs running).
_MAX_COPIES = 64
# The cache key's part naming how timings are taken: changed when a change to the timing makes
# cached figures wrong (2: the pool sized from the last-level cache, not a fixed 96 MiB).
_TIMING_VERSION = 2
_ROUNDS = 5  # interleaved timing rounds per bucket; the fastest is kept (robust_seconds)
_RECHECK_ROUNDS = 3
# From this many rows a GEMM reuses each weight enough (2 * rows / 4 FLOP a float32 byte) to be
# compute-bound even where the cores share a few GB/s of memory bandwidth: one weight copy is timed.
# Below it, weights stream from memory as in a model's step (at 64 rows, 32 FLOP a byte, a 2-core VM
# at 6-30 GB/s is still memory-bound, so a kernel timed on one cached copy looked faster than the
# engine then saw it).
_COMPUTE_ROWS = 256
# A candidate far slower than the fastest is left out of larger buckets only from this many rows: at
# fewer, calls take microseconds to a few ms and one disturbed bucket pair (load elsewhere) dropped a
# kernel that was fastest at every prefill bucket it was then never timed at.
_STRIKE_FROM = 64
_PASS_SPREAD = 2.0  # a candidate's timed pass takes at most about this many times the fastest's
_TIMEOUT_RATIO = 4.0  # a candidate this much slower than the best stops being timed at larger buckets
# At any rows, a candidate this much slower at two buckets in a row, and no closer at the second,
# is no contender either: its cost grows with the rows faster than the best one's (torch's int8
# weight-only kernel on an AVX2 CPU: 26x at 4 rows, 34x at 8), and timing it at every bucket up to
# 64 rows took half a quantized first start. A kernel far slower at few rows by per-call overhead
# gets closer as rows grow, and is still timed.
_HOPELESS_RATIO = 16.0

Measure = Callable[[int, int, torch.dtype, Sequence[int]], "dict[str, dict[int, float]]"]


def last_level_cache_bytes(cpu_dir: str = "/sys/devices/system/cpu/cpu0") -> Optional[int]:
    """Size in bytes of the last-level data (or unified) cache one core of this CPU sees, from
    Linux's sysfs (``cache/index*/level``, ``type``, ``size`` as "491520K"); None where it cannot
    be read (another OS, a container hiding sysfs). The size of one instance: what one core's
    working set competes for."""
    found: dict[int, int] = {}
    for index in sorted(Path(cpu_dir, "cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1].upper(), 1)
        try:
            found[level] = int(size.rstrip("KMGkmg")) * scale
        except ValueError:
            continue
    return found[max(found)] if found else None


def timing_pool_bytes(llc_bytes: Optional[int]) -> int:
    """The weight bytes all candidates' copies add up to while a shape is timed: twice the
    last-level cache (``llc_bytes``), at least :data:`_STREAM_BYTES` (also where the size is
    unknown: None) and at most :data:`_POOL_CAP`. Timing round-robins the candidates, each over its
    own share of the pool, so a copy is read again only after the others' shares went by (at least
    ``(n - 1) / n`` of the pool for ``n`` candidates: a cache's worth for two or more): its weights
    come from memory, as in a model's step that streams more than the cache holds. A fixed 96 MiB
    stayed partly cached on a 480 MiB cache."""
    if not llc_bytes:
        return _STREAM_BYTES
    return max(_STREAM_BYTES, min(_POOL_CAP, 2 * llc_bytes))


def copies_per_candidate(weight_bytes: int, candidates: int, pool_bytes: int) -> int:
    """How many copies of a ``weight_bytes`` weight each of ``candidates`` kernels is timed over:
    its even share of ``pool_bytes`` (:func:`timing_pool_bytes`), at least one, at most
    :data:`_MAX_COPIES` (small weights: the calls, not the bytes, would set the tuning time)."""
    share = pool_bytes / max(1, candidates)
    return max(1, min(_MAX_COPIES, math.ceil(share / max(1, weight_bytes))))


def bucket_index(rows: int) -> int:
    """Index in :data:`ROW_BUCKETS` of the smallest bucket >= ``rows`` (the last one beyond it)."""
    return bucket_of(rows, ROW_BUCKETS)


def buckets_up_to(max_rows: int) -> tuple[int, ...]:
    """The buckets a call of at most ``max_rows`` rows can fall in (at least one)."""
    return ROW_BUCKETS[: bucket_index(max(1, max_rows)) + 1]


@dataclass(frozen=True)
class KernelChoice:
    """What serves one shape class.

    Attributes:
        kernels: the registry names of the kernels that serve it, the overall winner first (one
            name; two when a second packed kernel serves the buckets it wins; ``("torch",)``: left to
            ``F.linear``, nothing packed).
        per_bucket: the kernel name serving each timed :data:`ROW_BUCKETS` entry (beyond the last
            timed bucket, the last one's).
        seconds: the measured seconds per call by kernel name and bucket.
    """

    kernels: tuple[str, ...]
    per_bucket: tuple[str, ...]
    seconds: dict[str, dict[int, float]] = field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        """For reports: the kernel names joined by "+" ("native", "native+onednn"); never parsed."""
        return "+".join(self.kernels)

    @property
    def table(self) -> tuple[int, ...]:
        """Per :data:`ROW_BUCKETS` entry, the index in :attr:`kernels` serving it."""
        table = [self.kernels.index(n) for n in self.per_bucket]
        return tuple(table + [table[-1]] * (len(ROW_BUCKETS) - len(table)))


def shape_key(in_features: int, out_features: int, dtype: torch.dtype) -> str:
    """How a shape class is named in the cache and the report: ``"960x5120:float32"``."""
    return f"{in_features}x{out_features}:{str(dtype).removeprefix('torch.')}"


def _packed_copies(kernel, weight: torch.Tensor, share_bytes: int) -> list[PackedWeight]:
    """Packed copies of ``weight`` in distinct memory adding up to about ``share_bytes`` (for timing
    streamed weights; :func:`copies_per_candidate` of the packed size: an int8 copy is a quarter of
    float32's): one pack, then clones of its tensors, where the layout is plain tensors (a pack can
    cost far more than a copy: an int8 kernel quantizes), else one pack each (oneDNN's opaque
    layouts)."""
    first = kernel.pack(weight)
    copies = copies_per_candidate(max(first.nbytes, 1), 1, share_bytes)
    parts = (first.data, first.scales, first.zero_points)
    plain = all(t is None or (isinstance(t, torch.Tensor) and t.layout == torch.strided) for t in parts)
    if not plain:
        return [first, *(kernel.pack(weight.clone()) for _ in range(copies - 1))]

    def clone(t):
        return None if t is None else t.clone()

    return [
        first,
        *(
            dataclasses.replace(
                first, data=clone(first.data), scales=clone(first.scales), zero_points=clone(first.zero_points)
            )
            for _ in range(copies - 1)
        ),
    ]


class KernelTuner:
    """Times the candidate GEMMs per shape class and chooses (see the module docstring).

    Args:
        candidates: the packed kernels available here by registry name (``registry.available_kernels``);
            ``F.linear`` (``torch_linear.TorchLinear``) is always a candidate.
        cache_path: the timings file; "default" is ``gemm_timings_<key>.json`` in
            ``native_build.cache_dir()``, the key naming this CPU, torch, the kernels' builds and the
            thread count; None keeps timings in memory only.
        measure: ``(in, out, dtype, buckets) -> {backend: {bucket: seconds per call}}``; default
            :meth:`measure` (tests pass fixed timings).
        recheck: re-time a cached choice's deciding buckets once per shape (see :meth:`timings`).
        timer: the clock :meth:`measure` reads, in seconds (tests pass a fake one).
        pool_bytes: the weight bytes all candidates' copies add up to while a shape is timed
            (default: :func:`timing_pool_bytes` of this CPU's :func:`last_level_cache_bytes`).
    """

    def __init__(
        self,
        candidates: dict[str, GemmKernel],
        cache_path: Optional[str] = "default",
        measure: Optional[Measure] = None,
        recheck: bool = True,
        timer: Callable[[], float] = time.perf_counter,
        pool_bytes: Optional[int] = None,
    ):
        self.timer = timer
        self.pool_bytes = pool_bytes or timing_pool_bytes(last_level_cache_bytes())
        self.candidates = {**candidates, UNPACKED: make_kernel(UNPACKED)}
        self.threads = torch.get_num_threads()
        if cache_path == "default":
            builds = ",".join(f"{n}:{getattr(k, 'build_id', '')}" for n, k in sorted(self.candidates.items()))
            cache_path = cache_file("gemm_timings", builds, self.threads, f"timing:{_TIMING_VERSION}")
        self.cache_path = cache_path
        self._measure = measure or self.measure
        self.tuner = Tuner(self.candidates, cache_path, recheck=recheck, what="GEMM")
        self.choices: dict[str, KernelChoice] = {}

    @property
    def measured_seconds(self) -> float:
        """Wall time spent timing (0 when everything came from the cache)."""
        return self.tuner.measured_seconds

    @property
    def recheck_seconds(self) -> float:
        """Wall time spent re-timing cached or disturbed figures."""
        return self.tuner.recheck_seconds

    @property
    def rechecked(self) -> dict[str, list[int]]:
        """Shape key -> buckets whose figures a re-time replaced."""
        return self.tuner.rechecked

    def timings(self, in_features: int, out_features: int, dtype: torch.dtype, buckets: Sequence[int]) -> dict:
        """``{backend: {bucket: seconds per call}}`` for every candidate at ``buckets`` (``inf``
        where a backend cannot run the shape or was left out as far too slow), through
        :meth:`Tuner.timings <hf_contbatch.kernels.tuning.Tuner.timings>`: read from the cache, the
        missing buckets measured, disturbed or (with ``recheck``) deciding ones re-timed."""
        return self.tuner.timings(
            shape_key(in_features, out_features, dtype),
            buckets,
            lambda bs: self._measure(in_features, out_features, dtype, bs),
        )

    def measure(self, in_features: int, out_features: int, dtype: torch.dtype, buckets: Sequence[int]) -> dict:
        """Seconds per call of every candidate at ``buckets`` for a random ``[out, in]`` weight: the
        fastest of :data:`_ROUNDS` rounds (:func:`time_interleaved`: candidates round-robin, so a
        burst of load elsewhere hits one round of each, not all rounds of one), each round a pass
        of each candidate over its copies of the weight, all candidates' copies adding up to
        :attr:`pool_bytes` (twice the last-level cache: :func:`timing_pool_bytes`), so the weights
        stream from memory as a model's layers do (one copy from 256 rows on, where the GEMM is
        compute-bound, :data:`_COMPUTE_ROWS`). A candidate ``4x`` slower than the fastest at two
        buckets in a row of at least :data:`_STRIKE_FROM` rows, or ``16x`` slower at two buckets in a
        row of any size and no closer at the second (:data:`_HOPELESS_RATIO`), is not timed at larger
        ones (``inf``), except one whose ``always_timed`` attribute is true (a kernel whose cost per
        call is bounded and whose relative speed grows with the rows)."""
        g = torch.Generator().manual_seed(0)
        weight = (torch.randn(out_features, in_features, generator=g) * 0.02).to(dtype)
        able = [n for n, k in self.candidates.items() if k.supports(weight)]
        packs = {}
        for name in able:
            kernel = self.candidates[name]
            try:
                packs[name] = _packed_copies(kernel, weight, self.pool_bytes // max(1, len(able)))
            except RuntimeError as exc:  # a kernel that cannot pack this shape is no candidate
                logger.info("%s cannot pack %s: %s", name, shape_key(in_features, out_features, dtype), exc)
        result: dict = {name: {} for name in self.candidates}
        alive = sorted(packs)
        strikes = dict.fromkeys(alive, 0)
        last_ratio = dict.fromkeys(alive, 0.0)  # at the previous bucket, if hopeless there (else 0)
        with torch.inference_mode():
            for rows in sorted(buckets):
                x = torch.randn(rows, in_features, generator=g).to(dtype)
                for name in alive:  # warm-up: primitives built, threads started
                    self.candidates[name].linear(x, packs[name][0], None, out_features)
                # From _COMPUTE_ROWS rows on the GEMM is compute-bound: one copy is enough. Below, a
                # candidate far slower a call than the fastest one's whole pass (dequant-float,
                # torch's int8 kernel) is compute-bound too: its pass is cut to about
                # _PASS_SPREAD times the fastest pass. Its copies still come from memory, as the
                # others' passes stream the pool between two of its rounds.
                use = dict.fromkeys(alive, 1)
                if rows < _COMPUTE_ROWS and alive:
                    call = {}
                    for name in alive:
                        t0 = self.timer()
                        self.candidates[name].linear(x, packs[name][0], None, out_features)
                        call[name] = max(self.timer() - t0, 1e-9)
                    budget = _PASS_SPREAD * min(call[n] * len(packs[n]) for n in alive)
                    use = {n: max(1, min(len(packs[n]), math.ceil(budget / call[n]))) for n in alive}

                def one_pass(name: str, x=x, use=use):
                    # The path an engine step takes (arguments checked once a step, not per call).
                    run, packed = self.candidates[name].linear_verified, packs[name][: use[name]]
                    for p in packed:
                        run(x, p, None, out_features)
                    return len(packed)

                best = time_interleaved({n: functools.partial(one_pass, n) for n in alive}, _ROUNDS, self.timer)
                fastest = min(best.values()) if best else math.inf
                hopeless = set()
                for name, seconds in best.items():
                    result[name][rows] = seconds
                    far = rows >= _STRIKE_FROM and seconds > _TIMEOUT_RATIO * fastest
                    strikes[name] = strikes[name] + 1 if far else 0
                    ratio = seconds / fastest if fastest > 0 else 0.0
                    # (no closer: rounding in the summed seconds of many calls aside)
                    if ratio >= _HOPELESS_RATIO and last_ratio[name] and ratio >= last_ratio[name] * (1 - 1e-9):
                        hopeless.add(name)
                    last_ratio[name] = ratio if ratio >= _HOPELESS_RATIO else 0.0
                # Far slower twice in a row: no contender, unless the kernel says its relative speed
                # grows with the rows (``always_timed``: dequant-float, slow at few rows by design).
                alive = [
                    n
                    for n in alive
                    if (strikes[n] < 2 and n not in hopeless) or getattr(self.candidates[n], "always_timed", False)
                ]
        return result

    def choose(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        max_rows: int,
        allow_dual: bool = True,
        packed_only: bool = False,
        unpacked_partner: Optional[bool] = None,
    ) -> KernelChoice:
        """The choice for one shape class whose calls have at most ``max_rows`` rows (measuring it if
        needed). ``allow_dual``: whether a second kernel's copy may be kept (the caller checked the
        memory). ``packed_only``: ``F.linear`` cannot serve the shape alone (fused siblings: left
        unpacked they would be several calls, not the one timed; int8 weights), unless it is the
        only candidate. ``unpacked_partner``: whether ``F.linear`` may still serve the buckets it
        wins beside a packed kernel, over the unit's float weight (fused siblings: concatenated, one
        call as timed); default ``not packed_only`` (int8 weights pass False: the float weight
        gives other numbers)."""
        if unpacked_partner is None:
            unpacked_partner = not packed_only
        buckets = buckets_up_to(max_rows)
        times = self.timings(in_features, out_features, dtype, buckets)
        partner_times = times
        if packed_only and any(n != UNPACKED and not math.isinf(min(t.values())) for n, t in times.items()):
            times = {n: t for n, t in times.items() if n != UNPACKED}
        fastest = {b: min(t[b] for t in times.values()) for b in buckets}

        def score(name: str) -> float:
            """Geometric mean of the time relative to the fastest; a bucket where it was no longer
            timed (far too slow) counts as twice the cut-off; inf when it could not run at all."""
            ratios = [times[name][b] / fastest[b] for b in buckets]
            if all(math.isinf(r) for r in ratios):
                return math.inf
            return math.exp(sum(math.log(min(r, 2 * _TIMEOUT_RATIO)) for r in ratios) / len(ratios))

        ranked = sorted(times, key=lambda n: (score(n), n != UNPACKED))  # a tie: nothing packed
        first = ranked[0]
        per_bucket, kernels = [first] * len(buckets), (first,)
        others = [n for n in ranked[1:] if n != UNPACKED and not math.isinf(score(n))]
        if first != UNPACKED and unpacked_partner and UNPACKED in partner_times:
            # F.linear serves single-sequence decode best on some CPUs (a vendor GEMV streaming one
            # row at the copy bandwidth, where our kernels and oneDNN are tuned for many rows).
            others.append(UNPACKED)
        if allow_dual and others:
            # The second kernel: of those winning two buckets or the one-row bucket, the one winning
            # most (ranked order breaks ties), so a kernel chosen for its many-row times does not
            # serve decode where another one streams the weights faster.
            wins = {
                n: [
                    i
                    for i, b in enumerate(buckets)
                    if partner_times[n][b] <= (1 - self._margin(n, packed_only)) * partner_times[first][b]
                ]
                for n in others
            }
            serving = [n for n in others if len(wins[n]) >= 2 or (wins[n] and wins[n][0] == 0)]
            if serving:
                other = max(serving, key=lambda n: len(wins[n]))  # max keeps the first of equals
                for i in wins[other]:
                    per_bucket[i] = other
                kernels = (first, other)
        choice = KernelChoice(kernels, tuple(per_bucket), partner_times if unpacked_partner else times)
        self.choices[shape_key(in_features, out_features, dtype)] = choice
        return choice

    @staticmethod
    def _margin(name: str, fused: bool) -> float:
        """How much faster a second kernel must be at a bucket to serve it: :data:`DUAL_MARGIN`
        where it needs a copy of its own, :data:`FREE_DUAL_MARGIN` for ``F.linear`` over one
        module's own weight (no copy: only noise to guard against)."""
        return FREE_DUAL_MARGIN if name == UNPACKED and not fused else DUAL_MARGIN

    def kernel(self, choice: KernelChoice) -> Optional[GemmKernel]:
        """The kernel object serving a choice: a packed kernel, a ``DispatchGEMM`` over two, or None
        for ``F.linear``."""
        if choice.kernels == (UNPACKED,):
            return None
        if len(choice.kernels) == 1:
            return self.candidates[choice.kernels[0]]
        return DispatchGEMM([self.candidates[n] for n in choice.kernels], choice.table, ROW_BUCKETS)

    def report(self) -> str:
        """What was chosen per shape class, with each backend's ms per call at its timed buckets."""
        how = f"measured in {self.measured_seconds:.1f} s" if self.measured_seconds else "timings cached"
        if self.recheck_seconds:
            how += f", re-checked in {self.recheck_seconds:.2f} s"
            if self.rechecked:
                how += (
                    " (re-timed: "
                    + "; ".join(f"{k} rows {','.join(map(str, b))}" for k, b in self.rechecked.items())
                    + ")"
                )
        lines = [f"GEMM per shape ({how}, {self.threads} threads):"]
        for key, c in self.choices.items():
            cells = "; ".join(
                f"{n} " + " ".join("-" if math.isinf(s) else f"{1e3 * s:.3g}" for s in secs.values())
                for n, secs in c.seconds.items()
            )
            rows = ",".join(str(b) for b in next(iter(c.seconds.values())))
            lines.append(f"  {key}: {c.label}  (ms at rows {rows}: {cells})")
        return "\n".join(lines)
