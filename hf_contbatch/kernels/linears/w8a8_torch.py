"""W8A8 through torch's own int8 matrix multiply: :class:`TorchW8A8GEMM` (``"torch-w8a8"``) and
:class:`IntMMW8A8GEMM` (``"intmm-w8a8"``: the same with its elementwise passes in C).

The scheme is :class:`~hf_contbatch.kernels.linears.int8_gemm.W8A8GEMM`'s (``quantization="w8a8"``):
the weight int8 with one scale per output channel (``s = absmax(W[j, :]) / 127``), each row of the
input quantized on the fly with one scale per row (``sx = absmax(x[r, :]) / 127``, 1 for a zero
row; ``xq = round_half_even(x / sx)`` in ``[-127, 127]``), ``y = (xq @ Wq.T) * sx * s (+ b)``: the
dynamic per-token activation quantization of LLM.int8()'s vector-wise scheme (Dettmers et al., 2022)
and of torchao's ``Int8DynamicActivationInt8WeightConfig``. Here the int8 products are summed by
``torch._int_mm`` (int8 x int8 -> int32; on CPU oneDNN's VNNI / AMX-int8 kernels where the CPU has
them), the quantization and the scaling by torch's elementwise ops. The int32 sums are exact, so a
row's result does not depend on the batch it runs in, and both W8A8 kernels compute the same sums;
only the float rounding of the final scaling can differ between them.

They are the library paths beside our C kernel: ``linear_backend="auto"`` times the three per shape
and row count and serves the fastest (``autotune``). Where the time went (SmolLM2-360M's shapes,
bfloat16, one thread's CPU time, A/B in one process, Xeon with AMX-int8, 2026-12-05, shared
machine): ``_int_mm`` alone ran at 750-1,350 GOPS from 256 rows, torch-w8a8 whole at 180-440, our
VNNI kernel at about 150; torch's quantization passes (float32 copy, abs, amax, division, round,
clamp, cast) took as long as the GEMM or longer, its scaling passes half as long, and its fresh
multi-MB temporaries page faults. intmm-w8a8 ran at 490-1,000 GOPS (1.5-2.7x torch-w8a8), bf16
``F.linear`` (oneDNN AMX-bf16) at 400-1,200 GFLOP/s: intmm-w8a8 faster at 64 rows, 0.7-1.1x its
speed at 256-1,024 (the two C passes still cost a third of the call there).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import torch

from .gemm_kernel import PackedWeight
from .int8_library import int8_library
from .int8_weights import Int8Kernel, int8_parts, is_plain_tensor, is_torchao_int8_weight_only

QMAX = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq int8 [m, k], sx float32 [m, 1])`` for a float ``x [m, k]``: ``sx = absmax(row) / 127``
    (1 for a zero row), ``xq = round_half_even(x / sx)`` clamped to ``[-127, 127]`` (the division can
    round a hair past 127), computed in float32."""
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.round(x / sx).clamp_(-QMAX, QMAX).to(torch.int8), sx


