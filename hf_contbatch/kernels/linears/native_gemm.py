"""Our GEMM (``cpu_gemm.c``), built with the system C compiler and called through ctypes.

Weights are packed once into panels of ``GemmLibrary.nr`` output columns (32 with AVX-512, 16 with
256-bit vectors); the kernel streams them, which is what a decode step's few rows need (see
``cpu_gemm.c`` for the design and why each float32 output is one in-order multiply-add chain, so a
row's result does not depend on the batch it is in). On CPUs with AVX512-BF16 the same library has a
bfloat16 kernel (float32 accumulation, one rounding at the end). The library is built once per
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

from ..native_build import build_library
from .gemm_kernel import PackedWeight
from .linear_op import register_linear_op

_GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.c")
# No -ffast-math: each float32 output must stay one in-order FMA chain (see cpu_gemm.c, "Exactness").
_GEMM_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_BF16_PANEL = 32  # output columns per bf16 panel (NRB in cpu_gemm.c), in pairs of input features


@dataclass(frozen=True)
class GemmLibrary:
    """The compiled GEMM: its functions, the float32 panel width ``nr`` (output columns), the
    instruction set its vectors compile to (``isa``: "avx512f", "avx2", "neon" or "generic"), and
    the bfloat16 functions where the CPU has AVX512-BF16 (else None)."""

    path: str
    pack_f32: Callable
    gemm_f32: Callable
    nr: int
    isa: str
    pack_bf16: Optional[Callable]
    gemm_bf16: Optional[Callable]

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The weight dtypes this build multiplies."""
        return (torch.float32, torch.bfloat16) if self.gemm_bf16 is not None else (torch.float32,)


@functools.cache
def _load_native_library(bf16: bool = True):
    """(GemmLibrary, None) or (None, the exception that prevented it): built once per process, a
    failure too (no compiler: every later engine falls back at once instead of retrying the build).
    ``bf16=False``: the build of a CPU without AVX512-BF16 (float32 only), on any CPU."""
    try:
        path = build_library(_GEMM_SOURCE, _GEMM_FLAGS if bf16 else [*_GEMM_FLAGS, "-mno-avx512bf16"])
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
    lib.hf_contbatch_gemm_nr.restype = i64
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
    )
    return library, None


def native_library(bf16: bool = True) -> GemmLibrary:
    """The compiled GEMM, shared by the process like any loaded library; ``bf16=False``: the
    float32-only build a CPU without AVX512-BF16 gets (its float32 kernel is the same code).

    Raises:
        RuntimeError: the kernel cannot be built here (see ``native_build``); the message names why.
    """
    library, exc = _load_native_library(bf16)
    if exc is not None:
        raise RuntimeError(f"our GEMM cannot be built: {type(exc).__name__}: {exc}") from exc
    return library


