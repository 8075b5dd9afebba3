"""The weight-only int8 kernels against a plain-torch reference: ``F.linear(x, Wq * s)`` with
``s = absmax(row) / 127`` and ``Wq = round(W / s).clamp(-127, 127)`` (torchao's int8 weight-only
scheme), at decode and prefill row counts, odd sizes, with and without a bias."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch.kernels.linears.int8_gemm import NativeInt8GEMM, TorchInt8GEMM
from hf_contbatch.kernels.linears.registry import available_int8_kernels

pytestmark = pytest.mark.timeout(120)


def _reference(x, w, b):
    s = w.abs().amax(1, keepdim=True) / 127
    wq = (w / s).round().clamp(-127, 127)
    return torch.nn.functional.linear(x, wq * s, b)


def _kernels():
    return list(available_int8_kernels().values())


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
