"""The half-precision prefill candidate ``widen-f32`` (``hf_contbatch.kernels.linears.widen_gemm``)
against arithmetic: the C widening gives the weight's float32 values bit for bit (bf16 and fp16
widen exactly), the products are within float32 accumulation's dot-product bound of the float64
product plus one rounding to the weight's dtype (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., section 3.1), whatever the group of panels widened at a time; it reads our
widening kernel's packed copy in place, unpacks bit for bit, refuses what does not fit, and is a
candidate of ``linear_backend="auto"``. It promises no batch invariance (torch's BLAS sums in its
own order), so none is tested."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from hf_contbatch.kernels.linears import NativeGEMM
from hf_contbatch.kernels.linears.dispatch_gemm import DispatchGEMM
from hf_contbatch.kernels.linears.registry import available_kernels
from hf_contbatch.kernels.linears.widen_gemm import WidenF32GEMM, panels_per_group, widened_linear

EPS = 2.0**-24  # float32 unit roundoff
HALF = [torch.bfloat16, torch.float16]
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # half an ulp of the output, relative


@pytest.fixture(scope="module")
def widen():
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler on this machine: our GEMM's library (which packs the panels) cannot be built")
    return WidenF32GEMM()


def _check_against_float64(y, x, w, b, dtype):
    """float32 accumulation of K products (gamma_K in float32, K = in_features + 1 with the bias)
    then one rounding to ``dtype`` (round to nearest: half an ulp, relative)."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    k = x.shape[-1] + 1
    unit = UNIT[dtype]
    assert y.dtype == dtype
    err = (y.double() - exact).abs()
    assert (err <= unit * exact.abs() * (1 + 1e-6) + 1.01 * k * EPS * bound * (1 + unit) + 1e-30).all()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 3, 64, 257])