def _fits(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> bool:
    """Whether ``x`` ``[..., in]`` matches the packed weight's dtype and sizes (float32 panels
    ``[P, in, nr]``, bf16 panels ``[P, in / 2, 32, 2]``)."""
    if x.device.type != "cpu" or x.dtype != packed.dtype or not x.dim():
        return False
    if packed.dtype == torch.bfloat16:
        width, k = _BF16_PANEL, 2 * packed.shape[1]
    else:
        width, k = packed.shape[2], packed.shape[1]
    panels = packed.shape[0]
    return x.shape[-1] == k and (panels - 1) * width < out_features <= panels * width


def native_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int
) -> torch.Tensor:
    """``x @ W.T + b`` with our GEMM: ``x`` ``[..., in]`` CPU, of the packed weight's dtype
    (float32, or bfloat16 where the build has it), ``packed`` the ``data`` of :meth:`NativeGEMM.pack`,
    ``bias`` ``[out]`` (any float dtype, added in float32) or None; returns ``[..., out]`` in
    ``x``'s dtype.

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
    return _native_gemm(x, packed, bias, out_features)


def _native_gemm(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int
) -> torch.Tensor:
    """:func:`native_linear` without its argument checks, for callers that made them already
    (``x`` CPU with the packed weight's dtype and input size, ``bias`` dense float32 ``[out]``)."""
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
        lib = native_library()
        gemm = lib.gemm_bf16 if x.dtype == torch.bfloat16 else lib.gemm_f32
        # ctypes releases the GIL for the call: engines in other threads keep running.
        gemm(
            x.data_ptr(),
            m,
            k,
            packed.data_ptr(),
            out_features,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
    return y


class NativeGEMM:
    """Our GEMM (``cpu_gemm.c``): float32 weights packed into panels of ``nr`` output columns,
    ``[ceil(out/nr), in, nr]``, and (where the CPU has AVX512-BF16) bfloat16 weights in panels of 32
    columns by pairs of input features, ``[ceil(out/32), in/2, 32, 2]``; plain zero-padded tensors,
    multiplied by any number of rows with torch's thread count. Each float32 output is one in-order
    multiply-add chain over the input features, so a row's result does not depend on the batch it
    is in; bf16 outputs are accumulated in float32 and rounded once.

    Args:
        bf16: False builds without AVX512-BF16 whatever the CPU has: the float32-only fallback of
            CPUs without it (bf16 weights are then left to another kernel or ``F.linear``), so
            that fallback can be tested on any CPU.

    Raises:
        RuntimeError: on construction, when the kernel cannot be built (no C compiler, or the
            compile failed).
    """

    name = "native"
    exact_unpack = True  # plain zero-padded panels: unpack gives the weight back bit for bit

    def __init__(self, bf16: bool = True) -> None:
        self._bf16 = bool(bf16)
        native_library(self._bf16)  # raises here when the kernel cannot be built

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
        """float32, and bfloat16 where the CPU has AVX512-BF16."""
        return self.library.dtypes

    @property
    def isa(self) -> str:
        """The vectors the build compiled to: "avx512f", "avx2", "neon" or "generic"."""
        return self.library.isa

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether this build packs ``weight``: float32, or bfloat16 with an even number of input
        features where the CPU has AVX512-BF16; on the CPU."""
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in self.library.dtypes:
            return False
        return weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """``[out, in]`` weight → the packed panels (a new tensor; the weight is only read).
        Raises RuntimeError for a weight this build does not pack (:meth:`supports`)."""
        if not self.supports(weight):
            raise RuntimeError(f"our GEMM cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}")
        n, k = weight.shape
        w = weight.contiguous()
        lib = self.library
        if weight.dtype == torch.bfloat16:
            out = torch.empty((-(-n // _BF16_PANEL), k // 2, _BF16_PANEL, 2), dtype=torch.bfloat16)
            lib.pack_bf16(w.data_ptr(), n, k, out.data_ptr())
        else:
            out = torch.empty((-(-n // lib.nr), k, lib.nr), dtype=torch.float32)
            lib.pack_f32(w.data_ptr(), n, k, out.data_ptr())
        return PackedWeight(out, (n, k), weight.dtype)

    def unpack(self, packed: PackedWeight) -> torch.Tensor:
        """The ``[out, in]`` weight bit for bit: the panels hold every value once, zero-padded
        (float32 ``[P, in, nr]``: ``W[p*nr + j, k] = panel[p, k, j]``; bf16 ``[P, in/2, 32, 2]``:
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
        return native_linear(x, packed.data, bias, out_features)

    def linear_verified(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """:meth:`linear` for arguments already checked (see ``PackedLinears.verified_step``);
        ``bias`` dense float32."""
        if torch.compiler.is_compiling():
            return torch.ops.hf_contbatch.native_linear(x, packed.data, None, None, bias, out_features)
        return _native_gemm(x, packed.data, bias, out_features)

    @staticmethod
    def step_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The bias as :meth:`linear_verified` takes it: dense float32 (the kernel adds it in float32)."""
        return None if bias is None else bias.detach().to(torch.float32).contiguous()


def _native_op(x, packed, scales, zero_points, bias, out_features: int) -> torch.Tensor:
    return native_linear(x, packed, bias, out_features)  # a float layout: no scales


register_linear_op("native_linear", _native_op)
