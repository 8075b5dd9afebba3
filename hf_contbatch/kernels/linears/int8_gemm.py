"""Int8 linears: the weight quantization, and the GEMM kernels that serve it.

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
- :class:`DequantFloatGEMM` (``"dequant-float"``): dequantize a tile of output columns at a time
  into a reused buffer and run torch's float GEMM on it (float32 and bfloat16): the dequantization
  is paid once per call, not per row, so it serves many-row (prefill) calls at float GEMM speed,
  where the two above, built for streaming the weight at few rows, fall behind.
- :class:`W8A8GEMM` (``"w8a8"``, ``int8_gemm.c`` part 2): activations quantized to int8 too (per row),
  int8 dot products (VNNI). Not the weight-only scheme: a candidate of ``quantization="w8a8"``
  only (``registry.W8A8_KERNELS``, beside ``w8a8_torch.TorchW8A8GEMM``).

None can give the float weight back (``exact_unpack`` False), so the module keeps its float
weight while packed (``close()`` restores the model exactly); only the int8 copy is read in steps.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..native_build import build_library
from .gemm_kernel import PackedWeight
from .linear_op import register_linear_op

_SOURCE = Path(__file__).with_name("int8_gemm.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
QMAX = 127
"""The largest magnitude of a quantized weight (symmetric: the range is ``[-127, 127]``)."""
_BF16_K_MULTIPLE = 64  # aten._weight_int8pack_mm's bf16 path is safe for these in_features only


def is_torchao_int8_weight_only(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a torchao ``Int8Tensor`` in int8 weight-only form: int8 ``qdata``
    ``[out, in]``, one scale per output row (``block_size == [1, in]``) and no activation
    quantization (``Int8DynamicActivationInt8WeightConfig`` sets ``act_quant_kwargs``)."""
    if type(weight).__name__ != "Int8Tensor" or not type(weight).__module__.startswith("torchao"):
        return False
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if not isinstance(qdata, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return False
    return (
        qdata.dtype == torch.int8
        and qdata.dim() == 2
        and list(getattr(weight, "block_size", [])) == [1, qdata.shape[1]]
        and scale.numel() == qdata.shape[0]
        and getattr(weight, "act_quant_kwargs", None) is None
    )


def is_plain_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ordinary dense tensor (or Parameter), not a tensor subclass such as a
    quantized weight whose storage is not float data."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and type(t.data) is torch.Tensor and t.layout == torch.strided


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq, s)`` for a float ``[out, in]`` weight: ``s = absmax(row) / 127`` (float32, rounded to
    ``scale_dtype`` and used as rounded), ``Wq = round(W / s).clamp(-127, 127)`` int8. A row of
    zeros gets ``s = 1`` (its ``Wq`` is zeros either way)."""
    w = weight.detach().float()
    s = w.abs().amax(dim=1) / QMAX
    s = torch.where(s > 0, s, torch.ones_like(s)).to(scale_dtype).float()
    q = torch.round(w / s[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, s


def int8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq int8 [out, in], s float32 [out])`` of a weight: a torchao int8 weight-only tensor's own
    values (exact), else :func:`quantize_int8` of the float weight (scales rounded to the weight's
    dtype, so a bfloat16 kernel's scales are the ones used)."""
    if is_torchao_int8_weight_only(weight):
        return weight.qdata.contiguous(), weight.scale.reshape(-1).float()
    if not is_plain_tensor(weight) or not weight.is_floating_point():
        raise RuntimeError(f"cannot quantize a {type(weight).__name__} {weight.dtype} weight to int8")
    return quantize_int8(weight, weight.dtype)


def reference_weight(weight: torch.Tensor) -> torch.Tensor:
    """The float weight an int8 kernel multiplies by, ``Wq * s`` in ``weight``'s dtype: what a
    packed int8 linear is probed against."""
    q, s = int8_parts(weight)
    return (q.float() * s[:, None]).to(weight.dtype)


def _logical_dtype(weight: torch.Tensor) -> torch.dtype:
    return weight.dtype  # a torchao Int8Tensor reports the dtype it dequantizes to


def _check_bias(name: str, bias: Optional[torch.Tensor], out_features: int) -> None:
    if bias is not None and (
        not bias.is_floating_point() or bias.device.type != "cpu" or tuple(bias.shape) != (out_features,)
    ):
        raise RuntimeError(
            f"{name} linear: bias {tuple(bias.shape)} {bias.dtype} on {bias.device} does not fit {out_features} CPU outputs"
        )


