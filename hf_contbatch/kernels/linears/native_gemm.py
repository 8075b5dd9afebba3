"""Our float32 GEMM (``cpu_gemm.c``), built with the system C compiler and called through ctypes.

Weights are packed once into panels of 16 output columns; the kernel streams them, which is what a
decode step's few rows need (see ``cpu_gemm.c`` for the design and why each output is one in-order
multiply-add chain, so a row's result does not depend on the batch it is in). The library is built
once per process (``hf_contbatch.kernels.native_build`` caches it on disk) and shared like any
loaded library.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path
from typing import Optional

import torch

from ..native_build import build_library
from .linear_op import register_linear_op

_GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.c")
# No -ffast-math: each output must stay one in-order FMA chain (see cpu_gemm.c, "Exactness").
_GEMM_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
GEMM_NR = 16
"""Output columns per packed panel (NR in cpu_gemm.c)."""


@functools.cache
def _load_native_library():
    """(pack, gemm) or the exception that prevented them: built once per process, a failure too
    (no compiler: every later engine falls back at once instead of retrying the build)."""
    try:
        lib = ctypes.CDLL(str(build_library(_GEMM_SOURCE, _GEMM_FLAGS)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # no/broken compiler, dlopen failed
        return None, exc
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    pack, gemm = lib.hf_contbatch_gemm_pack_f32, lib.hf_contbatch_gemm_f32
    pack.argtypes, pack.restype = [ptr, i64, i64, ptr], None
    gemm.argtypes, gemm.restype = [ptr, i64, i64, ptr, i64, ptr, ptr, i64], None
    return (pack, gemm), None


def native_library():
    """The compiled GEMM functions (pack, gemm), shared by the process like any loaded library.

    Raises:
        RuntimeError: the kernel cannot be built here (see ``native_build``); the message names why.
    """
    fns, exc = _load_native_library()
    if exc is not None:
        raise RuntimeError(f"our GEMM cannot be built: {type(exc).__name__}: {exc}") from exc
    return fns


def native_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int
) -> torch.Tensor:
    """``x @ W.T + b`` with our GEMM: ``x`` ``[..., in]`` float32 CPU, ``packed`` from
    :meth:`NativeGEMM.pack`, ``bias`` ``[out]`` float32 or None; returns ``[..., out]`` float32.

    Raises:
        RuntimeError: ``x`` or ``bias`` of another dtype, device or size than the packed weight
            (the C kernel trusts its arguments, so they are checked here).
    """
    if torch.compiler.is_compiling():
        return torch.ops.hf_contbatch.native_linear(x, packed, bias, out_features)
    k = x.shape[-1] if x.dim() else -1
    panels = packed.shape[0]
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or k != packed.shape[1]
        or not (panels - 1) * GEMM_NR < out_features <= panels * GEMM_NR
    ):
        raise RuntimeError(
            f"native linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit a packed float32 CPU "
            f"weight of {out_features} x {packed.shape[1]}"
        )
    if bias is not None:
        if bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.shape != (out_features,):
            raise RuntimeError(
                f"native linear: bias {tuple(bias.shape)} {bias.dtype} on {bias.device} does not fit "
                f"{out_features} float32 CPU outputs"
            )
        bias = bias.contiguous()  # kept in a local: the kernel reads it after this line
    return _native_gemm(x, packed, bias, out_features)


def _native_gemm(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int
) -> torch.Tensor:
    """:func:`native_linear` without its argument checks, for callers that made them already
    (``x`` float32 CPU with the packed weight's input size, ``bias`` dense float32 ``[out]``)."""
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
        # ctypes releases the GIL for the call: engines in other threads keep running.
        native_library()[1](
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
    """Our float32 GEMM (``cpu_gemm.c``): weights packed into panels of 16 output columns,
    ``[ceil(out/16), in, 16]`` (a plain tensor, zero-padded), multiplied by any number of rows with
    torch's thread count. Each output is one in-order multiply-add chain over the input features,
    so a row's result does not depend on the batch it is in.

    Raises:
        RuntimeError: on construction, when the kernel cannot be built (no C compiler, or the
            compile failed).
    """

    name = "native"

    def __init__(self) -> None:
        native_library()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``[out, in]`` float32 → the packed panels (a new tensor; the weight is only read)."""
        n, k = weight.shape
        w = weight.contiguous()
        out = torch.empty((-(-n // GEMM_NR), k, GEMM_NR), dtype=torch.float32)
        native_library()[0](w.data_ptr(), n, k, out.data_ptr())
        return out

    def linear(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` float32 → ``[..., out_features]`` float32 through ``packed`` (from
        :meth:`pack`), plus ``bias`` ``[out_features]`` if given. Raises RuntimeError when ``x`` or
        ``bias`` does not fit the packed weight (see :func:`native_linear`)."""
        return native_linear(x, packed, bias, out_features)

    def linear_verified(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """:meth:`linear` for arguments already checked (see ``PackedLinears.verified_step``)."""
        if torch.compiler.is_compiling():
            return torch.ops.hf_contbatch.native_linear(x, packed, bias, out_features)
        return _native_gemm(x, packed, bias, out_features)


register_linear_op("native_linear", native_linear)
