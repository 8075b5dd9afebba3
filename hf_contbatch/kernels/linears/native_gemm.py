"""Our GEMM (``cpu_gemm.c``), built with the system C compiler and called through ctypes.

Weights are packed once into panels of ``GemmLibrary.nr`` output columns (32 with AVX-512, 16 with
256-bit vectors); the kernel streams them, which is what a decode step's few rows need (see
``cpu_gemm.c`` for the design and why each float32 output is one in-order multiply-add chain, so a
row's result does not depend on the batch it is in). Half-precision weights (bfloat16, float16) take
the same kernel with each weight widened to float32 in registers as it is loaded (a 16-bit shift for
bfloat16, F16C's conversion for float16): half the bytes to stream, float32 arithmetic, on any CPU
with vectors. On CPUs with AVX512-BF16 the library also has a bfloat16 kernel multiplying pairs of
bf16 values with VDPBF16PS (float32 accumulation, one rounding at the end); which of the two a
:class:`NativeGEMM` packs for is its ``half_isa``. The library is built once per
process (``hf_contbatch.kernels.native_build`` caches it on disk) and shared like any loaded library.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..native_build import EMULATIONS, build_library
from .gemm_kernel import PackedWeight
from .linear_op import register_linear_op

_GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.c")
# No -ffast-math: each float32 output must stay one in-order FMA chain (see cpu_gemm.c, "Exactness").
_GEMM_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_BF16_PANEL = 32  # output columns per bf16 panel (NRB in cpu_gemm.c), in pairs of input features
HALF_ISAS = ("avx512_bf16", "widen")
"""How :class:`NativeGEMM` multiplies bfloat16 weights: "avx512_bf16", pairs of bf16 values by
VDPBF16PS (CPUs with AVX512-BF16); "widen", each weight widened to float32 in registers (any CPU)."""


@dataclass(frozen=True)
class GemmLibrary:
    """The compiled GEMM: its functions, the float32 panel width ``nr`` (output columns), the
    instruction set its vectors compile to (``isa``: "avx512f", "avx2", "neon" or "generic"), the
    widening half-precision functions (``pack_h16``, ``gemm_wbf16``; ``gemm_wf16`` where the CPU
    converts float16 in vectors, F16C, else None), ``widen_panels`` (a group of widening-layout
    panels to float32 for a float32 GEMM: ``widen_gemm``), the VDPBF16PS bfloat16 functions where the
    CPU has AVX512-BF16 (else None), and the float32 GEMM packing x into row tiles at prefill row
    counts where the build has those tiles (AVX-512; else None: :class:`NativePackedXGEMM`)."""

    path: str
    pack_f32: Callable
    gemm_f32: Callable
    nr: int
    isa: str
    pack_bf16: Optional[Callable]
    gemm_bf16: Optional[Callable]
    pack_h16: Callable
    gemm_wbf16: Callable
    gemm_wf16: Optional[Callable]
    widen_panels: Callable
    gemm_f32_packed_x: Optional[Callable] = None

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The weight dtypes this build multiplies (bfloat16 always: widened where not native)."""
        return (torch.float32, torch.bfloat16) + ((torch.float16,) if self.gemm_wf16 is not None else ())


