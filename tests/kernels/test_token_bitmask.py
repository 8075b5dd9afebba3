"""Our token-bitmask kernel (``hf_contbatch.kernels.token_bitmask``) against the definition: the
score of token ``t`` in row ``r`` becomes ``-inf`` exactly when bit ``t % 32`` of word ``t // 32`` of
the row's mask is 0 (unpacked here with torch arithmetic), for ``t < vocab_size``, in the listed rows
only; and against xgrammar's own kernel. Both builds (AVX-512 where the CPU has it, and the portable
loop) give the same scores."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from hf_contbatch.kernels.token_bitmask import TokenBitmaskKernel

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def kernels():
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler on this machine: xgrammar's kernel serves (tested with the engine)")
    native, portable = TokenBitmaskKernel(), TokenBitmaskKernel(extra_flags=("-mno-avx512f",))
    assert native._get() is not None and portable._get() is not None, (native.error, portable.error)
    return native, portable


def _expected(scores: torch.Tensor, bitmask: torch.Tensor, rows, vocab: int) -> torch.Tensor:
    """The definition, with torch arithmetic: unpack every word's 32 bits, low bit first."""
    out = scores.clone()
    shifts = torch.arange(32, dtype=torch.int64)
    for r in rows:
        bits = ((bitmask[r].to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & 1  # [words, 32]
        allowed = bits.reshape(-1)[:vocab].bool()
        out[r, :vocab] = torch.where(allowed, scores[r, :vocab], torch.tensor(float("-inf")))
    return out


def _random_mask(g, num_rows, words, density):
    """Words mixing all-allowed, all-refused and random bits, as a grammar's masks do."""
    words_bits = torch.randint(-(2**31), 2**31 - 1, (num_rows, words), dtype=torch.int32, generator=g)
    kind = torch.rand(num_rows, words, generator=g)
    words_bits[kind < density] = -1  # every bit set
    words_bits[kind > 0.9] = 0
    return words_bits


@pytest.mark.parametrize("vocab", [31, 32, 33, 4096, 4100, 49152, 151_936])
def test_a_score_becomes_minus_inf_exactly_where_its_bit_is_zero(kernels, vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    num_rows = 9
    bitmask = _random_mask(g, num_rows, words, density=0.5)
    scores = torch.randn(num_rows, vocab, generator=g)
    rows = [0, 2, 3, 7, 8]  # rows 1, 4, 5, 6 are not constrained this step: untouched
    want = _expected(scores, bitmask, rows, vocab)
    for kernel in kernels:
        got = scores.clone()
        assert kernel.apply(got, bitmask, rows, vocab)
        assert torch.equal(got, want), kernel.isa


def test_it_equals_xgrammars_kernel_on_a_padded_vocabulary_and_a_row_view(kernels):
    xgr = pytest.importorskip("xgrammar")  # part of [dev]: CI has it
    g = torch.Generator().manual_seed(1)
    vocab, padded = 4100, 4160  # the model's logits are wider than the tokenizer's vocabulary
    wide = torch.randn(6, padded + 40, generator=g)
    scores = wide[:, :padded]  # rows strided: a view of a wider buffer
    bitmask = _random_mask(g, 8, (vocab + 31) // 32 + 2, density=0.3)  # more rows and words than used
    rows = [5, 0, 3]
    want = scores.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask[:6], vocab_size=vocab, indices=rows)
    for kernel in kernels:
        got_buffer = wide.clone()
        got = got_buffer[:, :padded]
        assert kernel.apply(got, bitmask, rows, vocab)
        assert torch.equal(got, want), kernel.isa
        assert torch.equal(got_buffer[:, padded:], wide[:, padded:])  # beyond the view: untouched


def test_the_build_reports_the_vector_path_this_cpu_takes(kernels):
    native, portable = kernels
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        flags = set()
    assert native.isa == ("avx512f" if "avx512f" in flags else "generic")
    assert portable.isa == "generic"


def test_tensors_it_cannot_take_are_left_to_the_caller_unchanged(kernels):
    native, _ = kernels
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    for scores in (torch.randn(2, 128, dtype=torch.float64), torch.randn(128, 2).T):
        before = scores.clone()
        assert not native.apply(scores, bitmask, [0, 1], 128)
        assert torch.equal(scores, before)
    assert not native.apply(torch.randn(2, 128), bitmask.to(torch.int64), [0], 128)


def test_rows_or_a_vocabulary_out_of_range_are_refused_by_name(kernels):
    native, _ = kernels
    scores, bitmask = torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="rows must lie in"):
        native.apply(scores, bitmask, [2], 64)
    with pytest.raises(ValueError, match="vocab_size 96 exceeds"):
        native.apply(scores, bitmask, [0], 96)


def test_without_a_working_compiler_it_declines_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty kernel cache
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    kernel = TokenBitmaskKernel()
    scores = torch.randn(2, 64)
    before = scores.clone()
    with caplog.at_level("WARNING"):
        assert not kernel.serves(scores)
        assert not kernel.apply(scores, torch.zeros(2, 2, dtype=torch.int32), [0, 1], 64)
    assert torch.equal(scores, before)  # the caller (xgrammar's kernel) does the masking instead
    assert kernel.error is not None and kernel.isa is None
    assert sum("token-bitmask kernel unavailable" in r.getMessage() for r in caplog.records) == 1
