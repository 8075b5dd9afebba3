"""Our GEMM (``hf_contbatch.kernels.linears.NativeGEMM``, ``cpu_gemm.c``) against arithmetic:
float64 products within the standard dot-product error bound, rows independent of the batch they
are in, columns independent of the panels packed beside them, any thread count and any vector width
the same bits; the instruction set the build reports is the one this CPU offers; the bfloat16 kernels
(VDPBF16PS on AVX512-BF16 CPUs, and widening to float32 in registers, also as a CPU without
AVX512-BF16 builds it: ``bf16=False`` on any CPU) within the bound of float32 accumulation and one
bf16 rounding; bfloat16 and float16 weights widened give the float32 kernel's bits on their widened
copy, rounded once, and agree with ``F.linear`` in float32 within the dot-product bound."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil

import pytest
import torch

from hf_contbatch.kernels.linears import NativeGEMM, NativePackedXGEMM
from hf_contbatch.kernels.linears.dispatch_gemm import DispatchGEMM
from hf_contbatch.kernels.linears.native_gemm import _GEMM_FLAGS, _GEMM_SOURCE
from hf_contbatch.kernels.native_build import build_library

EPS = 2.0**-24  # float32 unit roundoff


@pytest.fixture(scope="module")
def gemm():
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        # linear_backend="auto" then packs for oneDNN (tested in test_cpu_linear); .ci/run installs gcc.
        pytest.skip("no C compiler on this machine: our GEMM cannot be built")
    return NativeGEMM()  # raises if a compiler is here but the build fails


def _check_against_float64(y, x, w, b):
    """|y - x.W^T - b| <= K * eps * (|x|.|W|^T + |b|) elementwise (Higham, "Accuracy and Stability
    of Numerical Algorithms", 2nd ed., section 3.1: the bound gamma_K of a K-term dot product)."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    k = x.shape[-1] + 1
    assert ((y.double() - exact).abs() <= 1.01 * k * EPS * bound + 1e-30).all()


@pytest.mark.parametrize(
    "m", [1, 2, 3, 4, 5, 6, 7, 8, 13, 14, 15, 32, 97, 103, 200]
)  # 1-3: narrow; 7, 13-14: 7-row tiles
@pytest.mark.parametrize(("k", "n"), [(1, 1), (7, 3), (64, 16), (100, 33), (257, 130), (768, 1280)])
def test_products_match_float64_within_the_error_bound(gemm, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = gemm.pack(w)
    nr = gemm.library.nr
    assert packed.data.shape == (-(-n // nr), k, nr) and packed.shape == (n, k)
    for bias in (None, b):
        y = gemm.linear(x, packed, bias, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        _check_against_float64(y, x, w, bias)


def test_a_rows_result_does_not_depend_on_the_batch_it_runs_in(gemm):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g)
    packed = gemm.pack(w)
    x = torch.randn(150, 200, generator=g)
    alone = torch.cat([gemm.linear(x[i : i + 1], packed, None, 300) for i in range(150)])
    for m in (2, 3, 4, 6, 7, 8, 13, 14, 31, 96, 97, 103, 150):  # narrow (1-3), 7-row tiles (7, 13-14, 96+7)
        assert torch.equal(gemm.linear(x[:m], packed, None, 300), alone[:m])


def test_columns_packed_together_give_the_bits_they_give_apart(gemm):
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(n, 96, generator=g) for n in (40, 24, 24)]  # q/k/v-like, not panel multiples
    for m in (1, 3, 9):  # the narrow path groups panels, the general one does not
        x = torch.randn(m, 96, generator=g)
        fused = gemm.linear(x, gemm.pack(torch.cat(ws)), None, 88)
        apart = torch.cat([gemm.linear(x, gemm.pack(w), None, w.shape[0]) for w in ws], dim=1)
        assert torch.equal(fused, apart)


def test_thread_count_does_not_change_the_bits(gemm):
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(130, 64, generator=g), torch.randn(20, 64, generator=g)
    packed = gemm.pack(w)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(gemm.linear(x, packed, None, 130))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_rows_past_one_row_block_give_the_bits_they_give_alone_at_any_thread_count(gemm):
    # More rows than one block (96), and input features long enough (2,000) that a block holds
    # fewer rows (the block's x must stay in L2): every row of every block, with threads sharing
    # the panels, must equal the row multiplied alone and stay within the float64 bound.
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(70, 2000, generator=g), torch.randn(150, 2000, generator=g)
    packed = gemm.pack(w)
    alone = torch.cat([gemm.linear(x[i : i + 1], packed, None, 70) for i in range(150)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (97, 150):
                y = gemm.linear(x[:m], packed, None, 70)
                assert torch.equal(y, alone[:m])
    finally:
        torch.set_num_threads(before)
    _check_against_float64(alone, x, w, None)


def test_prefill_rows_with_x_packed_give_the_unpacked_tiles_bits_at_any_thread_count(gemm):
    # NativePackedXGEMM (AVX-512 builds): prefill row counts copy x into 14-row tiles and walk the
    # weights in chunks of panels (half of L2) with every row block passing over a chunk: several
    # chunks per thread (2,000 input features: a few panels a chunk), several row blocks, a last
    # block and a last tile shorter than the rest, a last panel of fewer columns. Each output is one
    # in-order FMA chain whichever tiles run it, so the bits must equal NativeGEMM's on the same packed
    # weight at 1, 2 and 3 threads, and stay within the float64 bound of a K-term dot product.
    if gemm.library.gemm_f32_packed_x is None:
        with pytest.raises(RuntimeError, match="packed-x"):
            NativePackedXGEMM()
        return
    packx = NativePackedXGEMM()
    assert packx.dtypes == (torch.float32,) and not packx.supports(torch.randn(4, 4).bfloat16())
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(333, 2000, generator=g), torch.randn(333, generator=g)
    packed = gemm.pack(w)
    assert packx.adopt(packed) is packed  # one copy serves both
    assert packx.adopt(NativeGEMM(half_isa="widen").pack(w.bfloat16())) is None
    before = torch.get_num_threads()
    try:
        for m in (1, 31, 32, 33, 47, 150, 301):  # below the packing threshold (32), at it, past it
            x = torch.randn(m, 2000, generator=g)
            torch.set_num_threads(2)
            ref = gemm.linear(x, packed, b, 333)
            _check_against_float64(ref, x, w, b)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(packx.linear(x, packed, b, 333), ref), (m, threads)
                assert torch.equal(packx.linear_verified(x, packed, packx.step_bias(b), 333), ref), (m, threads)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="does not fit"):
        packx.linear(torch.randn(40, 1999), packed, None, 333)
    # Timed beside NativeGEMM, each serving the row buckets it won: one packed copy for both.
    buckets = (1, 2, 4, 8, 16, 32, 64)
    both = DispatchGEMM([gemm, packx], table=(0, 0, 0, 0, 0, 1, 1), buckets=buckets)
    shared = both.pack(w)
    assert shared.data[1] is shared.data[0] and shared.nbytes == packed.nbytes
    x = torch.randn(40, 2000, generator=g)
    assert torch.equal(both.linear(x, shared, both.step_bias(b), 333), gemm.linear(x, packed, b, 333))


def test_empty_strided_and_batched_inputs(gemm):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(20, 12, generator=g)
    packed = gemm.pack(w)
    assert gemm.linear(torch.empty(0, 12), packed, None, 20).shape == (0, 20)
    bias = torch.randn(3, generator=g)
    no_features = gemm.linear(torch.empty(4, 0), gemm.pack(torch.empty(3, 0)), bias, 3)
    assert torch.equal(no_features, bias.expand(4, 3))  # an empty sum is zero
    wide = torch.randn(5, 24, generator=g)
    strided = wide[:, ::2]  # not contiguous
    _check_against_float64(gemm.linear(strided, packed, None, 20), strided, w, None)
    x3 = torch.randn(2, 3, 12, generator=g)
    y3 = gemm.linear(x3, packed, None, 20)
    assert y3.shape == (2, 3, 20)
    _check_against_float64(y3.reshape(6, 20), x3.reshape(6, 12), w, None)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def test_the_build_uses_the_widest_vectors_this_cpu_has_and_says_so(gemm):
    flags, machine = _cpu_flags(), platform.machine()
    if machine in ("x86_64", "AMD64") and flags:
        want = "avx512f" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "generic"
    elif machine in ("aarch64", "arm64"):
        want = "neon"
    else:
        pytest.skip(f"no expectation for {machine}")
    assert gemm.library.isa == want
    assert gemm.library.nr == (32 if want == "avx512f" else 16)  # two vectors of 16 or 8 floats
    # bfloat16 always (widened where VDPBF16PS is missing); float16 where vectors convert it (F16C)
    assert (gemm.library.gemm_bf16 is not None) == ("avx512_bf16" in flags and want == "avx512f")
    assert torch.bfloat16 in gemm.library.dtypes
    if want in ("avx512f", "avx2"):
        assert (torch.float16 in gemm.library.dtypes) == ("f16c" in flags)


def test_the_512_bit_build_gives_the_bits_of_the_256_bit_build(gemm):
    if gemm.library.isa != "avx512f":
        pytest.skip("this CPU has no AVX-512: there is one build")
    narrow = ctypes.CDLL(str(build_library(_GEMM_SOURCE, [*_GEMM_FLAGS, "-mno-avx512f"])))
    narrow.hf_contbatch_gemm_nr.restype = ctypes.c_int64
    nr = narrow.hf_contbatch_gemm_nr()
    assert nr == 16
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 300, generator=g)
    packed = torch.empty(-(-200 // nr), 300, nr)
    narrow.hf_contbatch_gemm_pack_f32(ctypes.c_void_p(w.data_ptr()), ctypes.c_int64(200), ctypes.c_int64(300),
                                      ctypes.c_void_p(packed.data_ptr()))  # fmt: skip
    wide = gemm.pack(w)
    for m in (1, 2, 3, 5, 7, 13, 40, 200):
        x = torch.randn(m, 300, generator=g)
        y = torch.empty(m, 200)
        narrow.hf_contbatch_gemm_f32(
            *map(ctypes.c_void_p, (x.data_ptr(),)), ctypes.c_int64(m), ctypes.c_int64(300),
            ctypes.c_void_p(packed.data_ptr()), ctypes.c_int64(200), None, ctypes.c_void_p(y.data_ptr()),
            ctypes.c_int64(torch.get_num_threads()),
        )  # fmt: skip
        assert torch.equal(gemm.linear(x, wide, None, 200), y), m


@pytest.fixture(scope="module", params=["detected", "widen", "without-avx512bf16"])
def bf16_gemm(request, gemm):
    """Our GEMM for bfloat16 weights as this CPU picks it (VDPBF16PS where it has AVX512-BF16, else
    widened), widened by request, and as a CPU without AVX512-BF16 builds it (forced here): every
    bf16 path runs on every CPU that has it."""
    flags = _cpu_flags()
    native_bf16 = {"avx512f", "avx512_bf16"} <= flags and platform.machine() in ("x86_64", "AMD64")
    if request.param == "detected":
        build = gemm
        assert build.half_isa == ("avx512_bf16" if native_bf16 else "widen")
    elif request.param == "widen":
        build = NativeGEMM(half_isa="widen")
    else:
        build = NativeGEMM(bf16=False)
        assert build.half_isa == "widen" and build.library.gemm_bf16 is None
    assert torch.bfloat16 in build.dtypes
    return build


def _check_bf16_against_float64(y, x, w, b):
    """float32 accumulation (the dot-product bound in float32) then one rounding to bf16 (relative
    2**-8, round to nearest)."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    k = x.shape[-1] + 1
    assert y.dtype == torch.bfloat16
    err = (y.double() - exact).abs()
    assert (err <= 2.0**-8 * exact.abs() * (1 + 1e-6) + 1.01 * k * EPS * bound * (1 + 2.0**-8) + 1e-30).all()


def _panel_shape(build, dtype, n, k):
    """The packed layout: VDPBF16PS pairs [P, k/2, 32, 2], else the float32 panels [P, k, nr]."""
    if dtype == torch.bfloat16 and build.half_isa == "avx512_bf16":
        return (-(-n // 32), k // 2, 32, 2)
    return (-(-n // build.library.nr), k, build.library.nr)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 97])
@pytest.mark.parametrize(("k", "n"), [(2, 1), (64, 33), (258, 130)])
def test_bf16_products_match_float64_within_the_bound(bf16_gemm, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = bf16_gemm.pack(w)
    assert packed.data.dtype == torch.bfloat16 and packed.data.shape == _panel_shape(bf16_gemm, w.dtype, n, k)
    assert torch.equal(bf16_gemm.unpack(packed), w)
    for bias in (None, b):
        _check_bf16_against_float64(bf16_gemm.linear(x, packed, bias, n), x, w, bias)
    alone = torch.cat([bf16_gemm.linear(x[i : i + 1], packed, None, n) for i in range(m)])
    assert torch.equal(bf16_gemm.linear(x, packed, None, n), alone)  # rows independent of the batch


def test_bf16_rows_past_one_row_block_give_the_bits_they_give_alone_at_any_thread_count(bf16_gemm):
    # As for float32: more rows than one block, long inputs (fewer rows a block), threads sharing panels.
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(70, 4000, generator=g).bfloat16(), torch.randn(150, 4000, generator=g).bfloat16()
    packed = bf16_gemm.pack(w)
    alone = torch.cat([bf16_gemm.linear(x[i : i + 1], packed, None, 70) for i in range(150)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (97, 150):
                assert torch.equal(bf16_gemm.linear(x[:m], packed, None, 70), alone[:m])
    finally:
        torch.set_num_threads(before)
    _check_bf16_against_float64(alone, x, w, None)


def test_bf16_pairs_need_an_even_number_of_input_features_widening_does_not(bf16_gemm):
    w = torch.randn(8, 7).bfloat16()
    if bf16_gemm.half_isa == "widen":  # one weight at a time: any width
        x = torch.randn(3, 7).bfloat16()
        _check_bf16_against_float64(bf16_gemm.linear(x, bf16_gemm.pack(w), None, 8), x, w, None)
    else:
        assert not bf16_gemm.supports(w)
        with pytest.raises(RuntimeError, match="cannot pack"):
            bf16_gemm.pack(w)
    packed = bf16_gemm.pack(torch.randn(8, 6).bfloat16())
    with pytest.raises(RuntimeError, match="does not fit"):
        bf16_gemm.linear(torch.randn(2, 6), packed, None, 8)  # float32 input for a bf16 weight


def test_a_half_isa_the_build_lacks_or_that_does_not_exist_is_refused(gemm):
    with pytest.raises(ValueError, match="half_isa"):
        NativeGEMM(half_isa="amx")
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        NativeGEMM(bf16=False, half_isa="avx512_bf16")


HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", params=["this-build", "without-avx512bf16"])
def widening(request, gemm):
    """The widening kernel of this CPU's build and of the build a CPU without AVX512-BF16 gets."""
    return NativeGEMM(half_isa="widen") if request.param == "this-build" else NativeGEMM(bf16=False)


def _half_or_skip(build, dtype):
    if dtype not in build.dtypes:
        assert dtype == torch.float16 and "f16c" not in _cpu_flags()  # float16 needs F16C (x86)
        pytest.skip("no vector float16 conversion on this CPU")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 10, 11, 48, 97])  # 1-3: narrow; 10-11: one and two tiles; 48+: widened once
@pytest.mark.parametrize(("k", "n"), [(1, 1), (7, 3), (130, 65), (960, 100)])
def test_widened_half_weights_give_the_float32_kernels_bits_on_their_widened_copy(widening, dtype, m, k, n):
    # Widening (bf16: a 16-bit shift, fp16: VCVTPH2PS) is exact, so the widening kernel computes the
    # float32 kernel's in-order FMA chains on the float32 values of x and W; only the output is
    # rounded, once, to the weight's dtype (round to nearest even, as Tensor.to does).
    _half_or_skip(widening, dtype)
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w, x = (torch.randn(n, k, generator=g) * 0.1).to(dtype), torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    packed = widening.pack(w)
    assert packed.data.dtype == dtype and packed.data.shape == _panel_shape(widening, dtype, n, k)
    assert torch.equal(widening.unpack(packed), w)
    f32 = widening.pack(w.float())
    for bias in (None, b):
        y = widening.linear(x, packed, bias, n)
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.equal(y, widening.linear(x.float(), f32, bias, n).to(dtype))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 3, 16, 200])
def test_widened_half_weights_agree_with_f_linear_in_float32_on_the_widened_values(widening, dtype, m):
    # F.linear (MKL/oneDNN: its own summation order) on the float32 values: the two differ by the
    # float32 dot-product bound (both within it of the exact sum) plus one rounding to the dtype.
    _half_or_skip(widening, dtype)
    g = torch.Generator().manual_seed(m)
    w, x = (torch.randn(1000, 768, generator=g) * 0.05).to(dtype), torch.randn(m, 768, generator=g).to(dtype)
    y = widening.linear(x, widening.pack(w), None, 1000).double()
    want = torch.nn.functional.linear(x.float(), w.float()).double()
    bound = x.double().abs() @ w.double().abs().T
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # half an ulp, relative
    assert ((y - want).abs() <= unit * want.abs() * (1 + 1e-6) + 2 * 1.01 * 769 * EPS * bound * (1 + unit)).all()


def test_half_precision_inputs_of_another_dtype_are_refused(widening):
    packed = widening.pack(torch.randn(8, 6).bfloat16())
    for x in (torch.randn(2, 6), torch.randn(2, 6).half()):
        with pytest.raises(RuntimeError, match="does not fit"):
            widening.linear(x, packed, None, 8)
