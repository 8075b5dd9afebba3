"""``w8a8_torch.TorchW8A8GEMM`` (W8A8 through ``torch._int_mm``) against a float64 reference of the
scheme, and against our C W8A8 kernel: the same int32 sums, so the two agree to the float rounding
of the final scaling."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch.kernels.linears.int8_gemm import W8A8GEMM
from hf_contbatch.kernels.linears.w8a8_torch import TorchW8A8GEMM, quantize_rows

pytestmark = pytest.mark.timeout(600)


def _reference(x, w, b):
    """y = (xq @ wq.T) * sx * s (+ b) in float64, both sides symmetric int8 (weight per output
    channel, input per row), written from the scheme's definition."""
    s = w.abs().amax(1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    wq = (w / s[:, None]).round().clamp(-127, 127)
    amax = x.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(x / sx).clamp(-127, 127)
    y = (xq.double() @ wq.double().T) * sx.double() * s.double()
    return y if b is None else y + b.double()


def test_quantize_rows_rounds_half_to_even_and_keeps_zero_rows():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    xq, sx = quantize_rows(x)
    assert sx.flatten().tolist() == [1.0, 1.0]
    assert xq.tolist() == [[127, 0, 2, -2, -127], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize("n,k", [(70, 77), (130, 300), (1, 5), (96, 2), (64, 64)])
def test_torch_w8a8_equals_the_quantized_reference_for_any_rows(n, k):
    kernel = TorchW8A8GEMM()
    g = torch.Generator().manual_seed(n * 7 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = kernel.pack(w)
    for rows in (1, 2, 3, 8, 17, 33, 64, 100):
        x = torch.randn(rows, k, generator=g)
        x[0] = 0  # a zero row: scale 1, all zeros
        for bias in (None, b):
            want = _reference(x, w, bias)
            got = kernel.linear(x, packed, bias, n).double()
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max() + 1))
        # Exact int32 sums: a row's bits do not depend on the rows beside it.
        assert torch.equal(kernel.linear(x[-1:], packed, b, n)[0], kernel.linear(x, packed, b, n)[-1])


def test_torch_w8a8_and_ours_agree_and_bf16_inputs_come_back_bf16():
    ours, theirs = W8A8GEMM(), TorchW8A8GEMM()
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(90, 200, generator=g), torch.randn(90, generator=g)
    x = torch.randn(2, 5, 200, generator=g)
    a = ours.linear(x, ours.pack(w), b, 90)
    t = theirs.linear(x, theirs.pack(w), b, 90)
    torch.testing.assert_close(t, a, rtol=1e-6, atol=1e-6 * float(a.abs().max()))
    wb, xb = w.bfloat16(), x.bfloat16()
    got = theirs.linear(xb, theirs.pack(wb), None, 90)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 90)
    torch.testing.assert_close(got, ours.linear(xb, ours.pack(wb), None, 90), rtol=1e-2, atol=1e-2)
    assert theirs.linear(torch.randn(0, 200), theirs.pack(w), b, 90).shape == (0, 90)


def test_torch_w8a8_refuses_what_does_not_fit_by_name():
    kernel = TorchW8A8GEMM()
    packed = kernel.pack(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="torch-w8a8 linear: input .* does not fit"):
        kernel.linear(torch.randn(2, 31), packed, None, 16)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.linear(torch.randn(2, 32).bfloat16(), packed, None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(2, 32), packed, torch.randn(15), 16)
    with pytest.raises(RuntimeError, match="torch-w8a8 cannot pack"):
        kernel.pack(torch.randn(4, 4, dtype=torch.float64))
    assert not kernel.supports(torch.randn(4, 4, 4))
    assert not kernel.supports(torch.randn(4, 1))  # torch's CPU _int_mm sums wrongly at one input
