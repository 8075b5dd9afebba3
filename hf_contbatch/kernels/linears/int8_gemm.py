"""Int8 linears: the GEMM kernels that serve int8 weights (the quantization: ``int8_weights``).

Scheme (torchao's int8 weight-only one, ``Int8WeightOnlyConfig``): symmetric, one scale per output
channel, ``s = absmax(W[j, :]) / 127``, ``Wq = round(W / s)`` clamped to ``[-127, 127]``; the layer
computes ``x @ (Wq * s).T + b`` with ``x`` in the model's dtype (no activation quantization). A
model that torchao quantized already (``transformers.TorchAoConfig(Int8WeightOnlyConfig())``: the
weight is a ``torchao.quantization.Int8Tensor`` with per-row blocks and no activation
quantization) is repacked exactly from its own ``qdata`` and ``scale`` (:func:`int8_parts`).

Kernels, all keeping :class:`~hf_contbatch.kernels.linears.gemm_kernel.GemmKernel` (``pack`` takes
a float weight, quantizing it, or a torchao int8 weight; the :class:`PackedWeight` carries the
scales), timed per shape by ``autotune`` like the float ones:

- :class:`TorchInt8GEMM` (``"torch-int8"``): torch's own CPU kernel,
  ``torch.ops.aten._weight_int8pack_mm(x, Wq, s)`` (float32; bfloat16 only where ``in_features`` is
  a multiple of 64: on torch 2.13 its bfloat16 path crashes the process for other sizes with more
  than one row).
- :class:`NativeInt8GEMM` (``"native-int8"``): ours, ``int8_gemm.c`` part 1 (dequantize in
  registers, float32 FMA, scale applied per output; float32 only): built to stream the weights at
  memory speed at one to three rows; from about four rows on a float32 FMA per weight byte per row
  is the limit (as for the float32 GEMM), so there it runs at the FMA peak instead.
  :class:`NativeInt8MovsxGEMM` (``"native-int8-movsx"``): the same kernel widening the weights with
  ``VPMOVSXBD`` instead of shifts (same layout, same bits; faster on Intel, slower on Zen 5: timed).
- :class:`DequantFloatGEMM` (``"dequant-float"``): dequantize a tile of output columns at a time
  into a reused buffer and run torch's float GEMM on it (float32 and bfloat16): the dequantization
  is paid once per call, not per row, so it serves many-row (prefill) calls at float GEMM speed,
  where the two above, built for streaming the weight at few rows, fall behind.
- :class:`W8A8GEMM` (``"w8a8"``, ``int8_gemm.c`` part 2): activations quantized to int8 too (per row),
  int8 dot products (VNNI). Not the weight-only scheme: a candidate of ``quantization="w8a8"``
  only (``registry.W8A8_KERNELS``, beside ``w8a8_torch.TorchW8A8GEMM`` and ``IntMMW8A8GEMM``).

None can give the float weight back (``exact_unpack`` False), so the module keeps its float
weight while packed (``close()`` restores the model exactly); only the int8 copy is read in steps.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import torch

from .dequant_gemm import DequantFloatGEMM  # noqa: F401  (one of this module's kernels, in its own file)
from .gemm_kernel import PackedWeight
from .int8_library import int8_library, native_int8_gemm, vnni_scratch_bytes, w8a8_gemm  # noqa: F401
from .int8_weights import (  # noqa: F401  (re-exported: the quantization's former home)
    QMAX,
    Int8Kernel,
    check_bias,
    int8_parts,
    is_plain_tensor,
    is_torchao_int8_weight_only,
    logical_dtype,
    quantize_int8,
    reference_weight,
)

_BF16_K_MULTIPLE = 64  # aten._weight_int8pack_mm's bf16 path is safe for these in_features only


class _CInt8Kernel(Int8Kernel):
    """An int8 kernel of ``int8_gemm.c``: built with ``extra_flags`` (tests build the AVX2 and
    no-VNNI paths on an AVX-512 machine), named in the tuner's cache by its build, and given a
    contiguous float32 bias (the C code reads float32)."""

    def __init__(self, extra_flags: tuple[str, ...] = ()) -> None:
        self._lib = int8_library(tuple(extra_flags))

    @property
    def build_id(self) -> str:
        return Path(self._lib.path).stem

    @staticmethod
    def step_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if bias is None else bias.detach().to(torch.float32).contiguous()


class TorchInt8GEMM(Int8Kernel):
    """torch's weight-only int8 CPU kernel, ``aten._weight_int8pack_mm`` (``x [m, in]`` float32 or
    bfloat16, ``Wq [out, in]`` int8, ``s [out]`` in ``x``'s dtype). Packed: ``data`` the int8
    weight, ``scales`` in the weight's dtype."""

    name = "torch-int8"
    isa = "torch"
    build_id = ""
    dtypes = (torch.float32, torch.bfloat16)

    def supports(self, weight: torch.Tensor) -> bool:
        """float32 weights; bfloat16 ones with ``in_features`` a multiple of 64; CPU, 2-D; plain or
        torchao int8 weight-only."""
        if weight.device.type != "cpu" or weight.dim() != 2 or logical_dtype(weight) not in self.dtypes:
            return False
        if not (is_plain_tensor(weight) or is_torchao_int8_weight_only(weight)):
            return False
        return logical_dtype(weight) == torch.float32 or weight.shape[1] % _BF16_K_MULTIPLE == 0

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """The int8 weight and its scales (quantized here from a float weight). RuntimeError for a
        weight :meth:`supports` rejects."""
        if not self.supports(weight):
            raise RuntimeError(
                f"torch-int8 cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}"
            )
        q, s = int8_parts(weight)
        dtype = logical_dtype(weight)
        return PackedWeight(q, tuple(weight.shape), dtype, scales=s.to(dtype))

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` (the packed dtype, CPU) → ``[..., out_features]``. RuntimeError when
        ``x`` or ``bias`` does not fit."""
        if x.device.type != "cpu" or x.dtype != packed.dtype or not x.dim() or x.shape[-1] != packed.shape[1]:
            raise RuntimeError(
                f"torch-int8 linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit a packed "
                f"{packed.dtype} CPU weight of {packed.shape[1]} inputs"
            )
        check_bias(self.name, bias, out_features)
        return self.linear_verified(x, packed, bias, out_features)

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        k = x.shape[-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, k).contiguous(), packed.data, packed.scales)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], out_features)


class NativeInt8GEMM(_CInt8Kernel):
    """Our weight-only int8 GEMM (``int8_gemm.c``, part 1): the int8 weight in panels of ``nr``
    output columns (64 with AVX-512, 32 with 256-bit vectors), ``[ceil(out/nr), in, nr]`` (within a
    panel's ``nr`` bytes, column ``v * nr/4 + i`` at byte ``4 * i + v``), float32 scales ``[out]``;
    float32 inputs, float32 accumulation, the scale applied per output.

    Args:
        extra_flags: compiler flags after the defaults (tests build the 256-bit path with
            ``("-mno-avx512f",)`` on an AVX-512 machine).

    Raises:
        RuntimeError: on construction, when the kernel cannot be built or run here.
    """

    name = "native-int8"
    dtypes = (torch.float32,)
    movsx = False
    """Widen the weights with VPMOVSXBD rather than shifts (:class:`NativeInt8MovsxGEMM`)."""

    @property
    def isa(self) -> str:
        return self._lib.isa

    def supports(self, weight: torch.Tensor) -> bool:
        """float32 (plain or torchao int8 weight-only) 2-D CPU weights."""
        if weight.device.type != "cpu" or weight.dim() != 2 or logical_dtype(weight) != torch.float32:
            return False
        return is_plain_tensor(weight) or is_torchao_int8_weight_only(weight)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        if not self.supports(weight):
            raise RuntimeError(
                f"native-int8 cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}"
            )
        q, s = int8_parts(weight)
        n, k = q.shape
        lib = self._lib
        out = torch.empty((-(-n // lib.nr), k, lib.nr), dtype=torch.int8)
        lib.pack(q.data_ptr(), n, k, out.data_ptr())
        return PackedWeight(out, (n, k), torch.float32, scales=s.contiguous())

    def adopt(self, packed: PackedWeight) -> Optional[PackedWeight]:
        """``packed`` itself when it is a copy this kernel reads as it is (another native-int8
        kernel's panels of this build's width: :class:`NativeInt8GEMM` and
        :class:`NativeInt8MovsxGEMM` share the layout), else None: a ``DispatchGEMM`` of the two
        then holds one int8 weight, not two."""
        data, scales, nr = packed.data, packed.scales, self._lib.nr
        if not isinstance(data, torch.Tensor) or data.dtype != torch.int8 or data.dim() != 3:
            return None
        n, k = packed.shape
        if packed.dtype != torch.float32 or packed.zero_points is not None or scales is None:
            return None
        if tuple(data.shape) != (-(-n // nr), k, nr) or scales.dtype != torch.float32 or tuple(scales.shape) != (n,):
            return None
        return packed

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` float32 CPU → ``[..., out_features]``; RuntimeError when ``x`` or
        ``bias`` does not fit the packed weight (the C kernel trusts its arguments)."""
        if torch.compiler.is_compiling():
            return self._op(x, packed.data, packed.scales, None, bias, out_features)
        self.check_call(x, packed, bias, out_features)  # packed.dtype is float32: so must x be
        return native_int8_gemm(
            x, packed.data, packed.scales, self.step_bias(bias), out_features, self._lib, self.movsx
        )

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._op(x, packed.data, packed.scales, None, bias, out_features)
        return native_int8_gemm(x, packed.data, packed.scales, bias, out_features, self._lib, self.movsx)

    @property
    def _op(self):
        """The opaque op a compiled forward calls (the default build's library, as registered)."""
        ops = torch.ops.hf_contbatch
        return ops.native_int8_movsx_linear if self.movsx else ops.native_int8_linear


class NativeInt8MovsxGEMM(NativeInt8GEMM):
    """:class:`NativeInt8GEMM` with each input feature's weights widened by ``VPMOVSXBD`` (load and
    sign-extend 16 bytes in one instruction) instead of shifts: the same packed layout, the same
    in-order float32 FMA chain per output (bit-identical results), fewer vector instructions on the
    ports Intel's 512-bit shifts share with the conversions and FMAs; on CPUs where the shifts win
    (Zen 5) the tuner keeps :class:`NativeInt8GEMM`. A candidate of ``quantization="int8"`` beside it.

    Raises:
        RuntimeError: on construction, where the build has no such path (not x86 with AVX2 or
            AVX-512), or the kernel cannot be built or run here.
    """

    name = "native-int8-movsx"
    movsx = True

    def __init__(self, extra_flags: tuple[str, ...] = ()) -> None:
        super().__init__(extra_flags)
        if not self._lib.has_movsx:
            raise RuntimeError(f"native-int8-movsx needs x86 with AVX2 or AVX-512 (this build: {self._lib.isa})")


MAX_W8A8_IN_FEATURES = 65_000
"""The largest ``in_features`` :class:`W8A8GEMM` takes: its int32 sums of ``255 * 127`` products stay
below ``2**31`` up to there."""


class W8A8GEMM(_CInt8Kernel):
    """Int8 weights and int8 activations (``int8_gemm.c``, part 2): each row of ``x`` quantized on
    the fly, symmetric with one scale per row (``sx = absmax(row) / 127``, ``xq = rint(x / sx)``),
    int8 x int8 products summed in int32 by VNNI's ``VPDPBUSD`` (AVX512-VNNI, else AVX-VNNI, else a
    portable C loop), ``y = sum * sx * s[out] (+ b)``. The dynamic per-token activation quantization
    of LLM.int8()'s vector-wise scheme (Dettmers et al., 2022) and of oneDNN/vLLM's W8A8.

    Packed: ``data`` the int8 weight in panels of ``nr`` (64 with AVX-512) output columns and quads of
    inputs, ``[ceil(out/nr), ceil(in/4), nr, 4]``; ``scales`` float32 ``[out]``; ``zero_points`` int32
    ``[out]``: each column's weight sum, which removes the ``+128`` that makes activations unsigned
    for ``VPDPBUSD`` (``sum (xq + 128) * w = sum xq * w + 128 * colsum``), computed once at pack.

    It is not the weight-only scheme: the activations lose precision too (about 1/254 of a row's
    largest magnitude each), so it serves ``quantization="w8a8"`` only, never the weight-only
    ``"int8"`` (``registry.QUANTIZED_KERNELS``).
    ``x`` float32 or bfloat16, read as it is (a bfloat16 row is quantized from its exact float32
    value); the output is written in ``x``'s dtype (bfloat16: the float32 result rounded to nearest
    even, as ``Tensor.to``).

    Args:
        extra_flags: compiler flags after the defaults (``("-mno-avx512f",)``: the AVX-VNNI path).

    Raises:
        RuntimeError: on construction, when the kernel cannot be built or run here.
    """

    name = "w8a8"
    dtypes = (torch.float32, torch.bfloat16)
    probe_tolerance = 3e-2
    """Relative tolerance against ``F.linear`` over the dequantized weight (``packed_linears``' probe):
    the activation rounding, not only the summation order, separates the two."""

    def __init__(self, extra_flags: tuple[str, ...] = ()) -> None:
        super().__init__(extra_flags)
        # The quantized activations' buffer, reused across calls (a fresh multi-MB buffer a call cost
        # page faults and zeroing comparable to the quantization itself); one per thread, since an
        # engine's scheduler thread and a tuning or test thread may share this object.
        self._local = threading.local()

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """This thread's uint8 scratch of at least ``nbytes`` (grown, never shrunk; read by C only)."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.scratch = torch.empty(nbytes, dtype=torch.uint8)
        return buf

    @property
    def isa(self) -> str:
        return self._lib.vnni_isa

    def supports(self, weight: torch.Tensor) -> bool:
        """float32 or bfloat16 (plain or torchao int8 weight-only) 2-D CPU weights of at most
        :data:`MAX_W8A8_IN_FEATURES` inputs."""
        if weight.device.type != "cpu" or weight.dim() != 2 or logical_dtype(weight) not in self.dtypes:
            return False
        if weight.shape[1] > MAX_W8A8_IN_FEATURES:
            return False
        return is_plain_tensor(weight) or is_torchao_int8_weight_only(weight)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """RuntimeError for a weight :meth:`supports` rejects."""
        if not self.supports(weight):
            raise RuntimeError(f"w8a8 cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}")
        q, s = int8_parts(weight)
        q = q.contiguous()
        n, k = q.shape
        nr = self._lib.vnni_nr
        out = torch.empty((-(-n // nr), -(-k // 4), nr, 4), dtype=torch.int8)
        colsum = torch.empty(n, dtype=torch.int32)
        self._lib.vnni_pack(q.data_ptr(), n, k, out.data_ptr(), colsum.data_ptr())
        return PackedWeight(out, (n, k), logical_dtype(weight), scales=s.contiguous(), zero_points=colsum)

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` (the packed dtype, CPU) → ``[..., out_features]``; RuntimeError when
        ``x`` or ``bias`` does not fit (the C kernel trusts its arguments)."""
        self.check_call(x, packed, bias, out_features)
        return self.linear_verified(x, packed, self.step_bias(bias), out_features)

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a traced graph calls the C kernel as one opaque op
            return torch.ops.hf_contbatch.w8a8_linear(
                x, packed.data, packed.scales, packed.zero_points, bias, out_features
            )
        return w8a8_gemm(
            x, packed.data, packed.scales, packed.zero_points, bias, out_features, self._lib, self._scratch
        )
