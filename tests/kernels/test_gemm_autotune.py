"""``linear_backend="auto"``: each shape's GEMM chosen from timings (``kernels/linears/autotune.py``).

The choice rules are specified with fixed timings (what a CPU measured is not this suite's business);
one test runs the real measurement and checks only its form.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_contbatch.kernels.linears import pack_linears
from hf_contbatch.kernels.linears.autotune import (
    ROW_BUCKETS,
    KernelTuner,
    bucket_index,
    buckets_up_to,
    copies_per_candidate,
    deciding_buckets,
    implausible_buckets,
    last_level_cache_bytes,
    robust_seconds,
    time_interleaved,
    timing_pool_bytes,
)
from hf_contbatch.kernels.linears.dispatch_gemm import DispatchGEMM
from hf_contbatch.kernels.linears.gemm_kernel import PackedWeight
from hf_contbatch.kernels.linears.registry import UNPACKED, available_kernels

from conftest import build_model


class _Recording:
    """A packed kernel that computes F.linear and records the row counts it served."""

    isa, build_id, dtypes, exact_unpack = "test", "", (torch.float32,), False

    def __init__(self, name):
        self.name, self.rows = name, []

    def supports(self, weight):
        return weight.dtype == torch.float32

    def pack(self, weight):
        return PackedWeight(weight.detach().clone(), tuple(weight.shape), weight.dtype)

    def unpack(self, packed):
        return packed.data

    def step_bias(self, bias):
        return None if bias is None else bias.detach()

    def linear(self, x, packed, bias, out_features):
        self.rows.append(x.numel() // x.shape[-1])
        return torch.nn.functional.linear(x, packed.data, bias)

    linear_verified = linear


def _fixed(table):
    """A measure function: ``table[name]`` is seconds per call, one number or ``{bucket: s}``."""

    def measure(in_features, out_features, dtype, buckets):
        out = {}
        for name, t in table.items():
            out[name] = {b: (t[b] if isinstance(t, dict) else t) for b in buckets}
        return out

    return measure


def _tuner(table, **kernels):
    kernels = kernels or {"a": _Recording("a"), "b": _Recording("b")}
    return KernelTuner(kernels, cache_path=None, measure=_fixed(table))


def test_row_buckets_cover_every_row_count():
    assert bucket_index(1) == 0 and bucket_index(2) == 1 and bucket_index(3) == 2 and bucket_index(1024) == 10
    assert bucket_index(5000) == len(ROW_BUCKETS) - 1
    assert buckets_up_to(48) == (1, 2, 4, 8, 16, 32, 64)  # 48 rows fall in the 64 bucket
    assert buckets_up_to(1) == (1,)


def test_the_lowest_geometric_mean_of_relative_times_wins():
    # Over the 8 buckets up to 128 rows: "a" takes 2x "b"'s time at 1-4 rows, 0.95x at 8-128.
    b_times = {b: (1.0 if b <= 4 else 2.0) for b in ROW_BUCKETS}
    a_times = {b: (2.0 if b <= 4 else 0.95) * b_times[b] for b in ROW_BUCKETS}
    tuner = _tuner({"a": a_times, "b": b_times, "torch": 10.0})
    choice = tuner.choose(64, 64, torch.float32, max_rows=128, allow_dual=False)
    score_a = (2.0**3) ** (1 / 8)  # relative to the fastest: 2 at three buckets, 1 at five
    score_b = (1 / 0.95) ** (5 / 8)  # 1 at three buckets, 1/0.95 at five
    assert score_b < score_a
    assert choice.kernels == ("b",) and choice.per_bucket == ("b",) * 8


def test_f_linear_winning_leaves_the_shape_unpacked_unless_it_is_a_fused_group():
    tuner = _tuner({"a": 2.0, "b": 3.0, "torch": 1.0})
    assert tuner.choose(64, 64, torch.float32, 16).kernels == ("torch",)
    assert tuner.kernel(tuner.choose(64, 64, torch.float32, 16)) is None
    assert tuner.choose(64, 192, torch.float32, 16, packed_only=True).kernels == ("a",)


def test_a_second_kernel_serves_the_buckets_it_wins_by_fifteen_percent_when_memory_allows():
    table = {"a": 1.0, "b": {b: (0.8 if b >= 256 else 1.5) for b in ROW_BUCKETS}, "torch": 9.0}
    tuner = _tuner(table)
    choice = tuner.choose(64, 64, torch.float32, max_rows=1024)
    assert choice.kernels == ("a", "b") and choice.label == "a+b"
    assert choice.per_bucket == ("a",) * 8 + ("b",) * 3
    assert tuner.choose(64, 64, torch.float32, max_rows=1024, allow_dual=False).kernels == ("a",)
    close = _tuner({"a": 1.0, "b": {b: (0.9 if b >= 256 else 1.5) for b in ROW_BUCKETS}, "torch": 9.0})
    assert close.choose(64, 64, torch.float32, max_rows=1024).kernels == ("a",)  # 10% is not worth a copy
    once = _tuner({"a": 1.0, "b": {b: (0.5 if b == 1024 else 1.5) for b in ROW_BUCKETS}, "torch": 9.0})
    assert once.choose(64, 64, torch.float32, max_rows=1024).kernels == ("a",)  # one bucket could be noise


def test_a_kernel_winning_one_row_serves_one_row_decode_even_when_it_loses_every_other_bucket():
    # "a" is fastest from 2 rows on; "c" (third by geometric mean) streams one row 40% faster: one
    # sequence's decode is the commonest call, and the one-row bucket is re-timed before trusting it.
    table = {
        "a": 1.0,
        "b": {b: (1.2 if b > 1 else 0.9) for b in ROW_BUCKETS},  # 10% faster at one row: not worth a copy
        "c": {b: (3.0 if b > 1 else 0.6) for b in ROW_BUCKETS},
        "torch": 9.0,
    }
    tuner = _tuner(table, a=_Recording("a"), b=_Recording("b"), c=_Recording("c"))
    choice = tuner.choose(64, 64, torch.float32, max_rows=1024)
    assert choice.kernels == ("a", "c") and choice.per_bucket == ("c",) + ("a",) * 10
    assert tuner.choose(64, 64, torch.float32, max_rows=1024, allow_dual=False).kernels == ("a",)
    # Of two kernels that may serve, the one winning more buckets: "d" wins rows 1-4, "c" only 1.
    table["d"] = {b: (0.7 if b <= 4 else 2.0) for b in ROW_BUCKETS}
    tuner = _tuner(table, a=_Recording("a"), b=_Recording("b"), c=_Recording("c"), d=_Recording("d"))
    choice = tuner.choose(64, 64, torch.float32, max_rows=1024)
    assert choice.kernels == ("a", "d") and choice.per_bucket == ("d",) * 3 + ("a",) * 8


def test_a_dispatching_gemm_runs_the_kernel_of_each_calls_row_bucket():
    a, b = _Recording("a"), _Recording("b")
    table = [0] * 8 + [1] * 3  # b from 129 rows on
    gemm = DispatchGEMM([a, b], table, ROW_BUCKETS)
    w = torch.randn(12, 8)
    packed = gemm.pack(w)
    assert isinstance(packed.data, tuple) and len(packed.data) == 2 and packed.shape == (12, 8)
    for rows in (1, 100, 128, 129, 700, 3000):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(gemm.linear(x, packed, None, 12), x @ w.T)
    assert a.rows == [1, 100, 128] and b.rows == [129, 700, 3000]


def test_timings_are_measured_once_and_read_back_from_the_cache(tmp_path):
    calls = []

    def measure(i, o, d, buckets):
        calls.append(tuple(buckets))
        return {"a": dict.fromkeys(buckets, 1.0), "torch": dict.fromkeys(buckets, 2.0)}

    path = str(tmp_path / "timings.json")
    first = KernelTuner({"a": _Recording("a")}, cache_path=path, measure=measure)
    assert first.choose(64, 32, torch.float32, max_rows=8).kernels == ("a",)
    assert first.choose(64, 32, torch.float32, max_rows=32).kernels == ("a",)  # only 16 and 32 measured
    assert calls == [(1, 2, 4, 8), (16, 32)]
    second = KernelTuner({"a": _Recording("a")}, cache_path=path, measure=measure)
    assert second.choose(64, 32, torch.float32, max_rows=32).kernels == ("a",)
    # read back, not measured again: only the cached choice's deciding buckets re-timed once
    assert calls[2:] == [(1, 2)] and second.measured_seconds == 0.0
    assert second.rechecked == {}  # the re-time agreed: the cache is kept
    assert "64x32:float32: a" in second.report()
    third = KernelTuner({"a": _Recording("a")}, cache_path=path, measure=measure)
    assert third.choose(64, 32, torch.float32, max_rows=32).kernels == ("a",)
    assert calls[3:] == [] and third.recheck_seconds == 0.0  # confirmed once: later starts re-time nothing


def test_auto_packs_each_shape_with_its_kernel_and_outputs_follow_f_linear():
    model = build_model("llama")
    a, b = _Recording("a"), _Recording("b")
    h = model.config.hidden_size
    inter = model.config.intermediate_size

    def measure(i, o, d, buckets):  # MLP down projection: b; LM head: F.linear; the rest: a
        if (i, o) == (inter, h):
            t = {"a": 2.0, "b": 1.0, "torch": 3.0}
        elif o == model.config.vocab_size:
            t = {"a": 2.0, "b": 3.0, "torch": 1.0}
        else:
            t = {"a": 1.0, "b": 2.0, "torch": 3.0}
        return {n: dict.fromkeys(buckets, s) for n, s in t.items()}

    tuner = KernelTuner({"a": a, "b": b}, cache_path=None, measure=measure)
    packed = pack_linears(model, "auto", fuse=True, max_rows=64, tuner=tuner)
    try:
        layer = model.model.layers[0]
        assert layer.mlp.down_proj.forward.kernel is b
        assert layer.self_attn.q_proj.forward.group.kernel is a  # q/k/v fused, tuned as one shape
        assert "forward" not in model.lm_head.__dict__  # F.linear won: left as it is
        assert packed.kernel_names == ("a", "b") and packed.label == "a+b"
        x = torch.randn(3, h)
        with torch.no_grad():
            torch.testing.assert_close(layer.mlp.down_proj(torch.randn(2, inter)).shape, torch.Size([2, h]))
            torch.testing.assert_close(
                layer.self_attn.k_proj(x), torch.nn.functional.linear(x, layer.self_attn.k_proj.weight)
            )
        assert b.rows and a.rows  # both served calls (the probes at least)
    finally:
        packed.restore()


@pytest.mark.timeout(600)
def test_the_real_measurement_times_every_available_kernel_at_every_bucket(tmp_path):
    tuner = KernelTuner(available_kernels(), cache_path=str(tmp_path / "t.json"))
    for dtype in (torch.float32, torch.bfloat16):
        choice = tuner.choose(96, 80, dtype, max_rows=16)
        assert set(choice.seconds) == set(tuner.candidates)
        for name, by_bucket in choice.seconds.items():
            assert list(by_bucket) == [1, 2, 4, 8, 16]
            if not tuner.candidates[name].supports(torch.zeros(80, 96, dtype=dtype)):
                assert all(math.isinf(s) for s in by_bucket.values()), (name, by_bucket)  # not a candidate
                continue
            # Seconds per call: positive, and finite where the kernel was timed (all of them at 1 row).
            assert all(s > 0 for s in by_bucket.values()) and math.isfinite(by_bucket[1]), (name, by_bucket)
        assert set(choice.kernels) <= set(tuner.candidates)
    # bfloat16 weights: our kernel as this CPU picks it, and widened where that is VDPBF16PS
    native = tuner.candidates["native"]
    assert native.supports(torch.zeros(80, 96, dtype=torch.bfloat16))
    assert ("native-widen" in tuner.candidates) == (native.half_isa == "avx512_bf16")
    # float32 prefill rows with x packed: a candidate where the build has those tiles (AVX-512)
    assert ("native-packx" in tuner.candidates) == (native.library.gemm_f32_packed_x is not None)
    assert tuner.measured_seconds > 0


def test_the_registry_names_every_linear_backend_but_auto_and_each_kernel_keeps_the_protocol():
    from hf_contbatch.config import LINEAR_BACKENDS, QUANTIZATIONS, TORCHAO_INT8, quant_scheme
    from hf_contbatch.kernels.linears import KERNELS, GemmKernel
    from hf_contbatch.kernels.linears.registry import forced_quantized_kernel, quantized_kernels

    assert set(LINEAR_BACKENDS) == {"auto", *KERNELS}
    # Every quantization has kernels, and a forced backend names one of that quantization's.
    for scheme in [*(quant_scheme(q) for q in QUANTIZATIONS), TORCHAO_INT8]:
        kernels = quantized_kernels(scheme)
        assert kernels and {forced_quantized_kernel(scheme, b) for b in ("native", "torch")} <= set(kernels)
        with pytest.raises(ValueError, match=f"linear_backend='onednn' has no {scheme.label} kernel"):
            forced_quantized_kernel(scheme, "onednn")
    for name, kernel in available_kernels().items():
        assert kernel.name == name and isinstance(kernel, GemmKernel)
        dtype = kernel.dtypes[0]  # float32 ("native-packx": only), or bfloat16 for "native-widen" (bf16 only)
        w = torch.randn(40, 24).to(dtype)
        packed = kernel.pack(w)
        size = dtype.itemsize
        assert packed.shape == (40, 24) and packed.dtype == dtype and packed.nbytes >= w.numel() * size
        if kernel.exact_unpack:
            assert torch.equal(kernel.unpack(packed), w)  # bit for bit: the float weight may be released


def test_robust_seconds_is_the_fastest_round_so_load_elsewhere_hitting_most_rounds_does_not_move_it():
    # Load only adds time to fixed work: one undisturbed round is enough.
    assert robust_seconds([1.0, 1.1, 50.0, 0.9, 1.05]) == 0.9
    assert robust_seconds([7.0, 1.0, 9.0, 8.0]) == 1.0  # three of four rounds disturbed
    assert math.isinf(robust_seconds([]))


class _FakeClock:
    """A clock that advances only when a candidate 'runs': each call adds that candidate's cost,
    plus a burst of load during one given (round, candidate) slot."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_candidates_are_timed_round_robin_and_a_burst_hits_one_round_of_one_candidate():
    clock, order = _FakeClock(), []
    cost = {"a": 1.0, "b": 2.0, "c": 3.0}
    burst_at = 4  # the 5th candidate run overall is slowed by 100 s (load elsewhere)

    def run(name, calls):
        def go():
            order.append(name)
            clock.now += cost[name] * calls + (100.0 if len(order) == burst_at + 1 else 0.0)
            return calls

        return go

    seconds = time_interleaved({n: run(n, 4) for n in cost}, rounds=5, timer=clock)
    # round r starts at candidate r mod 3: a, b, c / b, c, a / c, a, b / a, b, c / b, c, a
    assert order == list("abcbcacababcbca")
    assert seconds == {"a": 1.0, "b": 2.0, "c": 3.0}  # per call; the burst (c's 2nd run) is outvoted


