"""Half-precision weights multiplied by torch's float32 GEMM, widened a group of panels at a time.

On a CPU without native half precision (no AVX512-BF16/FP16 or AMX: a Cascade Lake or Ice Lake
Xeon), oneDNN's and ``F.linear``'s bfloat16 GEMMs are several times slower than their float32 ones,
and our widening kernel (``cpu_gemm.c``, one FMA chain an output) is built for decode's few rows: at
prefill's hundreds of rows a bf16 model then multiplies slower than the float32 model it halves.
:class:`WidenF32GEMM` gives prefill the float32 GEMM back without a float32 copy of the weights:
each call widens the weight (exactly: bf16 is float32's top half, every fp16 value is a float32
one; ``cpu_gemm.c``'s ``hf_contbatch_gemm_widen_panels``) one group of panels at a time into a
scratch buffer of about :data:`SCRATCH_BYTES`, reused by every group of the call, and multiplies the
float32 inputs by it with ``torch.mm`` (the float32 BLAS torch calls), accumulating in float32 and
rounding each output once to the weight's dtype. Widening costs one pass over the half-precision
weight per call, which can pay only at prefill's hundreds of rows; at decode's few rows it costs
more than it saves, and ``linear_backend="auto"``'s timing (``autotune``) keeps the kernel to the
row buckets it wins, per shape and machine. Not batch-invariant: torch's BLAS may sum a row in
another order at another row count (as oneDNN and ``F.linear`` may).

The packed layout is :class:`~.native_gemm.NativeGEMM`'s widening one (16-bit values in float32
panels, ``[ceil(out/nr), in, nr]``), so beside our widening kernel in a dispatching pair the two read
one copy (:meth:`WidenF32GEMM.adopt`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .gemm_kernel import PackedWeight
from .native_gemm import GemmLibrary, NativeGEMM

SCRATCH_BYTES = 4 * 2**20
"""About the float32 bytes of weight widened at a time. Why not less: each group is one ``torch.mm``
call, which packs the inputs again, and at 1 MiB (256 columns of a 960-feature weight) that cost
more than the cache saved (960 -> 5120 at 1024 rows, one thread, emulated CPU without bf16: 74 ms
against 65 ms at 4 MiB). Why not the whole weight: a fresh float32 copy of a large weight per call
streams twice the bytes bf16 was chosen to save, and its pages are faulted in each call."""
HALF_DTYPES = (torch.bfloat16, torch.float16)


def panels_per_group(in_features: int, nr: int, scratch_bytes: int = SCRATCH_BYTES) -> int:
    """How many ``nr``-column panels of an ``in_features``-long weight are widened at a time: as many
    as fit ``scratch_bytes`` in float32, at least two (each group is one ``torch.mm`` call, which
    packs the inputs again: narrow groups lose more to that than the cache saves)."""
    return max(2, scratch_bytes // max(1, 4 * in_features * nr))


def widened_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_features: int,
    library: GemmLibrary,
    scratch_bytes: int = SCRATCH_BYTES,
) -> torch.Tensor:
    """``x @ W.T + b`` for a half-precision ``W`` in :class:`~.native_gemm.NativeGEMM`'s widening
    layout (``panels`` ``[P, in, nr]``, bfloat16 or float16, zero-padded past ``out_features``), by
    torch's float32 GEMM over the float32 values of ``x`` and of the weight, widened a group of
    panels at a time (:func:`panels_per_group`).

    Args:
        x: ``[..., in]``, the panels' dtype, CPU.
        panels: the packed weight (``PackedWeight.data`` of :meth:`WidenF32GEMM.pack`).
        bias: ``[out_features]`` float32 (added before the one rounding) or None.
        out_features: the weight's rows ``N`` (at most ``P * nr``).
        library: our GEMM's build that packed the panels (its ``widen_panels`` widens them).
        scratch_bytes: about the float32 bytes widened at a time.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype: the float32 products (torch's summation order)
        plus ``bias``, rounded once to nearest even.
    """
    k = x.shape[-1]
    lead = x.shape[:-1]
    m = x.numel() // k if k else lead.numel()
    x32 = x.reshape(m, k).to(torch.float32)  # exact, a small share of the bytes
    y32 = x32.new_empty((m, out_features))
    if m and out_features:
        count, _, nr = panels.shape
        group = min(count, panels_per_group(k, nr, scratch_bytes))
        scratch = torch.empty(k * group * nr, dtype=torch.float32)
        f16_in_c = int(panels.dtype == torch.float16 and library.gemm_wf16 is not None)
        threads = torch.get_num_threads()
        for p0 in range(0, count, group):
            p1 = min(count, p0 + group)
            c0, c1 = p0 * nr, min(out_features, p1 * nr)
            if c0 >= c1:
                break
            w32 = scratch[: k * (p1 - p0) * nr].view(k, (p1 - p0) * nr)  # W[c0:c1].T, widened
            if f16_in_c or panels.dtype == torch.bfloat16:
                library.widen_panels(panels.data_ptr(), k, p0, p1, f16_in_c, w32.data_ptr(), threads)
            else:  # float16 on a CPU without vector conversions (no F16C): torch's copy
                w32.view(k, p1 - p0, nr).copy_(panels[p0:p1].permute(1, 0, 2))
            w32 = w32[:, : c1 - c0]
            # Written in place into y32's columns (a row-major slice BLAS takes with ldc = N).
            if bias is None:
                torch.mm(x32, w32, out=y32[:, c0:c1])
            else:
                torch.addmm(bias[c0:c1], x32, w32, out=y32[:, c0:c1])
    elif bias is not None:
        y32.copy_(bias.expand_as(y32))
    return y32.to(x.dtype).reshape(*lead, out_features)


def _traced_linear(x: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor], out_features: int):
    """:func:`widened_linear` as plain tensor ops, for ``torch.compile`` (no pointers to pass to C,
    no writes into slices): the whole weight widened at once, the same float32 products."""
    w32 = panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[:out_features].to(torch.float32)
    return torch.nn.functional.linear(x.to(torch.float32), w32, bias).to(x.dtype)


class WidenF32GEMM(NativeGEMM):
    """Half-precision (bfloat16, float16) weights in :class:`~.native_gemm.NativeGEMM`'s widening
    layout, multiplied by torch's float32 GEMM after widening a group of panels a call
    (:func:`widened_linear`): "auto"'s prefill candidate for half-precision shapes, timed like the
    others. Exact unpack (the same panels); float32 weights are not its business.

    Raises:
        RuntimeError: on construction, when our GEMM's library (which packs the panels) cannot be built.
    """

    name = "widen-f32"
    isa = "torch"

    def __init__(self) -> None:
        super().__init__(half_isa="widen")

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """bfloat16 and float16 (widened by torch, so no F16C needed)."""
        return HALF_DTYPES

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is a 2-D bfloat16 or float16 CPU weight."""
        return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in HALF_DTYPES

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """``[out, in]`` half-precision weight → ``[ceil(out/nr), in, nr]`` panels of its 16-bit
        values (a new tensor). Raises RuntimeError for a weight :meth:`supports` rejects."""
        if not self.supports(weight):
            raise RuntimeError(
                f"widen-f32 cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}"
            )
        n, k = weight.shape
        nr = self.library.nr
        out = torch.empty((-(-n // nr), k, nr), dtype=weight.dtype)
        self.library.pack_h16(weight.contiguous().data_ptr(), n, k, out.data_ptr())
        return PackedWeight(out, (n, k), weight.dtype)

    def adopt(self, packed: PackedWeight) -> Optional[PackedWeight]:
        """``packed`` itself where it is a widening layout of this build (a :class:`NativeGEMM`'s
        half-precision panels ``[P, in, nr]``), so a pair of the two keeps one copy; else None."""
        data = packed.data
        fits = isinstance(data, torch.Tensor) and data.dim() == 3 and data.shape[2] == self.library.nr
        return packed if fits and data.dtype in HALF_DTYPES and packed.dtype == data.dtype else None

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` (the weight's dtype, CPU) → ``[..., out_features]``, plus ``bias``
        ``[out_features]`` (any float dtype, added in float32) if given.

        Raises:
            RuntimeError: ``x`` or ``bias`` of another dtype, device or size than the packed weight.
        """
        data = packed.data
        k = data.shape[1]
        fits = x.device.type == "cpu" and x.dtype == data.dtype and x.dim() and x.shape[-1] == k
        if not fits or not (data.shape[0] - 1) * data.shape[2] < out_features <= data.shape[0] * data.shape[2]:
            raise RuntimeError(
                f"widen-f32 linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit a packed "
                f"{data.dtype} CPU weight of {out_features} outputs"
            )
        if bias is not None:
            if not bias.is_floating_point() or bias.device.type != "cpu" or bias.shape != (out_features,):
                raise RuntimeError(
                    f"widen-f32 linear: bias {tuple(bias.shape)} {bias.dtype} on {bias.device} does not fit "
                    f"{out_features} CPU outputs"
                )
            bias = bias.to(torch.float32)
        if torch.compiler.is_compiling():
            return _traced_linear(x, data, bias, out_features)
        return widened_linear(x, data, bias, out_features, self.library)

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """:meth:`linear` for arguments already checked; ``bias`` float32 (:meth:`step_bias`)."""
        if torch.compiler.is_compiling():
            return _traced_linear(x, packed.data, bias, out_features)
        return widened_linear(x, packed.data, bias, out_features, self.library)