class TorchW8A8GEMM(Int8Kernel):
    """W8A8 by ``torch._int_mm`` (see the module docstring). ``x`` float32 or bfloat16 (quantized from
    float32; the output rounded to ``x``'s dtype).

    Packed: ``data`` the int8 weight transposed, ``[in, out]`` viewed from an ``[out, in]`` row-major
    tensor (the column-major right operand oneDNN takes without a copy), ``scales`` float32 ``[out]``.

    Raises:
        RuntimeError: on construction, when the class's int8 sums (:meth:`int_sums`; here this
            torch's CPU ``torch._int_mm``) are missing or sum a probe wrongly.
    """

    name = "torch-w8a8"
    isa = "torch"
    build_id = ""
    dtypes = (torch.float32, torch.bfloat16)
    probe_tolerance = 3e-2
    """Relative tolerance against ``F.linear`` over the dequantized weight (``packed_linears``' probe):
    the activation rounding, not only the summation order, separates the two."""

    def __init__(self) -> None:
        # The class's own int8 sums probed (torch._int_mm here; a subclass's replacement in its own).
        try:
            a = torch.ones((1, 8), dtype=torch.int8)
            ok = torch.equal(self.int_sums(a, torch.ones((8, 8), dtype=torch.int8)), torch.full((1, 8), 8))
        except (RuntimeError, AttributeError, NotImplementedError) as exc:
            raise RuntimeError(f"{self.name}: its int8 sums are not available on the CPU here: {exc}") from exc
        if not ok:
            raise RuntimeError(f"{self.name}: its int8 sums gave a wrong int32 sum on the CPU here")

    def supports(self, weight: torch.Tensor) -> bool:
        """float32 or bfloat16 (plain or torchao int8 weight-only) 2-D CPU weights of at least two
        inputs (torch 2.13's CPU ``_int_mm`` sums wrongly with one)."""
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in self.dtypes:
            return False
        if weight.shape[1] < 2:
            return False
        return is_plain_tensor(weight) or is_torchao_int8_weight_only(weight)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """RuntimeError for a weight :meth:`supports` rejects."""
        if not self.supports(weight):
            raise RuntimeError(
                f"torch-w8a8 cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}"
            )
        q, s = int8_parts(weight)
        return PackedWeight(q.contiguous().t(), tuple(weight.shape), weight.dtype, scales=s.contiguous())

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` (the packed dtype, CPU) → ``[..., out_features]``; RuntimeError when
        ``x`` or ``bias`` does not fit."""
        self.check_call(x, packed, bias, out_features)
        return self.linear_verified(x, packed, self.step_bias(bias), out_features)

    @staticmethod
    def step_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        # contiguous: IntMMW8A8GEMM's C pass reads it (a no-op for a module's bias)
        return None if bias is None else bias.detach().float().contiguous()

    @staticmethod
    def int_sums(xq: torch.Tensor, wq: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``xq`` int8 ``[m, k]`` times ``wq`` int8 ``[k, n]`` (the packed weight's data): the exact
        int32 sums ``[m, n]`` (into ``out`` when given), by ``torch._int_mm``."""
        return torch._int_mm(xq, wq) if out is None else torch._int_mm(xq, wq, out=out)

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        n, k = packed.shape
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if not m or not k:
            y = x2.new_zeros((m, n), dtype=torch.float32)
            y = y if bias is None else y + bias
        else:
            xq, sx = quantize_rows(x2)
            acc = self.int_sums(xq, packed.data)
            y = acc.float().mul_(sx).mul_(packed.scales)
            if bias is not None:
                y.add_(bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], n)


ROW_BLOCK = 256
"""Rows :class:`IntMMW8A8GEMM` runs through its three passes at a time: a block's int32 sums (1-5 MB
at SmolLM2-360M's widths) are scaled while still in cache. 1,024-row calls took 10-25% less time in
blocks of 256 rows than whole (128 about as fast; 32 and 64 slower: ``_int_mm`` calls too small);
one thread's CPU time, A/B in one process, Xeon with AMX, 2026-12-05, shared machine."""


class IntMMW8A8GEMM(TorchW8A8GEMM):
    """:class:`TorchW8A8GEMM`'s scheme, packing and bits with its two elementwise passes in C
    (``int8_gemm.c`` part 3): the rows quantized in one read of ``x`` (bfloat16 read as it is, no
    float32 copy) and the int32 sums scaled into the output in one pass, ``((acc * sx) * s) + b`` each
    rounded to float32 in that order as torch's ops do, then once to ``x``'s dtype. The int8 buffers
    and the int32 sums go to this thread's reused scratch (fresh multi-MB tensors a call cost page
    faults); rows in blocks of :attr:`row_block` rows. At prefill row counts torch's passes cost more than ``torch._int_mm`` itself (oneDNN's
    AMX-int8 / VNNI); here the GEMM is most of the call. A compiled forward traces the torch passes
    (the same bits).

    Raises:
        RuntimeError: on construction, when this torch has no CPU ``torch._int_mm`` or our int8
            library cannot be built or run here.
    """

    name = "intmm-w8a8"
    row_block = ROW_BLOCK
    """Rows quantized, summed and scaled at a time (:data:`ROW_BLOCK`)."""

    def __init__(self) -> None:
        super().__init__()
        self._lib = int8_library()
        # One scratch per thread: an engine's scheduler thread and a tuning or test thread may share
        # this object.
        self._local = threading.local()

    @property
    def build_id(self) -> str:
        return Path(self._lib.path).stem

    def adopt(self, packed: PackedWeight) -> Optional[PackedWeight]:
        """``packed`` itself when it is a :class:`TorchW8A8GEMM` copy (the same layout: int8
        ``[in, out]`` viewed from a row-major ``[out, in]``, float32 scales ``[out]``), else None: a
        ``DispatchGEMM`` of the two then holds one int8 weight, not two."""
        data, scales = packed.data, packed.scales
        if not isinstance(data, torch.Tensor) or data.dtype != torch.int8 or data.dim() != 2:
            return None
        k, n = packed.shape[1], packed.shape[0]
        if tuple(data.shape) != (k, n) or data.stride() != (1, k) or packed.zero_points is not None:
            return None
        if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != (n,) or not scales.is_contiguous():
            return None
        return packed

    def _scratch(self, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This thread's ``(xq int8 [m, k], sx float32 [m], acc int32 [m, n])`` views of reused
        buffers (grown, never shrunk)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None or bufs[0].numel() < m * k or bufs[1].numel() < m or bufs[2].numel() < m * n:
            old = bufs or (torch.empty(0, dtype=torch.int8), torch.empty(0), torch.empty(0, dtype=torch.int32))
            bufs = self._local.bufs = (
                torch.empty(max(m * k, old[0].numel()), dtype=torch.int8),
                torch.empty(max(m, old[1].numel()), dtype=torch.float32),
                torch.empty(max(m * n, old[2].numel()), dtype=torch.int32),
            )
        return bufs[0][: m * k].view(m, k), bufs[1][:m], bufs[2][: m * n].view(m, n)

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        n, k = packed.shape
        m = x.numel() // k if k else 0
        if not m or not k or torch.compiler.is_compiling():
            return super().linear_verified(x, packed, bias, out_features)
        if not x.is_contiguous():
            x = x.contiguous()
        x2 = x.view(m, k)
        y = x.new_empty((*x.shape[:-1], n))
        y2 = y.view(m, n)
        block = self.row_block
        xq, sx, acc = self._scratch(min(m, block), k, n)
        threads, bf16 = torch.get_num_threads(), x.dtype == torch.bfloat16
        bias_ptr = None if bias is None else bias.data_ptr()
        for r0 in range(0, m, block):
            h = min(block, m - r0)
            q, a = xq[:h], acc[:h]
            self._lib.quantize_s8(x2[r0].data_ptr(), h, k, bf16, q.data_ptr(), sx.data_ptr(), threads)
            self.int_sums(q, packed.data, out=a)
            self._lib.scale_out(
                a.data_ptr(), h, n, sx.data_ptr(), packed.scales.data_ptr(), bias_ptr, y2[r0].data_ptr(), bf16, threads
            )
        return y


K_CHUNK = 1024
"""Inputs :class:`WidenW8A8GEMM` sums in one float32 GEMM: every partial sum of 1,024 products of
int8 values in ``[-127, 127]`` is an integer of magnitude at most 1,024 x 127 x 127 = 16,516,096 <
2**24, so float32 holds each exactly, in whatever order or blocking the GEMM adds them."""


class WidenW8A8GEMM(IntMMW8A8GEMM):
    """:class:`IntMMW8A8GEMM` with the int8 products summed by torch's float32 GEMM instead of
    ``torch._int_mm``: the quantized rows and the int8 weight widened to float32 (exact), one
    ``torch.mm`` per :data:`K_CHUNK` inputs (exact: every partial sum stays below 2**24), the chunk
    sums converted to int32 and added. The same int32 sums, so the bits of ``torch-w8a8``.

    For CPUs without VNNI (AVX2 only, e.g. AMD Zen 3), where int8 x int8 products have no
    instruction of their own and oneDNN's and our int8 GEMMs ran at 7-55 GOP/s against the float32
    GEMM's 160 GFLOP/s (2 cores, 2026-12-05): widening the weight each call (``n x k`` bytes read,
    four times that written and read back) costs a tenth of a 256-row GEMM, and the tuner serves it
    only at the row counts where it wins. Nothing is kept widened: the weight stays int8 in memory.
    """

    name = "widen-w8a8"
    row_block = 1024
    """Each row block widens the whole weight again: 1,024-row calls took 1.16-1.35x less time in
    one block than in four of 256 (SmolLM2-360M's 960 x 5120 and 2560 x 960, bf16, 2 threads, AMD
    Zen 3, A/B in one process, 2026-12-05)."""

    @staticmethod
    def int_sums(xq: torch.Tensor, wq: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``xq`` int8 ``[m, k]`` times ``wq`` int8 ``[k, n]`` (the packed weight's data, viewed from
        a row-major ``[n, k]``): the exact int32 sums ``[m, n]`` (into ``out``, int32 ``[m, n]``, when
        given), ``ceil(k / K_CHUNK)`` float32 GEMMs over a float32 copy of the rows and of each weight
        chunk (``4 n min(k, K_CHUNK)`` bytes at a time), no ``torch._int_mm``. Raises what
        ``torch.mm`` raises for mismatched shapes."""
        k = xq.shape[1]
        xf, w = xq.float(), wq.t()  # w: the int8 weight as its row-major [n, k]
        acc = out
        for c0 in range(0, k, K_CHUNK):
            c1 = min(k, c0 + K_CHUNK)
            part = torch.mm(xf[:, c0:c1], w[:, c0:c1].float().t()).to(torch.int32)
            if acc is None:
                acc = part
            elif c0 == 0:
                acc.copy_(part)
            else:
                acc.add_(part)
        return acc