@functools.cache
def _load_native_library(bf16: bool = True):
    """(GemmLibrary, None) or (None, the exception that prevented it): built once per process, a
    failure too (no compiler: every later engine falls back at once instead of retrying the build).
    ``bf16=False``: the build of a CPU without native half precision (``native_build.EMULATIONS["no-bf16"]``:
    bfloat16 weights widened), on any CPU."""
    try:
        path = build_library(_GEMM_SOURCE, _GEMM_FLAGS if bf16 else [*_GEMM_FLAGS, *EMULATIONS["no-bf16"]])
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # no/broken compiler, dlopen failed
        return None, exc
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for prefix in ("f32", "bf16"):
        pack, gemm = (
            getattr(lib, f"hf_contbatch_gemm_pack_{prefix}", None),
            getattr(lib, f"hf_contbatch_gemm_{prefix}", None),
        )
        if pack is not None:
            pack.argtypes, pack.restype = [ptr, i64, i64, ptr], None
            gemm.argtypes, gemm.restype = [ptr, i64, i64, ptr, i64, ptr, ptr, i64], None
    lib.hf_contbatch_gemm_pack_h16.argtypes, lib.hf_contbatch_gemm_pack_h16.restype = [ptr, i64, i64, ptr], None
    has_f16 = bool(lib.hf_contbatch_gemm_has_f16())
    for name in ("wbf16", "wf16") if has_f16 else ("wbf16",):
        fn = getattr(lib, f"hf_contbatch_gemm_{name}")
        fn.argtypes, fn.restype = [ptr, i64, i64, ptr, i64, ptr, ptr, i64], ctypes.c_int  # -1: out of memory
    lib.hf_contbatch_gemm_widen_panels.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, i64]
    lib.hf_contbatch_gemm_widen_panels.restype = None
    lib.hf_contbatch_gemm_nr.restype = i64
    lib.hf_contbatch_gemm_pack_x_rows.restype = i64
    packed_x = lib.hf_contbatch_gemm_f32_packed_x if lib.hf_contbatch_gemm_pack_x_rows() > 0 else None
    if packed_x is not None:
        packed_x.argtypes, packed_x.restype = [ptr, i64, i64, ptr, i64, ptr, ptr, i64], None
    lib.hf_contbatch_gemm_isa.restype = ctypes.c_char_p
    has_bf16 = bool(lib.hf_contbatch_gemm_has_bf16())
    library = GemmLibrary(
        path=str(path),
        pack_f32=lib.hf_contbatch_gemm_pack_f32,
        gemm_f32=lib.hf_contbatch_gemm_f32,
        nr=int(lib.hf_contbatch_gemm_nr()),
        isa=lib.hf_contbatch_gemm_isa().decode(),
        pack_bf16=lib.hf_contbatch_gemm_pack_bf16 if has_bf16 else None,
        gemm_bf16=lib.hf_contbatch_gemm_bf16 if has_bf16 else None,
        pack_h16=lib.hf_contbatch_gemm_pack_h16,
        gemm_wbf16=lib.hf_contbatch_gemm_wbf16,
        gemm_wf16=lib.hf_contbatch_gemm_wf16 if has_f16 else None,
        widen_panels=lib.hf_contbatch_gemm_widen_panels,
        gemm_f32_packed_x=packed_x,
    )
    return library, None


def native_library(bf16: bool = True) -> GemmLibrary:
    """The compiled GEMM, shared by the process like any loaded library; ``bf16=False``: the
    build a CPU without AVX512-BF16 gets (no VDPBF16PS kernel: bfloat16 weights widened; its float32
    kernel is the same code).

    Raises:
        RuntimeError: the kernel cannot be built here (see ``native_build``); the message names why.
    """
    library, exc = _load_native_library(bf16)
    if exc is not None:
        raise RuntimeError(f"our GEMM cannot be built: {type(exc).__name__}: {exc}") from exc
    return library


def _fits(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> bool:
    """Whether ``x`` ``[..., in]`` matches the packed weight's dtype and sizes (float32 and widened
    half-precision panels ``[P, in, nr]``, VDPBF16PS bf16 panels ``[P, in / 2, 32, 2]``)."""
    if x.device.type != "cpu" or x.dtype != packed.dtype or not x.dim():
        return False
    if packed.dim() == 4:
        width, k = _BF16_PANEL, 2 * packed.shape[1]
    else:
        width, k = packed.shape[2], packed.shape[1]
    panels = packed.shape[0]
    return x.shape[-1] == k and (panels - 1) * width < out_features <= panels * width


def native_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_features: int,
    library: Optional[GemmLibrary] = None,
    packed_x: bool = False,
) -> torch.Tensor:
    """``x @ W.T + b`` with our GEMM: ``x`` ``[..., in]`` CPU, of the packed weight's dtype
    (float32, bfloat16, or float16 where the build has it), ``packed`` the ``data`` of :meth:`NativeGEMM.pack`,
    ``bias`` ``[out]`` (any float dtype, added in float32) or None; returns ``[..., out]`` in
    ``x``'s dtype. ``library``: the build that runs it (that of the :class:`NativeGEMM` that packed;
    default :func:`native_library`'s). ``packed_x``: float32 through the packed-x tiles at prefill
    row counts (:class:`NativePackedXGEMM`; the build must have them: ``gemm_f32_packed_x``).

    Raises:
        RuntimeError: ``x`` or ``bias`` of another dtype, device or size than the packed weight
            (the C kernel trusts its arguments, so they are checked here).
    """
    if torch.compiler.is_compiling():
        return torch.ops.hf_contbatch.native_linear(x, packed, None, None, bias, out_features)
    if not _fits(x, packed, out_features):
        raise RuntimeError(
            f"native linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit a packed {packed.dtype} "
            f"CPU weight of {out_features} outputs"
        )
    if bias is not None:
        if not bias.is_floating_point() or bias.device.type != "cpu" or bias.shape != (out_features,):
            raise RuntimeError(
                f"native linear: bias {tuple(bias.shape)} {bias.dtype} on {bias.device} does not fit "
                f"{out_features} CPU outputs"
            )
        bias = bias.to(torch.float32).contiguous()  # kept in a local: the kernel reads it after this line
    return _native_gemm(x, packed, bias, out_features, library, packed_x)