class _Int8Kernel:
    """What every int8 weight-only kernel here shares: the packed int8 weight and its scales are the
    only copy (``unpack`` gives no float weight back: ``close()`` restores the model's own), the
    reference weight is the dequantized one, and the bias is passed as it is."""

    exact_unpack = False  # int8 values: the float weight cannot be given back
    reference_weight = staticmethod(reference_weight)

    def unpack(self, packed: PackedWeight) -> None:
        return None

    def check_call(self, x: torch.Tensor, packed: PackedWeight, bias, out_features: int) -> None:
        """RuntimeError naming the kernel when ``x`` (``[..., in]``, the packed dtype, CPU) or
        ``bias`` (``[out_features]``) does not fit ``packed``."""
        n, k = packed.shape
        if x.device.type != "cpu" or x.dtype != packed.dtype or not x.dim() or x.shape[-1] != k or n != out_features:
            raise RuntimeError(
                f"{self.name} linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit a packed "
                f"{packed.dtype} int8 weight of {k} inputs and {n} outputs"
            )
        _check_bias(self.name, bias, out_features)

    @staticmethod
    def step_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if bias is None else bias.detach()


class _CInt8Kernel(_Int8Kernel):
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


class TorchInt8GEMM(_Int8Kernel):
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
        if weight.device.type != "cpu" or weight.dim() != 2 or _logical_dtype(weight) not in self.dtypes:
            return False
        if not (is_plain_tensor(weight) or is_torchao_int8_weight_only(weight)):
            return False
        return _logical_dtype(weight) == torch.float32 or weight.shape[1] % _BF16_K_MULTIPLE == 0

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """The int8 weight and its scales (quantized here from a float weight). RuntimeError for a
        weight :meth:`supports` rejects."""
        if not self.supports(weight):
            raise RuntimeError(
                f"torch-int8 cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}"
            )
        q, s = int8_parts(weight)
        dtype = _logical_dtype(weight)
        return PackedWeight(q, tuple(weight.shape), dtype, scales=s.to(dtype))

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` (the packed dtype, CPU) → ``[..., out_features]``. RuntimeError when
        ``x`` or ``bias`` does not fit."""
        if x.device.type != "cpu" or x.dtype != packed.dtype or not x.dim() or x.shape[-1] != packed.shape[1]:
            raise RuntimeError(
                f"torch-int8 linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit a packed "
                f"{packed.dtype} CPU weight of {packed.shape[1]} inputs"
            )
        _check_bias(self.name, bias, out_features)
        return self.linear_verified(x, packed, bias, out_features)

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        k = x.shape[-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, k).contiguous(), packed.data, packed.scales)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], out_features)


@dataclass(frozen=True)
class Int8Library:
    """The compiled ``int8_gemm.c``: its functions, panel widths and vector ISAs (weight-only:
    ``nr``, ``isa``; int8 activations: ``vnni_nr``, ``vnni_isa``, "generic" without VNNI)."""

    path: str
    pack: Callable
    gemm: Callable
    nr: int
    isa: str
    vnni_pack: Callable
    vnni_gemm: Callable
    vnni_scratch: Callable
    vnni_nr: int
    vnni_isa: str


@functools.cache
def _load_library(extra_flags: tuple[str, ...] = ()):
    """(Int8Library, None) or (None, the exception): built once per process and flags, a failure too."""
    try:
        path = build_library(_SOURCE, [*_FLAGS, *extra_flags])
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, exc
    if not lib.hf_contbatch_int8_runtime_ok():
        return None, RuntimeError("the CPU lacks the vector instructions the int8 GEMM was built for")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hf_contbatch_int8_pack.argtypes, lib.hf_contbatch_int8_pack.restype = [ptr, i64, i64, ptr], None
    lib.hf_contbatch_int8_gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, i64]
    lib.hf_contbatch_int8_gemm.restype = None
    lib.hf_contbatch_int8_vnni_pack.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.hf_contbatch_int8_vnni_pack.restype = None
    lib.hf_contbatch_int8_vnni_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64]
    lib.hf_contbatch_int8_vnni_gemm.restype = None
    lib.hf_contbatch_int8_vnni_scratch.argtypes, lib.hf_contbatch_int8_vnni_scratch.restype = [i64, i64], i64
    for f in ("hf_contbatch_int8_nr", "hf_contbatch_int8_vnni_nr"):
        getattr(lib, f).restype = i64
    for f in ("hf_contbatch_int8_isa", "hf_contbatch_int8_vnni_isa"):
        getattr(lib, f).restype = ctypes.c_char_p
    return (
        Int8Library(
            str(path),
            lib.hf_contbatch_int8_pack,
            lib.hf_contbatch_int8_gemm,
            int(lib.hf_contbatch_int8_nr()),
            lib.hf_contbatch_int8_isa().decode(),
            lib.hf_contbatch_int8_vnni_pack,
            lib.hf_contbatch_int8_vnni_gemm,
            lib.hf_contbatch_int8_vnni_scratch,
            int(lib.hf_contbatch_int8_vnni_nr()),
            lib.hf_contbatch_int8_vnni_isa().decode(),
        ),
        None,
    )


def int8_library(extra_flags: tuple[str, ...] = ()) -> Int8Library:
    """The compiled int8 GEMMs (``extra_flags`` after the defaults, e.g. ``("-mno-avx512f",)`` for
    the 256-bit paths). Raises RuntimeError naming why it cannot be built or run here."""
    library, exc = _load_library(tuple(extra_flags))
    if exc is not None:
        raise RuntimeError(f"our int8 GEMM cannot be built: {type(exc).__name__}: {exc}") from exc
    return library


def _native_int8_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias, out_features: int, lib=None):
    k = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], out_features))
    m = x.numel() // k if k else 0
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    if m:
        (lib or int8_library()).gemm(
            x.data_ptr(),
            m,
            k,
            packed.data_ptr(),
            out_features,
            scales.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
    return y


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

    @property
    def isa(self) -> str:
        return self._lib.isa

    def supports(self, weight: torch.Tensor) -> bool:
        """float32 (plain or torchao int8 weight-only) 2-D CPU weights."""
        if weight.device.type != "cpu" or weight.dim() != 2 or _logical_dtype(weight) != torch.float32:
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

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` float32 CPU → ``[..., out_features]``; RuntimeError when ``x`` or
        ``bias`` does not fit the packed weight (the C kernel trusts its arguments)."""
        if torch.compiler.is_compiling():
            return torch.ops.hf_contbatch.native_int8_linear(x, packed.data, packed.scales, None, bias, out_features)
        self.check_call(x, packed, bias, out_features)  # packed.dtype is float32: so must x be
        return _native_int8_gemm(x, packed.data, packed.scales, self.step_bias(bias), out_features, self._lib)

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.hf_contbatch.native_int8_linear(x, packed.data, packed.scales, None, bias, out_features)
        return _native_int8_gemm(x, packed.data, packed.scales, bias, out_features, self._lib)


def _panel_columns(data: torch.Tensor) -> torch.Tensor:
    """A view ``[panels, 4, nr / 4, in]`` of :class:`NativeInt8GEMM`'s packed int8 panels
    ``[panels, in, nr]`` in output-column order: ``int8_gemm.c`` stores column ``v * nr/4 + i`` of a
    panel in byte ``4 * i + v`` (byte ``v`` of 32-bit lane ``i``, unpacked by shifts)."""
    panels, k, nr = data.shape
    return data.view(panels, k, nr // 4, 4).permute(0, 3, 2, 1)


class DequantFloatGEMM(_Int8Kernel):
    """Weight-only int8 by dequantizing and multiplying in float: for each tile of ``tile_columns``
    output columns, ``Wt = (Wq[tile] * s[tile])`` in ``x``'s dtype (float32 product, then rounded:
    the very weight :func:`reference_weight` gives) written into a scratch buffer reused across
    calls, then ``y[:, tile] = x @ Wt.T (+ b[tile])`` by torch's float GEMM (``torch.mm`` /
    ``torch.addmm`` into the output's column slice). The same numbers as
    ``F.linear(x, Wq * s, b)`` up to the GEMM's summation order. Tiling keeps the float copy bounded
    (``tile_columns * in_features`` values per thread, not a whole float weight) and small enough to
    stay in cache between its dequantization and its GEMM. It costs ``out * in`` dequantized values a
    call whatever the row count, so it pays at many rows (prefill) and loses to
    :class:`NativeInt8GEMM` at few; ``autotune`` picks per row bucket.

    Packed: ``data`` the int8 weight ``[out, in]`` row-major, ``scales`` float32 ``[out]``; or, when
    it serves beside :class:`NativeInt8GEMM` (``autotune`` gave each its row buckets), that kernel's
    own packed copy, ``[ceil(out/nr), in, nr]`` panels, read in place (:meth:`adopt`): one int8 copy
    of the weight, not two (the point of int8 is also the memory).

    Args:
        tile_bytes: float32 bytes of one dequantized tile; ``tile_columns`` is this over
            ``4 * in_features``, rounded down to a multiple of 16 and kept within ``[64, 1024]``
            (fewer columns would make each GEMM call too thin to run at float speed).
    """

    name = "dequant-float"
    isa = "torch"
    dtypes = (torch.float32, torch.bfloat16)
    always_timed = True
    """For ``autotune``: time it at every row bucket, even after it lost far at the small ones (it
    pays the whole weight's dequantization at one row, and wins only from many rows on; its cost is
    a float GEMM plus that, so the timing stays cheap)."""

    def __init__(self, tile_bytes: int = 2 * 2**20) -> None:
        if tile_bytes <= 0:
            raise ValueError(f"tile_bytes must be positive, got {tile_bytes}")
        self.tile_bytes = tile_bytes
        self.build_id = f"tile{tile_bytes}"  # timings hold for one tile size (the tuner's cache key)
        # Scratch per thread (an engine's scheduler thread and a tuning or test thread may share
        # this object): {(in_features, dtype): buffer}.
        self._local = threading.local()

    def tile_columns(self, in_features: int) -> int:
        """Output columns dequantized per GEMM call for ``in_features`` inputs."""
        cols = self.tile_bytes // (4 * max(1, in_features)) // 16 * 16
        return max(64, min(1024, cols))

    def supports(self, weight: torch.Tensor) -> bool:
        """float32 or bfloat16 2-D CPU weights, plain or torchao int8 weight-only."""
        if weight.device.type != "cpu" or weight.dim() != 2 or _logical_dtype(weight) not in self.dtypes:
            return False
        return is_plain_tensor(weight) or is_torchao_int8_weight_only(weight)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """The int8 weight (row-major) and float32 scales. RuntimeError for a weight
        :meth:`supports` rejects."""
        if not self.supports(weight):
            raise RuntimeError(
                f"dequant-float cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}"
            )
        q, s = int8_parts(weight)
        return PackedWeight(q.contiguous(), tuple(weight.shape), _logical_dtype(weight), scales=s.contiguous())

    def adopt(self, packed: PackedWeight) -> Optional[PackedWeight]:
        """This kernel's packed copy reading ``packed``'s int8 values in place, when ``packed`` is a
        float32 :class:`NativeInt8GEMM` copy (panels ``[ceil(out/nr), in, nr]``, float32 scales
        ``[out]``), else None. The scales are zero-padded to whole panels (a few bytes); the int8
        data is the same tensor (``PackedWeight.nbytes`` of a dispatching copy counts it once)."""
        data, scales = packed.data, packed.scales
        if not isinstance(data, torch.Tensor) or data.dtype != torch.int8 or data.dim() != 3 or scales is None:
            return None
        n, k = packed.shape
        panels, nr = data.shape[0], data.shape[2]
        if packed.dtype != torch.float32 or data.shape[1] != k or not nr or panels != -(-n // nr):
            return None
        if scales.dtype != torch.float32 or tuple(scales.shape) != (n,):
            return None
        padded = torch.zeros(panels * nr, dtype=torch.float32)
        padded[:n] = scales
        return PackedWeight(data, (n, k), torch.float32, scales=padded)

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` (the packed dtype, CPU) → ``[..., out_features]``. RuntimeError when
        ``x`` or ``bias`` does not fit."""
        self.check_call(x, packed, bias, out_features)
        return self.linear_verified(x, packed, None if bias is None else bias.detach(), out_features)

    def _scratch(self, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """This thread's ``(float32 tile, tile in dtype or None for float32)``, ``[tile_columns, k]``."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        # Buffers made inside an engine step are inference tensors, which a forward outside
        # inference mode (a user's own call, the quality report) may not write: one set per mode.
        key = (k, dtype, torch.is_inference_mode_enabled())
        if key not in buffers:
            cols = self.tile_columns(k)
            f32 = torch.empty((cols, k), dtype=torch.float32)
            buffers[key] = (f32, None if dtype == torch.float32 else torch.empty((cols, k), dtype=dtype))
        return buffers[key]

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        n, k = packed.shape
        x2 = x.reshape(-1, k)
        y = x.new_empty((x2.shape[0], out_features))
        if not x2.shape[0]:
            return y.reshape(*x.shape[:-1], out_features)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        panels = packed.data.dim() == 3  # a NativeInt8GEMM copy, adopted: [ceil(n/nr), k, nr]
        if torch.compiler.is_compiling():  # no scratch mutation in a graph: the whole weight at once
            q = _panel_columns(packed.data).reshape(-1, k) if panels else packed.data
            w = (q.float() * packed.scales[:, None])[:n].to(x.dtype)
            return torch.nn.functional.linear(x, w, bias)
        f32, low = self._scratch(k, x.dtype)
        nr = packed.data.shape[2] if panels else 1
        cols = max(nr, f32.shape[0] // nr * nr)  # whole panels per tile
        for j0 in range(0, n, cols):
            j1 = min(n, j0 + cols)
            if panels:  # whole panels (the last one's padding columns have scale 0), then cut
                p0, p1 = j0 // nr, -(-j1 // nr)
                src = _panel_columns(packed.data[p0:p1])  # [panels, 4, nr / 4, k]
                w32 = f32[: (p1 - p0) * nr]
                torch.mul(src, packed.scales[p0 * nr : p1 * nr].view(src.shape[:3] + (1,)), out=w32.view(src.shape))
                w32 = w32[: j1 - j0]
            else:
                w32 = f32[: j1 - j0]
                torch.mul(packed.data[j0:j1], packed.scales[j0:j1, None], out=w32)
            w = w32 if low is None else low[: j1 - j0].copy_(w32)
            if bias is None:
                torch.mm(x2, w.t(), out=y[:, j0:j1])
            else:
                torch.addmm(bias[j0:j1], x2, w.t(), out=y[:, j0:j1])
        return y.reshape(*x.shape[:-1], out_features)


def vnni_scratch_bytes(m: int, k: int) -> int:
    """Bytes of scratch ``hf_contbatch_int8_vnni_gemm`` needs for ``m`` rows of ``k`` features (its C
    twin ``hf_contbatch_int8_vnni_scratch``, computed here to save a foreign call per step)."""
    return m * (-(-k // 4) * 4 + 4) + 64


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
        if weight.device.type != "cpu" or weight.dim() != 2 or _logical_dtype(weight) not in self.dtypes:
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
        return PackedWeight(out, (n, k), _logical_dtype(weight), scales=s.contiguous(), zero_points=colsum)

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
        return _w8a8_gemm(
            x, packed.data, packed.scales, packed.zero_points, bias, out_features, self._lib, self._scratch
        )


def _w8a8_gemm(x, data, scales, colsum, bias, out_features: int, lib=None, scratch=None) -> torch.Tensor:
    """``W8A8GEMM``'s product: ``x [..., k]`` float32/bfloat16, the packed int8 weight, float32
    scales, int32 column sums, float32 bias or None → ``[..., out_features]`` in ``x``'s dtype.
    ``scratch(nbytes)`` gives a reusable uint8 buffer (default: a fresh one)."""
    n, k = out_features, x.shape[-1]
    # A contiguous [..., in] tensor is already the [rows, in] matrix the kernel reads: no reshape
    # (a decode step makes dozens of these calls; each Python-side op costs about a microsecond).
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], n))
    m = x.numel() // k if k else 0
    if m:
        # x read in its own dtype and y written in it by the C kernel (no float32 copies).
        nbytes = vnni_scratch_bytes(m, k)
        buf = scratch(nbytes) if scratch is not None else torch.empty(nbytes, dtype=torch.uint8)
        (lib or int8_library()).vnni_gemm(
            x.data_ptr(),
            m,
            k,
            data.data_ptr(),
            colsum.data_ptr(),
            n,
            scales.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            buf.data_ptr(),
            torch.get_num_threads(),
            x.dtype == torch.bfloat16,
        )
    elif k == 0 and y.numel():
        y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    return y


def _native_int8_op(x, packed, scales, zero_points, bias, out_features: int) -> torch.Tensor:
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    return _native_int8_gemm(x, packed, scales, bias, out_features)


register_linear_op("native_int8_linear", _native_int8_op)


def _w8a8_op(x, packed, scales, zero_points, bias, out_features: int) -> torch.Tensor:
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    return _w8a8_gemm(x, packed, scales, zero_points, bias, out_features)


register_linear_op("w8a8_linear", _w8a8_op)