@pytest.mark.parametrize(("k", "n"), [(1, 1), (7, 3), (130, 65), (960, 100)])
def test_products_match_float64_within_float32_accumulation_and_one_rounding(widen, dtype, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w, x = (torch.randn(n, k, generator=g) * 0.1).to(dtype), torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    packed = widen.pack(w)
    nr = widen.library.nr
    assert packed.data.dtype == dtype and packed.data.shape == (-(-n // nr), k, nr) and packed.shape == (n, k)
    assert torch.equal(widen.unpack(packed), w)  # the panels hold every value: the weight may be released
    for bias in (None, b):
        y = widen.linear(x, packed, bias, n)
        assert y.shape == (m, n)
        _check_against_float64(y, x, w, bias, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_every_group_size_widens_the_columns_it_covers(widen, dtype):
    # 5 panels (the last one partly padding), widened 1, 2 (at least two: panels_per_group), 3 and all
    # 5 at a time: each group's columns land in their place within the bound.
    nr = widen.library.nr
    n, k, m = 4 * nr + 7, 40, 33
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    packed = widen.pack(w)
    for panels in (1, 2, 3, 5):
        scratch = 4 * k * nr * panels
        assert panels_per_group(k, nr, scratch) == max(2, panels)
        _check_against_float64(widened_linear(x, packed.data, b, n, widen.library, scratch), x, w, b, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_the_c_widening_gives_the_weights_float32_values_bit_for_bit(widen, dtype):
    # bf16 is float32's top half and every fp16 value (subnormals, infinities, signed zeros) is a
    # float32 one, so widening is exact: panels p0..p1 become W[p0*nr : p1*nr].T in float32.
    nr = widen.library.nr
    n, k = 3 * nr + 5, 11
    w = torch.randn(n, k) * 1e3
    w[0, :4] = torch.tensor([float("inf"), -0.0, 1e-6, -float("inf")])  # 1e-6: an fp16 subnormal
    w = w.to(dtype)
    panels = widen.pack(w).data
    f16_in_c = int(dtype == torch.float16 and widen.library.gemm_wf16 is not None)
    if dtype == torch.float16 and not f16_in_c:
        pytest.skip("no vector float16 conversion in this build (F16C): torch widens float16 here")
    padded = torch.cat([w, w.new_zeros(4 * nr - n, k)]).float()
    for p0, p1 in ((0, 4), (1, 3), (3, 4)):
        dst = torch.full((k, (p1 - p0) * nr), float("nan"))
        widen.library.widen_panels(panels.data_ptr(), k, p0, p1, f16_in_c, dst.data_ptr(), torch.get_num_threads())
        want = padded[p0 * nr : p1 * nr].T
        assert torch.equal(dst.view(torch.int32), want.contiguous().view(torch.int32))


@pytest.mark.parametrize("dtype", HALF)
def test_empty_strided_and_batched_inputs(widen, dtype):
    w = torch.randn(20, 12).to(dtype)
    b = torch.randn(20)
    packed = widen.pack(w)
    empty = widen.linear(torch.empty(0, 12, dtype=dtype), packed, b, 20)
    assert empty.shape == (0, 20) and empty.dtype == dtype
    strided = torch.randn(12, 6).to(dtype).T  # [6, 12], not contiguous
    _check_against_float64(widen.linear(strided, packed, None, 20), strided, w, None, dtype)
    x3 = torch.randn(2, 3, 12).to(dtype)
    y3 = widen.linear(x3, packed, b, 20)
    assert y3.shape == (2, 3, 20)
    _check_against_float64(y3.reshape(6, 20), x3.reshape(6, 12), w, b, dtype)
    no_inputs = widen.pack(torch.empty(5, 0, dtype=dtype))  # no input features: the bias alone
    assert torch.equal(widen.linear(torch.empty(3, 0, dtype=dtype), no_inputs, b[:5], 5), b[:5].expand(3, 5).to(dtype))


def test_only_half_precision_weights_are_packed_and_inputs_that_do_not_fit_are_refused(widen):
    assert widen.dtypes == (torch.bfloat16, torch.float16)
    assert not widen.supports(torch.randn(8, 6))
    with pytest.raises(RuntimeError, match="cannot pack"):
        widen.pack(torch.randn(8, 6))
    packed = widen.pack(torch.randn(8, 6).bfloat16())
    for x in (torch.randn(2, 6), torch.randn(2, 6).half(), torch.randn(2, 5).bfloat16()):
        with pytest.raises(RuntimeError, match="does not fit"):
            widen.linear(x, packed, None, 8)
    with pytest.raises(RuntimeError, match="does not fit"):
        widen.linear(torch.randn(2, 6).bfloat16(), packed, None, 8 + widen.library.nr)  # more outputs than panels
    with pytest.raises(RuntimeError, match="bias"):
        widen.linear(torch.randn(2, 6).bfloat16(), packed, torch.randn(7), 8)


@pytest.mark.parametrize("dtype", HALF)
def test_beside_our_widening_kernel_one_packed_copy_serves_both(widen, dtype):
    native = NativeGEMM(half_isa="widen")
    if dtype not in native.dtypes:
        pytest.skip("no vector float16 conversion on this CPU: our kernel has no float16 path")
    w = torch.randn(70, 33).to(dtype)
    pair = DispatchGEMM([native, widen], table=[0, 1], buckets=[4, 1024])
    packed = pair.pack(w)
    assert packed.data[0] is packed.data[1]  # adopted, not packed twice
    assert packed.nbytes == packed.data[0].nbytes
    assert widen.adopt(NativeGEMM().pack(torch.randn(70, 33))) is None  # a float32 layout: not its own
    if native.library.gemm_bf16 is not None:  # the VDPBF16PS layout [P, k/2, 32, 2]: not readable here
        assert widen.adopt(NativeGEMM(half_isa="avx512_bf16").pack(torch.randn(70, 34).bfloat16())) is None
    x = torch.randn(100, 33).to(dtype)
    _check_against_float64(pair.linear(x, packed, None, 70), x, w, None, dtype)  # 100 rows: widen-f32's bucket
    _check_against_float64(pair.linear(x[:3], packed, None, 70), x[:3], w, None, dtype)  # our kernel's


def test_it_is_a_candidate_of_auto_for_half_precision_weights_only(widen):
    kernels = available_kernels()
    assert isinstance(kernels.get("widen-f32"), WidenF32GEMM)
    assert kernels["widen-f32"].supports(torch.zeros(8, 8, dtype=torch.bfloat16))
    assert not kernels["widen-f32"].supports(torch.zeros(8, 8))


def test_under_torch_compile_it_traces_as_plain_ops_within_the_same_bound(widen):
    # Traced (dynamo; the eager backend keeps the test fast), the pointer-taking C widening is not
    # called: the whole weight is widened by tensor ops instead, the same float32 products.
    w, x, b = torch.randn(70, 33).bfloat16(), torch.randn(9, 33).bfloat16(), torch.randn(70)
    packed = widen.pack(w)
    compiled = torch.compile(lambda x: widen.linear_verified(x, packed, b, 70), backend="eager", fullgraph=True)
    _check_against_float64(compiled(x), x, w, b, torch.bfloat16)
