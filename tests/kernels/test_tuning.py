"""The one tuner of every timed kernel choice (``kernels.tuning.Tuner``): the GEMM per shape and the
compiled attention kernels against the torch path share it, its cache and its checks."""

from __future__ import annotations

import hashlib

import torch

from hf_contbatch.kernels import native_build
from hf_contbatch.kernels.attention import decode_choice
from hf_contbatch.kernels.attention.cpu_kernel import CPUDecodeKernel
from hf_contbatch.kernels.linears.autotune import KernelTuner
from hf_contbatch.kernels.tuning import Tuner, attention_choice_key, flat_table


def test_a_fixed_workload_keeps_its_fastest_candidate_measured_once_and_cached(tmp_path):
    path = str(tmp_path / "t.json")
    calls = []

    def measure():
        calls.append(1)
        return {"kernel": 3.0, "torch": 2.0}

    first = Tuner(("kernel", "torch"), path, recheck=False)
    assert first.fastest("decode 4/2x16", measure) == ("torch", {"kernel": 3.0, "torch": 2.0})
    again = Tuner(("kernel", "torch"), path, recheck=False)
    assert again.fastest("decode 4/2x16", measure)[0] == "torch" and len(calls) == 1  # read back
    assert again.measured_seconds == 0.0
    # A tie goes to the first candidate (the compiled kernel, as before the one tuner).
    assert Tuner(("kernel", "torch"), None).fastest("x", lambda: {"kernel": 1.0, "torch": 1.0})[0] == "kernel"


def test_the_gemm_tuner_is_the_one_tuner_and_its_cache_file_names_how_timings_are_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(native_build, "cache_dir", lambda: tmp_path)
    tuner = KernelTuner({}, measure=lambda i, o, d, bs: {"torch": dict.fromkeys(bs, 1.0)})
    assert isinstance(tuner.tuner, Tuner)
    # sha256 of CPU, torch, builds, threads and the timing's version: 2 since the weights timed
    # add up to twice the last-level cache (figures timed over a fixed 96 MiB are not read).
    text = "|".join([native_build.cpu_id(), torch.__version__, "torch:", str(torch.get_num_threads()), "timing:2"])
    assert tuner.cache_path == str(tmp_path / f"gemm_timings_{hashlib.sha256(text.encode()).hexdigest()[:16]}.json")
    tuner.choose(8, 4, torch.float32, 1)
    assert native_build.read_json(tuner.cache_path)["8x4:float32"] == {"torch": {"1": 1.0}}


def test_the_decode_attention_choice_goes_through_the_tuner(tmp_path, monkeypatch):
    kernel = CPUDecodeKernel()
    if not kernel.available:  # no C compiler: the choice is the torch path without timing
        assert "torch path" in decode_choice.choose_decode_path(kernel, 4, 2, 16, 16, torch.float32)
        return
    monkeypatch.setattr(native_build, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(decode_choice, "measure_decode_paths", lambda *a: {"kernel": 2.0, "torch": 1.0})
    line = decode_choice.choose_decode_path(kernel, 4, 2, 16, 16, torch.float32)
    assert not kernel.enabled and "torch path" in line
    (cached,) = tmp_path.glob("attention_timings_*.json")
    key = attention_choice_key("decode", 4, 2, 16, 16, torch.float32)
    assert native_build.read_json(cached)[key] == {"kernel": {"1": 2.0}, "torch": {"1": 1.0}}


def test_a_flat_table_is_disturbed_as_a_whole_and_re_timed_at_every_bucket():
    buckets = (1, 2, 4, 8, 16, 32, 64, 128)
    # Every call waited on the same scheduler tick: every candidate about 4 ms at every row count.
    flat = {"ours": dict.fromkeys(buckets, 4.0e-3), "F.linear": {b: 4.1e-3 for b in buckets}}
    # A GEMM's time grows with the rows (1 row streams the weight; 128 rows do 128x its arithmetic).
    real = {"ours": {b: 1e-4 * (1 + b / 4) for b in buckets}, "F.linear": {b: 1.3e-4 * (1 + b / 4) for b in buckets}}
    assert flat_table(flat) and not flat_table(real)
    # Plausible flat tables: decode buckets only (every candidate at the memory's speed), one candidate.
    assert not flat_table({n: {b: t[b] for b in (1, 2, 4, 8)} for n, t in flat.items()})
    assert not flat_table({"ours": flat["ours"]})
    # Candidates apart at some bucket: the table tells them apart, not flat.
    apart = {"ours": dict(flat["ours"]), "F.linear": dict(flat["F.linear"])}
    apart["ours"][64] = 2.0e-3
    assert not flat_table(apart)

    answers = [flat, real]
    timed = []

    def measure(bs):
        timed.append(list(bs))
        table = answers.pop(0)
        return {n: {b: t[b] for b in bs} for n, t in table.items()}

    tuner = Tuner(("ours", "F.linear"), None, recheck=False, what="GEMM")
    got = tuner.timings("960x960 float32", buckets, measure)
    assert timed == [list(buckets), list(buckets)]  # measured, found flat, every bucket re-timed
    assert got == real and tuner.rechecked == {"960x960 float32": list(buckets)}
