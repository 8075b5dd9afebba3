"""``w8a8_torch.TorchW8A8GEMM`` (W8A8 through ``torch._int_mm``) and ``IntMMW8A8GEMM`` (the same with
its quantization and scaling passes in C) against a float64 reference of the scheme, against each
other (the same arithmetic: the same bits), and against our C W8A8 kernel: the same int32 sums, so
the two agree to the float rounding of the final scaling."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch.kernels.linears.int8_gemm import W8A8GEMM
from hf_contbatch.kernels.linears.int8_library import int8_library
from hf_contbatch.kernels.linears.w8a8_torch import (
    K_CHUNK,
    ROW_BLOCK,
    IntMMW8A8GEMM,
    TorchW8A8GEMM,
    WidenW8A8GEMM,
    quantize_rows,
)

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


@pytest.mark.parametrize("kind", [TorchW8A8GEMM, IntMMW8A8GEMM, WidenW8A8GEMM])
@pytest.mark.parametrize("n,k", [(70, 77), (130, 300), (1, 5), (96, 2), (64, 64)])
def test_torch_w8a8_equals_the_quantized_reference_for_any_rows(kind, n, k):
    kernel = kind()
    g = torch.Generator().manual_seed(n * 7 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = kernel.pack(w)
    for rows in (1, 2, 3, 8, 17, 33, 64, 100, ROW_BLOCK + 3):
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


def test_the_c_quantizer_gives_quantize_rows_bytes():
    """``int8_gemm.c``'s signed-int8 row quantization (``quantize_s8``) against ``quantize_rows``
    (torch's ops): half-way ties, a zero row, a value one ulp past a multiple of the scale, and
    random rows of every length around the vector width; float32 and bfloat16 (read as it is)."""
    lib = int8_library()
    g = torch.Generator().manual_seed(5)
    ties = torch.tensor(
        [[127.0, 0.5, 1.5, -2.5, -127.0, 2.5, -0.5], [0.0] * 7, [3.0, 1.0, -1.0, 0.0, 2.9, 1e-30, -3.0]]
    )
    cases = [ties] + [torch.randn(9, k, generator=g) * 10 ** float(k % 5 - 2) for k in (1, 2, 15, 16, 17, 33, 960)]
    for x in cases:
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            m, k = xd.shape
            xq, sx = torch.empty(m, k, dtype=torch.int8), torch.empty(m, dtype=torch.float32)
            lib.quantize_s8(xd.data_ptr(), m, k, dtype == torch.bfloat16, xq.data_ptr(), sx.data_ptr(), 1)
            want_q, want_s = quantize_rows(xd)
            assert torch.equal(xq, want_q) and torch.equal(sx, want_s.flatten())


@pytest.mark.parametrize("kind", [IntMMW8A8GEMM, WidenW8A8GEMM])
def test_intmm_w8a8_gives_torch_w8a8_bits(kind):
    """The same arithmetic in the same order (``((acc * sx) * s) + b`` in float32, then one rounding
    to the output dtype): bit-identical outputs, float32 and bfloat16, with and without bias, at row
    counts on both sides of a row block, for a non-contiguous input too; and a row's bits do not
    depend on the block it runs in."""
    ours, torchs = kind(), TorchW8A8GEMM()
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        w, b = torch.randn(300, 200, generator=g).to(dtype), torch.randn(300, generator=g).to(dtype)
        packed = torchs.pack(w)
        block = kind.row_block
        for rows in (1, 5, block - 1, block, 2 * block + 7):
            x = (torch.randn(rows, 200, generator=g) * 4).to(dtype)
            for bias in (None, b):
                got = ours.linear(x, packed, bias, 300)
                assert got.dtype == dtype and torch.equal(got, torchs.linear(x, packed, bias, 300))
            assert torch.equal(ours.linear(x[-1:], packed, b, 300)[0], ours.linear(x, packed, b, 300)[-1])
        xt = torch.randn(200, 6, generator=g).to(dtype).t()  # non-contiguous [6, 200]
        assert torch.equal(ours.linear(xt, packed, b, 300), torchs.linear(xt, packed, b, 300))
        assert ours.linear(torch.zeros(0, 200, dtype=dtype), packed, b, 300).shape == (0, 300)


def test_widen_w8a8_sums_exactly_past_float32s_integers():
    """Sums far past 2**24 (float32's last exact integer): rows and weights at the int8 extremes
    (every product +-127 x 127), over inputs both inside one float32 chunk and across several
    (``K_CHUNK``): the int32 sums, computed here in int64 by arithmetic, and torch-w8a8's bits."""
    widen, torchs = WidenW8A8GEMM(), TorchW8A8GEMM()
    g = torch.Generator().manual_seed(17)
    for k in (K_CHUNK - 1, K_CHUNK, K_CHUNK + 1, 2 * K_CHUNK + 300):
        sign = torch.where(torch.rand(40, k, generator=g) < 0.9, 1.0, -1.0)
        w = sign * 3.0  # one scale per row, every int8 value +-127
        x = torch.ones(5, k) * 2.0
        x[1] = -x[1]
        x[2, ::3] = 0.5  # 0.5 / (2 / 127) = 31.75: quantized to 32
        packed = torchs.pack(w)
        xq, _ = quantize_rows(x)
        want = xq.long() @ packed.data.long()  # exact, in int64
        assert int(want.abs().max()) > 2**24 or k <= K_CHUNK + 1
        assert torch.equal(widen.int_sums(xq, packed.data).long(), want)
        assert torch.equal(widen.linear(x, packed, None, 40), torchs.linear(x, packed, None, 40))


def test_intmm_w8a8_refuses_what_does_not_fit_by_name():
    kernel = IntMMW8A8GEMM()
    packed = kernel.pack(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="intmm-w8a8 linear: input .* does not fit"):
        kernel.linear(torch.randn(2, 31), packed, None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear(torch.randn(2, 32), packed, torch.randn(15), 16)


def test_intmm_w8a8_shares_torch_w8a8s_packed_weight_in_a_dispatch():
    """A ``DispatchGEMM`` of the two holds one int8 weight (the same layout), and each part serves
    the bits its kernel gives alone."""
    from hf_contbatch.kernels.linears.dispatch_gemm import DispatchGEMM

    torchs, ours = TorchW8A8GEMM(), IntMMW8A8GEMM()
    w = torch.randn(40, 24)
    assert ours.adopt(torchs.pack(w)) is not None
    assert ours.adopt(W8A8GEMM().pack(w)) is None
    parts = DispatchGEMM([torchs, ours], [0, 1], (1, 64)).pack(w).data
    assert parts[0] is parts[1]
    x = torch.randn(3, 24)
    assert torch.equal(ours.linear(x, parts[1], None, 40), torchs.linear(x, torchs.pack(w), None, 40))