def test_a_bucket_far_slower_than_a_larger_one_is_flagged_as_disturbed():
    assert implausible_buckets({1: 6.3e-3, 2: 0.22e-3, 4: 0.25e-3}) == [1]
    assert implausible_buckets({1: 1.0, 2: 1.2, 4: 2.5}) == []
    assert implausible_buckets({1: math.inf, 2: 1.0}) == []


def test_the_deciding_buckets_are_the_smallest_and_the_closest_race():
    times = {"a": {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, "b": {1: 3.0, 2: 1.05, 4: 2.0, 8: 1.5}}
    assert deciding_buckets(times) == [1, 2]
    assert deciding_buckets(times, most=3) == [1, 2, 8]


class _Costly(_Recording):
    """A packed kernel whose call advances ``clock`` by ``cost(rows)`` seconds (a fake clock:
    timings are exact whatever else the machine runs)."""

    def __init__(self, name, clock, cost):
        super().__init__(name)
        self.clock, self.cost = clock, cost

    def linear(self, x, packed, bias, out_features):
        self.clock.now += self.cost(x.numel() // x.shape[-1])
        return torch.nn.functional.linear(x, packed.data, bias)

    linear_verified = linear


def _step(small, large):
    """``small`` seconds a call below 64 rows, ``large`` from 64 on."""
    return lambda rows: small if rows < 64 else large


def _affine(base, per_row):
    """``base + per_row * rows`` seconds a call."""
    return lambda rows: base + per_row * rows


def _costly_tuner(**costs):
    clock = _FakeClock()
    kernels = {n: _Costly(n, clock, c) for n, c in costs.items() if n != UNPACKED}
    tuner = KernelTuner(kernels, cache_path=None, timer=clock)
    tuner.candidates[UNPACKED] = _Costly(UNPACKED, clock, costs[UNPACKED])  # not this CPU's F.linear
    return tuner


def test_a_kernel_far_slower_at_decode_rows_is_still_timed_at_prefill_rows():
    # 10x slower at 1-2 rows (or timed so under load), 10x faster from 64 rows: it must be timed
    # (and win) there, not left out after two slow small buckets.
    tuner = _costly_tuner(dec=_step(1.0, 10.0), pre=_step(10.0, 1.0), torch=_step(5.0, 5.0))
    times = tuner.measure(64, 32, torch.float32, [1, 2, 64])
    assert times["pre"] == {1: 10.0, 2: 10.0, 64: 1.0}


def test_a_kernel_far_slower_at_two_prefill_buckets_is_not_timed_at_larger_ones():
    tuner = _costly_tuner(fast=_step(1.0, 1.0), slow=_step(10.0, 10.0), torch=_step(1.0, 1.0))
    times = tuner.measure(64, 32, torch.float32, [64, 128, 256])
    assert times["slow"] == {64: 10.0, 128: 10.0}  # left out at 256
    assert times["fast"] == {64: 1.0, 128: 1.0, 256: 1.0}


def test_a_kernel_hopelessly_slower_at_two_small_buckets_and_no_closer_is_not_timed_at_larger_ones():
    # "scalar" costs 20 per row where "fast" costs 1: 20x slower at every bucket
    # and no closer as rows grow; "overhead" is 20x slower at 1 row by a fixed cost per call, and
    # gets closer as rows grow (11x at 2 rows... fastest from 64): it is still timed at every bucket.
    tuner = _costly_tuner(
        fast=_affine(0.0, 1.0), scalar=_affine(0.0, 20.0), overhead=_affine(20.0, 0.1), torch=_affine(0.0, 2.0)
    )
    times = tuner.measure(64, 32, torch.float32, [1, 2, 4, 8, 64])
    assert times["scalar"] == pytest.approx({1: 20.0, 2: 40.0})  # 20x at 1 and at 2 rows: left out from 4 rows
    assert times["overhead"] == pytest.approx({1: 20.1, 2: 20.2, 4: 20.4, 8: 20.8, 64: 26.4})
    assert times["fast"] == pytest.approx({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 64: 64.0})


def _cache_with(path, table):
    """A timings file as a first (noisy) run left it: ``table[name][bucket]`` seconds."""
    tuner = KernelTuner({"a": _Recording("a"), "b": _Recording("b")}, cache_path=path, measure=_fixed(table))
    tuner.choose(64, 32, torch.float32, max_rows=4, allow_dual=False)


def test_a_cached_choice_the_re_time_contradicts_is_replaced_and_the_cache_updated(tmp_path):
    path = str(tmp_path / "t.json")
    # The first run was disturbed while "a" ran at 1 and 2 rows (not implausible: uniform).
    _cache_with(path, {"a": {1: 2.0, 2: 2.0, 4: 2.0}, "b": {1: 1.5, 2: 1.5, 4: 1.5}, "torch": 9.0})
    calls = []
    truth = {"a": 1.0, "b": 1.5, "torch": 9.0}

    def measure(i, o, d, buckets):
        calls.append(tuple(buckets))
        return {n: dict.fromkeys(buckets, t) for n, t in truth.items()}

    tuner = KernelTuner({"a": _Recording("a"), "b": _Recording("b")}, cache_path=path, measure=measure)
    choice = tuner.choose(64, 32, torch.float32, max_rows=4, allow_dual=False)
    assert calls == [(1, 2)]  # the smallest bucket and the closest race, nothing else
    assert tuner.rechecked == {"64x32:float32": [1, 2]}
    assert choice.per_bucket[:2] == ("a", "a")
    # the next process reads the corrected figures
    again = KernelTuner({"a": _Recording("a"), "b": _Recording("b")}, cache_path=path, measure=measure, recheck=False)
    assert again.timings(64, 32, torch.float32, (1, 2))["a"] == {1: 1.0, 2: 1.0}


def test_a_re_time_within_the_margin_keeps_the_cached_choice(tmp_path):
    path = str(tmp_path / "t.json")
    _cache_with(path, {"a": 1.0, "b": 1.04, "torch": 9.0})
    # re-time: "b" ahead by 5% only (noise-sized): the cache stands
    measure = _fixed({"a": 1.0, "b": 0.95, "torch": 9.0})
    tuner = KernelTuner({"a": _Recording("a"), "b": _Recording("b")}, cache_path=path, measure=measure)
    assert tuner.choose(64, 32, torch.float32, max_rows=4, allow_dual=False).kernels == ("a",)
    assert tuner.rechecked == {}


def test_disturbed_figures_are_re_timed_even_when_just_measured():
    calls = []

    def measure(i, o, d, buckets):
        calls.append(tuple(buckets))
        first = len(calls) == 1
        return {
            "a": {b: (6.3 if first and b == 1 else 0.2) for b in buckets},
            "b": dict.fromkeys(buckets, 0.5),
            "torch": dict.fromkeys(buckets, 9.0),
        }

    tuner = KernelTuner({"a": _Recording("a"), "b": _Recording("b")}, cache_path=None, measure=measure)
    choice = tuner.choose(64, 32, torch.float32, max_rows=4, allow_dual=False)
    assert calls == [(1, 2, 4), (1,)]
    assert choice.kernels == ("a",) and choice.seconds["a"][1] == 0.2


def _sysfs_cache(root, entries):
    """A fake ``/sys/devices/system/cpu/cpu0``: ``entries`` is ``[(level, type, size), ...]``."""
    for i, (level, kind, size) in enumerate(entries):
        d = root / "cache" / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return str(root)


def test_the_last_level_cache_size_is_read_from_sysfs(tmp_path):
    # The 2-core Xeon this was written on: L1d 48K, L1i 64K, L2 2048K, L3 480 MiB (one instance).
    cpu = _sysfs_cache(
        tmp_path / "xeon",
        [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"), (3, "Unified", "491520K")],
    )
    assert last_level_cache_bytes(cpu) == 480 * 2**20
    # No L3: the L2 is the last level; an instruction cache is never it; "M" sizes read too.
    assert last_level_cache_bytes(_sysfs_cache(tmp_path / "l2", [(1, "Data", "32K"), (2, "Unified", "1M")])) == 2**20
    assert last_level_cache_bytes(_sysfs_cache(tmp_path / "i", [(1, "Instruction", "64K")])) is None
    assert last_level_cache_bytes(str(tmp_path / "nothing")) is None  # no sysfs: unknown


def test_the_timing_pool_is_twice_the_last_level_cache_within_bounds():
    mib = 2**20
    assert timing_pool_bytes(480 * mib) == 960 * mib  # 480 MiB L3: a 96 MiB pass stayed cached
    assert timing_pool_bytes(32 * mib) == 96 * mib  # never less than the former fixed pass
    assert timing_pool_bytes(None) == 96 * mib  # unknown size: the former fixed pass
    assert timing_pool_bytes(1536 * mib) == 1024 * mib  # bounded memory: at most 1 GiB of copies
    # Each of 3 candidates holds a third of 960 MiB: 335,544,320 bytes over a 960x5120 float32
    # weight (19,660,800 bytes) is 17.07: 18 copies.
    assert copies_per_candidate(960 * 5120 * 4, 3, 960 * mib) == 18
    assert copies_per_candidate(960 * 960 * 2, 4, 960 * mib) == 64  # small weights: at most 64 calls a pass
    assert copies_per_candidate(2 * 2**30, 3, 960 * mib) == 1  # a weight larger than its share: one


def test_f_linear_serves_the_buckets_it_wins_beside_a_packed_kernel():
    # One module: F.linear reads the module's own weight (no copy), so 5% faster is enough.
    near = {b: (0.94 if b == 1 else 3.0) for b in ROW_BUCKETS}
    tuner = _tuner({"a": 1.0, "b": 2.0, "torch": near})
    choice = tuner.choose(64, 64, torch.float32, max_rows=1024)
    assert choice.kernels == ("a", "torch") and choice.per_bucket == ("torch",) + ("a",) * 10
    gemm = tuner.kernel(choice)
    assert isinstance(gemm, DispatchGEMM) and gemm.names == ("a", "torch")
    assert tuner.choose(64, 64, torch.float32, max_rows=1024, allow_dual=False).kernels == ("a",)
    noise = _tuner({"a": 1.0, "b": 2.0, "torch": {b: (0.97 if b == 1 else 3.0) for b in ROW_BUCKETS}})
    assert noise.choose(64, 64, torch.float32, max_rows=1024).kernels == ("a",)  # 3%: noise-sized
    # Fused siblings: F.linear needs the concatenated weight, a copy: 15% like any second kernel.
    fused = _tuner({"a": 1.0, "b": 2.0, "torch": near})
    assert fused.choose(64, 192, torch.float32, 1024, packed_only=True).kernels == ("a",)
    far = {b: (0.8 if b == 1 else 3.0) for b in ROW_BUCKETS}
    fused = _tuner({"a": 1.0, "b": 2.0, "torch": far})
    choice = fused.choose(64, 192, torch.float32, 1024, packed_only=True, unpacked_partner=True)
    assert choice.kernels == ("a", "torch") and choice.per_bucket[:2] == ("torch", "a")
    # int8 weights (unpacked_partner False, the default with packed_only): F.linear never serves.
    assert fused.choose(64, 192, torch.float32, 1024, packed_only=True).kernels == ("a",)


def test_a_fused_group_served_by_f_linear_at_one_row_computes_its_siblings_outputs():
    model = build_model("llama")
    a = _Recording("a")
    h = model.config.hidden_size
    attn = model.model.layers[0].self_attn
    qkv = attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features

    def measure(i, o, d, buckets):  # the fused q/k/v: F.linear 30% faster at one row only
        torch_times = {b: (0.7 if (i, o) == (h, qkv) and b == 1 else 3.0) for b in buckets}
        return {"a": dict.fromkeys(buckets, 1.0), "torch": torch_times}

    tuner = KernelTuner({"a": a}, cache_path=None, measure=measure)
    packed = pack_linears(model, "auto", fuse=True, max_rows=64, tuner=tuner)
    try:
        group = attn.q_proj.forward.group
        assert isinstance(group.kernel, DispatchGEMM) and group.kernel.names == ("a", "torch")
        with torch.no_grad():
            for rows in (1, 3):
                x = torch.randn(rows, h)
                a.rows.clear()
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    torch.testing.assert_close(proj(x), torch.nn.functional.linear(x, proj.weight))
                assert (a.rows == []) == (rows == 1), (rows, a.rows)  # F.linear served the one row
    finally:
        packed.restore()


def test_a_candidate_far_slower_a_call_is_timed_over_fewer_copies_and_the_same_seconds_a_call():
    # A 64x32 float32 weight (8 KiB): 64 copies each (the most a pass makes). "slow" takes 10x the
    # fast one's time a call: its pass is cut to about twice the fastest pass, ceil(2 * 64 / 10) = 13
    # calls; each call still counts once (seconds per call unchanged).
    tuner = _costly_tuner(fast=_affine(1.0, 0.0), slow=_affine(10.0, 0.0), torch=_affine(1.0, 0.0))
    calls = {}
    for name, kernel in tuner.candidates.items():
        kernel.cost = lambda rows, name=name, c=kernel.cost: calls.update({name: calls.get(name, 0) + 1}) or c(rows)
    times = tuner.measure(64, 32, torch.float32, [1])
    assert times["slow"] == {1: pytest.approx(10.0)} and times["fast"] == {1: pytest.approx(1.0)}
    # warm-up, the probe of the time a call, then 5 rounds
    assert calls["slow"] == 2 + 5 * 13 and calls["fast"] == 2 + 5 * 64
