"""The weight-only int8 kernels against a plain-torch reference: ``F.linear(x, Wq * s)`` with
``s = absmax(row) / 127`` and ``Wq = round(W / s).clamp(-127, 127)`` (torchao's int8 weight-only
scheme), at decode and prefill row counts, odd sizes, with and without a bias."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from hf_contbatch.config import quant_scheme
from hf_contbatch.kernels.linears.int8_gemm import (
    MAX_W8A8_IN_FEATURES,
    W8A8GEMM,
    DequantFloatGEMM,
    NativeInt8GEMM,
    NativeInt8MovsxGEMM,
    TorchInt8GEMM,
    int8_library,
    vnni_scratch_bytes,
)
from hf_contbatch.kernels.linears.registry import available_quantized_kernels

pytestmark = pytest.mark.timeout(600)


def _reference(x, w, b):
    s = w.abs().amax(1, keepdim=True) / 127
    wq = (w / s).round().clamp(-127, 127)
    return torch.nn.functional.linear(x, wq * s, b)


def _kernels():
    return list(available_quantized_kernels(quant_scheme("int8")).values())


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("n,k", [(33, 64), (40, 70), (128, 96), (16, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernels_equal_the_dequantized_reference(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    want = _reference(x, w, b)
    for kernel in _kernels():
        packed = kernel.pack(w)
        assert packed.scales is not None and packed.shape == (n, k)
        got = kernel.linear(x, packed, b, n)
        # Same products, only the rounding order differs (scale after the sum).
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        verified = kernel.linear_verified(x, packed, kernel.step_bias(b), n)
        torch.testing.assert_close(verified, got, rtol=0, atol=0)


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 64, generator=g), torch.randn(11, 64, generator=g)
    kernel = NativeInt8GEMM()
    packed = kernel.pack(w)
    whole = kernel.linear(x, packed, None, 48)
    for i in range(11):
        assert torch.equal(kernel.linear(x[i : i + 1], packed, None, 48)[0], whole[i])


def test_three_dimensional_inputs_and_zero_rows():
    w = torch.randn(24, 32)
    for kernel in _kernels():
        packed = kernel.pack(w)
        x = torch.randn(2, 3, 32)
        assert torch.allclose(kernel.linear(x, packed, None, 24), _reference(x, w, None), atol=1e-4)
        assert kernel.linear(torch.randn(0, 32), packed, None, 24).shape == (0, 24)


def test_bad_inputs_raise_instead_of_reading_memory():
    kernel = NativeInt8GEMM()
    packed = kernel.pack(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.linear(torch.randn(2, 31), packed, None, 16)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.linear(torch.randn(2, 32, dtype=torch.float64), packed, None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(2, 32), packed, torch.randn(15), 16)


def test_torch_int8_bf16_only_where_its_kernel_is_safe():
    kernel = TorchInt8GEMM()
    assert kernel.supports(torch.randn(8, 64).bfloat16())
    assert not kernel.supports(torch.randn(8, 70).bfloat16())  # aten's bf16 path crashes there
    assert not NativeInt8GEMM().supports(torch.randn(8, 64).bfloat16())
    w = torch.randn(40, 128).bfloat16()
    x = torch.randn(5, 128).bfloat16()
    s = w.float().abs().amax(1, keepdim=True).div(127).bfloat16().float()
    want = torch.nn.functional.linear(x.float(), (w.float() / s).round().clamp(-127, 127) * s)
    got = kernel.linear(x, kernel.pack(w), None, 40).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_zero_rows_of_the_weight_give_zero_outputs():
    w = torch.randn(16, 32)
    w[3] = 0
    for kernel in _kernels():
        out = kernel.linear(torch.randn(4, 32), kernel.pack(w), None, 16)
        assert torch.isfinite(out).all() and torch.equal(out[:, 3], torch.zeros(4))


def test_tensor_subclass_weights_are_never_float_eligible():
    from hf_contbatch.kernels.linears.linear_units import eligible

    class Sub(torch.Tensor):
        pass

    lin = torch.nn.Linear(8, 4)
    assert eligible(lin)
    lin.weight = torch.nn.Parameter(torch.randn(4, 8).as_subclass(Sub))
    assert not eligible(lin)


@pytest.mark.parametrize("rows", [1, 2, 5, 31, 64, 100, 300])
# One tile; 1024 + 76 columns; 64 + 64 + 2 (the 2 MiB default tile is 64 columns at 9000 inputs).
@pytest.mark.parametrize("n,k", [(37, 53), (1100, 24), (130, 9000)])
@pytest.mark.parametrize("bias", [False, True])
def test_dequant_float_equals_the_dequantized_reference(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    want = _reference(x, w, b)
    kernel = DequantFloatGEMM()
    packed = kernel.pack(w)
    assert packed.data.dtype == torch.int8 and packed.data.shape == (n, k) and packed.scales.dtype == torch.float32
    got = kernel.linear(x, packed, b, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert torch.equal(kernel.linear_verified(x, packed, kernel.step_bias(b), n), got)


@pytest.mark.parametrize("rows", [1, 3, 40, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_dequant_float_bf16_equals_the_bf16_dequantized_reference(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(700, 70, generator=g).bfloat16()  # in_features not a multiple of 64
    b = torch.randn(700, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 70, generator=g).bfloat16()
    # The weight in bf16 as plain torch rounds it: scales rounded to bf16, Wq * s rounded to bf16.
    s = w.float().abs().amax(1, keepdim=True).div(127).bfloat16().float()
    wq = ((w.float() / s).round().clamp(-127, 127) * s).bfloat16()
    want = torch.nn.functional.linear(x.float(), wq.float(), None if b is None else b.float())
    kernel = DequantFloatGEMM(tile_bytes=64 * 70 * 4)  # 64-column tiles: 11 of them, the last short
    got = kernel.linear(x, kernel.pack(w), b, 700)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 700)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_dequant_float_tiles_stay_bounded_and_refuse_bad_inputs():
    kernel = DequantFloatGEMM()
    assert kernel.tile_columns(768) == 2 * 2**20 // (4 * 768) // 16 * 16
    assert kernel.tile_columns(10**6) == 64 and kernel.tile_columns(1) == 1024
    with pytest.raises(ValueError, match="tile_bytes"):
        DequantFloatGEMM(tile_bytes=0)
    packed = kernel.pack(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.linear(torch.randn(2, 31), packed, None, 16)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.linear(torch.randn(2, 32).bfloat16(), packed, None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(2, 32), packed, torch.randn(15), 16)
    assert not kernel.supports(torch.randn(4, 4, dtype=torch.float64))


def test_dispatch_serves_native_int8_at_few_rows_and_dequant_float_at_many():
    from hf_contbatch.kernels.linears.autotune import ROW_BUCKETS
    from hf_contbatch.kernels.linears.dispatch_gemm import DispatchGEMM

    # Tiles of 64 columns: with panels of 32 or 64 columns, a 90-column weight is served in two
    # tiles, the last one a partial panel.
    kernels = [NativeInt8GEMM(), DequantFloatGEMM(tile_bytes=64 * 4 * 48)]
    table = [0 if b < 64 else 1 for b in ROW_BUCKETS]
    dispatch = DispatchGEMM(kernels, table, ROW_BUCKETS)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(90, 48, generator=g), torch.randn(90, generator=g)
    packed = dispatch.pack(w)
    native, dequant = packed.data
    # One int8 copy, read by both kernels: a byte a weight (native-int8 pads to panels of nr
    # columns: 64 with AVX-512, 32 with 256-bit vectors; 90 columns pad to 128 here), a float32
    # scale a column, and dequant-float's scales padded to whole panels.
    assert dequant.data is native.data and native.data.dtype == torch.int8
    nr = int8_library().nr
    assert nr in (32, 64)
    padded = -(-90 // nr) * nr
    assert native.nbytes == padded * 48 + 4 * 90 and dequant.nbytes == padded * 48 + 4 * padded
    assert packed.nbytes == padded * 48 + 4 * 90 + 4 * padded < w.numel() * w.element_size()
    # Alone, dequant-float keeps its own row-major copy.
    assert DequantFloatGEMM().pack(w).nbytes == 90 * 48 + 4 * 90
    for rows in (1, 7, 64, 200):
        x = torch.randn(rows, 48, generator=g)
        got = dispatch.linear(x, packed, dispatch.step_bias(b), 90)
        torch.testing.assert_close(got, _reference(x, w, b), rtol=1e-5, atol=1e-4)
        want_kernel = kernels[table[next(i for i, bk in enumerate(ROW_BUCKETS) if rows <= bk)]]
        alone = want_kernel.linear_verified(x, packed.data[kernels.index(want_kernel)], want_kernel.step_bias(b), 90)
        assert torch.equal(got, alone)
    # Inside a compiled graph dequant-float dequantizes the whole shared weight at once.
    x = torch.randn(5, 48, generator=g)
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        whole = kernels[1].linear_verified(x, dequant, b, 90)
    torch.testing.assert_close(whole, _reference(x, w, b), rtol=1e-5, atol=1e-4)


def test_the_two_widenings_dispatched_share_one_int8_copy():
    from hf_contbatch.kernels.linears.autotune import ROW_BUCKETS
    from hf_contbatch.kernels.linears.dispatch_gemm import DispatchGEMM

    shift, movsx = NativeInt8GEMM(), NativeInt8MovsxGEMM()
    table = [1 if b == 1 else 0 for b in ROW_BUCKETS]  # movsx at one row, the shifts beyond
    dispatch = DispatchGEMM([shift, movsx], table, ROW_BUCKETS)
    g = torch.Generator().manual_seed(8)
    w, b = torch.randn(130, 70, generator=g), torch.randn(130, generator=g)
    packed = dispatch.pack(w)
    assert packed.data[0] is packed.data[1] and packed.nbytes == shift.pack(w).nbytes
    for rows in (1, 2, 7, 16):
        x = torch.randn(rows, 70, generator=g)
        got = dispatch.linear(x, packed, dispatch.step_bias(b), 130)
        torch.testing.assert_close(got, _reference(x, w, b), rtol=1e-5, atol=1e-5 * float(got.abs().max()))
        assert torch.equal(got, shift.linear(x, packed.data[0], b, 130))
    # Copies of another layout or build are not adopted (packed again instead).
    assert shift.adopt(DequantFloatGEMM().pack(w)) is None and shift.adopt(W8A8GEMM().pack(w)) is None
    assert shift.adopt(TorchInt8GEMM().pack(w)) is None


def test_int8_auto_can_choose_dequant_float_beside_native_int8():
    from hf_contbatch.kernels.linears.autotune import KernelTuner

    def fake(in_f, out_f, dtype, buckets):  # dequant-float wins from 64 rows on
        return {
            "native-int8": {b: 1.0 for b in buckets},
            "dequant-float": {b: 4.0 if b < 64 else 0.25 for b in buckets},
            "torch-int8": {b: 8.0 for b in buckets},
        }

    tuner = KernelTuner({"native-int8": NativeInt8GEMM(), "dequant-float": DequantFloatGEMM()}, None, fake)
    choice = tuner.choose(64, 64, torch.float32, max_rows=1024, packed_only=True)
    assert set(choice.kernels) == {"native-int8", "dequant-float"}
    assert all(
        n == ("native-int8" if b < 64 else "dequant-float")
        for n, b in zip(choice.per_bucket, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
    )


def test_the_tuner_keeps_timing_dequant_float_after_it_loses_at_few_rows():
    from hf_contbatch.kernels.linears.autotune import KernelTuner

    class Slow(DequantFloatGEMM):  # far slower at every bucket: a kernel dropped from timing otherwise
        def linear_verified(self, x, packed, bias, out_features):
            for _ in range(40):
                y = super().linear_verified(x, packed, bias, out_features)
            return y

    tuner = KernelTuner({"native-int8": NativeInt8GEMM(), "dequant-float": Slow()}, None)
    seconds = tuner.measure(256, 256, torch.float32, (1, 2, 4, 8))
    assert all(0 < s < float("inf") for s in seconds["dequant-float"].values())


# Builds of int8_gemm.c with the wider ISAs switched off, so their paths run on an AVX-512 machine
# too: (), the CPU's own (-march=native); the 256-bit AVX2 + AVX-VNNI paths; AVX2 without VNNI (the
# portable int8-activation loop). A flag the compiler or CPU cannot take skips that build.
_BUILDS = [(), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avxvnni")]
# W8A8 also without AVX2: the activation quantization's portable scalar loop (with AVX2 it is vectorized).
_W8A8_BUILDS = [*_BUILDS, ("-mno-avx512f", "-mno-avxvnni", "-mno-avx2")]


def _build(kind, flags):
    try:
        return kind(flags)
    except RuntimeError as exc:
        pytest.skip(f"{kind.name} {flags} cannot be built or run here: {exc}")


@pytest.mark.parametrize("kind", [NativeInt8GEMM, NativeInt8MovsxGEMM])
@pytest.mark.parametrize("flags", _BUILDS)
# K not a multiple of 64 (nor of 4: the VNNI quads), N not a multiple of any panel width; K over one
# 256-feature slice; one column.
@pytest.mark.parametrize("n,k", [(70, 77), (130, 300), (1, 5)])
def test_native_int8_builds_equal_the_dequantized_reference(kind, flags, n, k):
    kernel = _build(kind, flags)
    g = torch.Generator().manual_seed(n + k + len(flags))
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = kernel.pack(w)
    # The weight quantized in float32 (the scheme's arithmetic: a float64 w / s can round the other
    # way at a half), then multiplied in float64.
    s = w.abs().amax(1, keepdim=True) / 127
    wd = ((w / s).round().clamp(-127, 127) * s).double()
    for rows in [*range(1, 18), 33, 64, 65, 130]:  # every tile height, two panels a tile, row blocks
        _check_native_rows(kernel, packed, torch.randn(rows, k, generator=g), wd, b)


@pytest.mark.parametrize("flags", _BUILDS[:2])
# Panel counts (64 columns a panel with AVX-512, 32 with AVX2) that split unevenly over 2 and 3
# threads: 5 panels (a 320-column weight), 25, one panel, one column past a panel.
@pytest.mark.parametrize("n,k", [(320, 96), (1600, 40), (9, 300), (65, 33)])
def test_native_int8_widenings_and_thread_splits_give_the_same_bits(flags, n, k):
    shift, movsx = _build(NativeInt8GEMM, flags), _build(NativeInt8MovsxGEMM, flags)
    g = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    s = w.abs().amax(1, keepdim=True) / 127
    wd = ((w / s).round().clamp(-127, 127) * s).double()
    packed = shift.pack(w)
    assert torch.equal(movsx.pack(w).data, packed.data)  # one layout
    before = torch.get_num_threads()
    try:
        for rows in (1, 2, 7, 16):
            x = torch.randn(rows, k, generator=g)
            want = torch.nn.functional.linear(x.double(), wd, b.double())
            results = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                results += [shift.linear(x, packed, b, n), movsx.linear(x, packed, b, n)]
            torch.testing.assert_close(results[0].double(), want, rtol=0, atol=k * 2e-7 * float(want.abs().max() + 1))
            # Each output one in-order FMA chain, whichever widening, thread or panel pairing.
            assert all(torch.equal(r, results[0]) for r in results[1:])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("flags", _W8A8_BUILDS[:2])
@pytest.mark.parametrize("n,k", [(320, 96), (1600, 40), (9, 301), (65, 33)])
def test_w8a8_one_row_path_is_exact_at_any_thread_count(flags, n, k):
    """A single row takes its own path (two panels a tile, panel ranges per thread): the integer
    sums stay exact, so its bits equal the reference's arithmetic and the row's bits in a batch."""
    kernel = _build(W8A8GEMM, flags)
    g = torch.Generator().manual_seed(n + 7 * k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = kernel.pack(w)
    x = torch.randn(7, k, generator=g)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            batch = kernel.linear(x, packed, b, n)
            for i in range(7):
                one = kernel.linear(x[i : i + 1], packed, b, n)
                assert torch.equal(one[0], batch[i])
                _check_w8a8_rows(kernel, packed, x[i : i + 1], w, b)
    finally:
        torch.set_num_threads(before)


def _check_native_rows(kernel, packed, x, wd, b):
    n, k = wd.shape
    for bias in (None, b):
        want = torch.nn.functional.linear(x.double(), wd, None if bias is None else bias.double())
        got = kernel.linear(x, packed, bias, n).double()
        # float32 sums of k products: a few ulps of the largest partial sum.
        torch.testing.assert_close(got, want, rtol=0, atol=k * 2e-7 * float(want.abs().max() + 1))
    # A row's bits do not depend on the rows beside it (each output one in-order FMA chain).
    assert torch.equal(kernel.linear(x[-1:], packed, b, n)[0], kernel.linear(x, packed, b, n)[-1])


def _w8a8_reference(x, w, b):
    """y = (xq @ wq.T) * sx * s (+ b) in float64: both sides quantized symmetric per row."""
    s = w.abs().amax(1) / 127
    wq = (w / s[:, None]).round().clamp(-127, 127)
    amax = x.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(x / sx).clamp(-127, 127)
    y = (xq.double() @ wq.double().T) * sx.double() * s.double()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("flags", _W8A8_BUILDS)
@pytest.mark.parametrize("n,k", [(70, 77), (130, 300), (1, 5), (96, 1)])
def test_w8a8_equals_the_quantized_reference(flags, n, k):
    kernel = _build(W8A8GEMM, flags)
    g = torch.Generator().manual_seed(n + k + len(flags))
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = kernel.pack(w)
    assert packed.zero_points.dtype == torch.int32 and packed.zero_points.shape == (n,)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 33, 64, 65, 100):
        x = torch.randn(rows, k, generator=g)
        x[0] = 0  # a zero row (scale 1, all zeros)
        _check_w8a8_rows(kernel, packed, x, w, b)


def _check_w8a8_rows(kernel, packed, x, w, b):
    n = w.shape[0]
    for bias in (None, b):
        want = _w8a8_reference(x, w, bias)
        got = kernel.linear(x, packed, bias, n).double()
        # The integer sums are exact; three float32 roundings (the sum, sx * s, the product) remain.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max() + 1))
        assert torch.equal(kernel.linear_verified(x, packed, kernel.step_bias(bias), n), got.float())
    # Against the weight-only result (activations in float): within the activation rounding.
    float_ref = _reference(x, w, b)
    err = (kernel.linear(x, packed, b, n) - float_ref).abs().max()
    assert err <= W8A8GEMM.probe_tolerance * float(float_ref.abs().max()) + 1e-6


def test_w8a8_bf16_inputs_odd_and_large_sizes_and_bad_inputs():
    kernel = W8A8GEMM()
    g = torch.Generator().manual_seed(9)
    w = torch.randn(50, 70, generator=g).bfloat16()
    x = torch.randn(2, 3, 70, generator=g).bfloat16()
    got = kernel.linear(x, kernel.pack(w), None, 50)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 50)
    # The bf16 weight's scales are rounded to bf16 (as reference_weight); x quantized from its float32 value.
    s = w.float().abs().amax(1).div(127).bfloat16().float()
    wq = (w.float() / s[:, None]).round().clamp(-127, 127)
    xf = x.float().reshape(6, 70)
    sx = xf.abs().amax(1, keepdim=True) / 127
    want = (torch.round(xf / sx) @ wq.T) * sx * s
    torch.testing.assert_close(got.float().reshape(6, 50), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    assert kernel.linear(torch.randn(0, 70).bfloat16(), kernel.pack(w), None, 50).shape == (0, 50)
    assert not kernel.supports(torch.zeros(4, MAX_W8A8_IN_FEATURES + 1))
    assert kernel.supports(torch.zeros(4, MAX_W8A8_IN_FEATURES))
    packed = kernel.pack(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.linear(torch.randn(2, 31), packed, None, 16)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.linear(torch.randn(2, 32).bfloat16(), packed, None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(2, 32), packed, torch.randn(15), 16)
    with pytest.raises(RuntimeError, match="cannot pack"):
        kernel.pack(torch.randn(4, 4, dtype=torch.float64))


def test_w8a8_int32_sums_do_not_overflow_at_the_largest_k():
    # Every product at its extreme, 255 * 127 (x and w all at their row maxima), for the largest K taken:
    # the exact sum fits int32; the kernel gives K * 127 * 127 * sx * s.
    k = MAX_W8A8_IN_FEATURES
    kernel = W8A8GEMM()
    w, x = torch.ones(3, k), torch.ones(1, k)
    got = kernel.linear(x, kernel.pack(w), None, 3)
    torch.testing.assert_close(got, torch.full((1, 3), float(k)), rtol=1e-6, atol=0)
    got = kernel.linear(-x, kernel.pack(w), None, 3)
    torch.testing.assert_close(got, torch.full((1, 3), -float(k)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("flags", _W8A8_BUILDS)
@pytest.mark.parametrize("n,k", [(70, 77), (200, 1000), (16, 17)])
def test_w8a8_bf16_is_its_float32_result_rounded_and_rows_do_not_depend_on_the_batch(flags, n, k):
    # bfloat16 x is read as it is and y written in bfloat16 by the C kernel: the same bits as the
    # float32 path on x's exact float32 value, rounded to nearest even once (Tensor.to).
    kernel = _build(W8A8GEMM, flags)
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    packed32, packed16 = kernel.pack(w), kernel.pack(w.bfloat16())
    # The bf16 weight's own quantization (its scales rounded to bf16), dequantized: the reference's weight.
    s16 = w.bfloat16().float().abs().amax(1).div(127).bfloat16().float()
    wq16 = (w.bfloat16().float() / s16[:, None]).round().clamp(-127, 127)
    for rows in (1, 5, 6, 7, 32, 64, 65, 130):  # one tile, several, row blocks
        x = torch.randn(rows, k, generator=g).bfloat16()
        for bias in (None, b):
            got = kernel.linear(x, packed16, bias, n)
            assert got.dtype == torch.bfloat16
            # The same packed weight through the float32 path (linear_verified takes any float x).
            want32 = kernel.linear_verified(x.float(), packed16, kernel.step_bias(bias), n)
            assert want32.dtype == torch.float32 and torch.equal(got, want32.bfloat16())
            # The float32 result against the plain-torch reference of the scheme (float64 sums).
            amax = x.float().abs().amax(1, keepdim=True)
            sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            xq = torch.round(x.float() / sx).clamp(-127, 127)
            ref = (xq.double() @ wq16.double().T) * sx.double() * s16.double()
            ref = ref if bias is None else ref + bias.double()
            torch.testing.assert_close(want32.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max() + 1))
            # One row alone gives the bits it gets inside the batch (int32 sums are exact).
            for i in {0, rows // 2, rows - 1}:
                assert torch.equal(kernel.linear(x[i : i + 1], packed16, bias, n)[0], got[i])
                assert torch.equal(
                    kernel.linear(x[i : i + 1].float(), packed32, bias, n)[0],
                    kernel.linear(x.float(), packed32, bias, n)[i],
                )


@pytest.mark.parametrize("flags", _W8A8_BUILDS)
def test_w8a8_activation_rounding_is_half_to_even(flags):
    # Row absmax 127 -> sx = 1, so x / sx is x: halves round to even (0.5 -> 0, 1.5 -> 2, 2.5 -> 2,
    # -2.5 -> -2). An identity-like weight (absmax 1 -> s = 1/127, wq = 127) reads each xq back.
    kernel = _build(W8A8GEMM, flags)
    vals = [127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.5, -126.5, 0.0] + [0.25] * 12
    k = len(vals)
    x = torch.tensor([vals])
    got = kernel.linear(x, kernel.pack(torch.eye(k)), None, k)
    xq = torch.tensor([127, 0, 2, 2, -2, 0, 4, -126, 0] + [0] * 12, dtype=torch.float64)
    want = xq * 127 * (1.0 / 127)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.double(), _w8a8_reference(x, torch.eye(k), None), rtol=1e-6, atol=1e-6)


def test_w8a8_scratch_size_computed_in_python_is_the_c_kernels():
    lib = int8_library()
    for m, k in [(1, 1), (1, 5), (7, 960), (64, 2560), (1025, 77)]:
        assert vnni_scratch_bytes(m, k) == lib.vnni_scratch(m, k)