def gemm_function(lib: GemmLibrary, dtype: torch.dtype, packed: torch.Tensor, packed_x: bool = False):
    """The ctypes function of ``lib`` that multiplies inputs of ``dtype`` by ``packed``: float32
    (``packed_x``: ``gemm_f32_packed_x``), bfloat16 by VDPBF16PS (a 4-D packing), else the widening
    half-precision kernels, which return -1 when their float32 copy of x cannot be allocated (their
    ``restype`` is ``c_int``; the others return nothing)."""
    if dtype == torch.float32:
        return lib.gemm_f32_packed_x if packed_x else lib.gemm_f32
    if packed.dim() == 4:  # the VDPBF16PS layout
        return lib.gemm_bf16
    return lib.gemm_wbf16 if dtype == torch.bfloat16 else lib.gemm_wf16


def _native_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_features: int,
    library: Optional[GemmLibrary] = None,
    packed_x: bool = False,
) -> torch.Tensor:
    """:func:`native_linear` without its argument checks, for callers that made them already
    (``x`` CPU with the packed weight's dtype and input size, ``bias`` dense float32 ``[out]``).
    ``packed_x``: float32 through ``GemmLibrary.gemm_f32_packed_x`` (the caller checked the build
    has it)."""
    k = x.shape[-1]
    # A contiguous [..., in] tensor is already the [rows, in] matrix the kernel reads: no reshape
    # (each costs more than the check, and a decode step makes dozens of these calls).
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], out_features))
    if k == 0:  # no input features: the product is zero
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    m = x.numel() // k
    if m:
        gemm = gemm_function(library or native_library(), x.dtype, packed, packed_x)
        # ctypes releases the GIL for the call: engines in other threads keep running.
        status = gemm(
            x.data_ptr(),
            m,
            k,
            packed.data_ptr(),
            out_features,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if status == -1:  # the widening kernels' float32 copy of x could not be allocated
            raise MemoryError(f"native linear: no memory for a float32 copy of {m} x {k} inputs")
    return y


class NativeGEMM:
    """Our GEMM (``cpu_gemm.c``): float32 weights packed into panels of ``nr`` output columns,
    ``[ceil(out/nr), in, nr]``; float16 weights (where the CPU converts them in vectors: F16C) and,
    with ``half_isa="widen"``, bfloat16 ones in the same layout with 16-bit values, widened to
    float32 in registers; with ``half_isa="avx512_bf16"``, bfloat16 weights in panels of 32 columns
    by pairs of input features, ``[ceil(out/32), in/2, 32, 2]``, multiplied by VDPBF16PS. Plain
    zero-padded tensors, multiplied by any number of rows with torch's thread count. Each float32
    output is one in-order multiply-add chain over the input features, so a row's result does not
    depend on the batch it is in; a widened half-precision weight gives the float32 kernel's result
    on its widened copy (inputs widened too), rounded once to the weight's dtype; VDPBF16PS outputs
    are accumulated in float32 (two products a step) and rounded once.

    Args:
        bf16: False builds without AVX512-BF16 whatever the CPU has (the build of CPUs without it,
            so its paths can be run on any CPU); bfloat16 weights are then widened.
        half_isa: how bfloat16 weights are multiplied (:data:`HALF_ISAS`); None: detected,
            "avx512_bf16" where the build has it, else "widen". Tests and benchmarks name one to
            run a path on a CPU that would not pick it.

    Raises:
        RuntimeError: on construction, when the kernel cannot be built (no C compiler, or the
            compile failed), or ``half_isa="avx512_bf16"`` and the build has no AVX512-BF16.
        ValueError: a ``half_isa`` not in :data:`HALF_ISAS`.
    """

    name = "native"
    exact_unpack = True  # plain zero-padded panels: unpack gives the weight back bit for bit

    def __init__(self, bf16: bool = True, half_isa: Optional[str] = None) -> None:
        self._bf16 = bool(bf16)
        library = native_library(self._bf16)  # raises here when the kernel cannot be built
        if half_isa is None:
            half_isa = "avx512_bf16" if library.gemm_bf16 is not None else "widen"
        if half_isa not in HALF_ISAS:
            raise ValueError(f"half_isa must be one of {HALF_ISAS}, not {half_isa!r}")
        if half_isa == "avx512_bf16" and library.gemm_bf16 is None:
            raise RuntimeError("our GEMM's build here has no AVX512-BF16 kernel (half_isa='avx512_bf16')")
        self.half_isa = half_isa

    @property
    def library(self) -> GemmLibrary:
        """The compiled GEMM (looked up, not stored: a deepcopy or pickle of a model carries no
        ctypes function)."""
        return native_library(self._bf16)

    @property
    def build_id(self) -> str:
        """Names this build (source, compiler, flags, CPU): timings measured with it stay valid."""
        return Path(self.library.path).stem

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """float32, bfloat16, and float16 where the CPU converts it in vectors (F16C)."""
        return self.library.dtypes

    @property
    def isa(self) -> str:
        """The vectors the build compiled to: "avx512f", "avx2", "neon" or "generic"."""
        return self.library.isa

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether this build packs ``weight``: a 2-D CPU weight of :attr:`dtypes`; bfloat16 with an
        even number of input features for ``half_isa="avx512_bf16"`` (its pairs)."""
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in self.library.dtypes:
            return False
        return weight.dtype != torch.bfloat16 or self.half_isa == "widen" or weight.shape[1] % 2 == 0

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """``[out, in]`` weight → the packed panels (a new tensor; the weight is only read).
        Raises RuntimeError for a weight this build does not pack (:meth:`supports`)."""
        if not self.supports(weight):
            raise RuntimeError(f"our GEMM cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}")
        n, k = weight.shape
        w = weight.contiguous()
        lib = self.library
        if weight.dtype == torch.bfloat16 and self.half_isa == "avx512_bf16":
            out = torch.empty((-(-n // _BF16_PANEL), k // 2, _BF16_PANEL, 2), dtype=torch.bfloat16)
            lib.pack_bf16(w.data_ptr(), n, k, out.data_ptr())
        elif weight.dtype != torch.float32:  # widened at load: the float32 layout, 16-bit values
            out = torch.empty((-(-n // lib.nr), k, lib.nr), dtype=weight.dtype)
            lib.pack_h16(w.data_ptr(), n, k, out.data_ptr())
        else:
            out = torch.empty((-(-n // lib.nr), k, lib.nr), dtype=torch.float32)
            lib.pack_f32(w.data_ptr(), n, k, out.data_ptr())
        return PackedWeight(out, (n, k), weight.dtype)

    def unpack(self, packed: PackedWeight) -> torch.Tensor:
        """The ``[out, in]`` weight bit for bit: the panels hold every value once, zero-padded
        (float32 and widened ``[P, in, nr]``: ``W[p*nr + j, k] = panel[p, k, j]``; VDPBF16PS bf16 ``[P, in/2, 32, 2]``:
        ``W[p*32 + j, 2k + t] = panel[p, k, j, t]``)."""
        n, k = packed.shape
        data = packed.data
        if data.dim() == 4:
            full = data.permute(0, 2, 1, 3).reshape(data.shape[0] * data.shape[2], k)
        else:
            full = data.permute(0, 2, 1).reshape(data.shape[0] * data.shape[2], k)
        return full[:n].contiguous()

    def linear(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` → ``[..., out_features]`` (``x``'s dtype) through ``packed`` (from
        :meth:`pack`), plus ``bias`` ``[out_features]`` if given. Raises RuntimeError when ``x`` or
        ``bias`` does not fit the packed weight (see :func:`native_linear`)."""
        return native_linear(x, packed.data, bias, out_features, self._own_library())

    def _own_library(self) -> Optional[GemmLibrary]:
        """The build that packed, where it is not the default one (``bf16=False``): the same build
        multiplies (None: the default, looked up by the kernel call itself)."""
        return None if self._bf16 else self.library

    def linear_verified(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """:meth:`linear` for arguments already checked (see ``PackedLinears.verified_step``);
        ``bias`` dense float32."""
        if torch.compiler.is_compiling():
            return torch.ops.hf_contbatch.native_linear(x, packed.data, None, None, bias, out_features)
        return _native_gemm(x, packed.data, bias, out_features, self._own_library())

    @staticmethod
    def step_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The bias as :meth:`linear_verified` takes it: dense float32 (the kernel adds it in float32)."""
        return None if bias is None else bias.detach().to(torch.float32).contiguous()


def _native_op(x, packed, scales, zero_points, bias, out_features: int) -> torch.Tensor:
    return native_linear(x, packed, bias, out_features)  # a float layout: no scales


class NativeWidenGEMM(NativeGEMM):
    """:class:`NativeGEMM` with ``half_isa="widen"`` for bfloat16 weights only: on a CPU with
    AVX512-BF16, "auto"'s second candidate for bfloat16 shapes beside the VDPBF16PS one, so timing
    decides per shape and row count which of the two serves (decode's few rows are bound by the
    bytes streamed, where widening costs nothing; many rows by the multiplies, where VDPBF16PS does
    two per lane)."""

    name = "native-widen"

    def __init__(self) -> None:
        super().__init__(half_isa="widen")

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """bfloat16 only (float32 and float16 weights take :class:`NativeGEMM`'s same code)."""
        return (torch.bfloat16,)

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is a 2-D bfloat16 CPU weight."""
        return weight.dtype == torch.bfloat16 and super().supports(weight)


class NativePackedXGEMM(NativeGEMM):
    """:class:`NativeGEMM` for float32 weights whose calls of many rows (prefill) copy ``x`` into
    tiles of 14 rows first and walk the weight in chunks of panels sized to L2 (``cpu_gemm.c``,
    "float32 prefill"); fewer rows take :class:`NativeGEMM`'s tiles. The same packed weight and the
    same bits: "auto"'s candidate beside it, so timing decides per shape and row count whether
    packing ``x`` pays on the CPU at hand. Where both serve one shape, this one reads the other's
    packed copy (:meth:`adopt`): no second copy of the weight.

    Raises:
        RuntimeError: on construction, when the kernel cannot be built, or its build has no
            packed-x tiles (only AVX-512 builds have them).
    """

    name = "native-packx"

    def __init__(self) -> None:
        super().__init__()
        if self.library.gemm_f32_packed_x is None:
            raise RuntimeError(f"our GEMM's {self.isa} build has no packed-x float32 tiles (AVX-512 only)")

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """float32 only (half-precision weights take :class:`NativeGEMM`)."""
        return (torch.float32,)

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is a 2-D float32 CPU weight."""
        return weight.dtype == torch.float32 and super().supports(weight)

    def adopt(self, packed: PackedWeight) -> Optional[PackedWeight]:
        """``packed`` itself where it is :class:`NativeGEMM`'s float32 copy (the layout this kernel
        reads), else None; ``DispatchGEMM.pack`` then shares one copy between the two."""
        data = packed.data
        if (
            packed.dtype != torch.float32
            or not isinstance(data, torch.Tensor)
            or data.dtype != torch.float32
            or data.dim() != 3
            or tuple(data.shape) != (-(-packed.shape[0] // self.library.nr), packed.shape[1], self.library.nr)
        ):
            return None
        return packed

    def linear(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """:meth:`NativeGEMM.linear` through the packed-x tiles at prefill row counts."""
        return native_linear(x, packed.data, bias, out_features, packed_x=True)

    def linear_verified(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """:meth:`linear` for arguments already checked; ``bias`` dense float32."""
        if torch.compiler.is_compiling():
            return super().linear_verified(x, packed, bias, out_features)
        return _native_gemm(x, packed.data, bias, out_features, packed_x=True)


register_linear_op("native_linear", _native_op)
