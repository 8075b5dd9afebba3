"""The compiled ``int8_gemm.c`` (:class:`Int8Library`) and its two products as plain functions:
:func:`native_int8_gemm` (weight-only, part 1) and :func:`w8a8_gemm` (int8 activations, part 2), also
registered as the opaque ops a compiled forward calls (``linear_op``). The kernel classes that pack
for them are ``int8_gemm.NativeInt8GEMM`` and ``int8_gemm.W8A8GEMM``.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..native_build import build_library
from .linear_op import register_linear_op

_SOURCE = Path(__file__).with_name("int8_gemm.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


@dataclass(frozen=True)
class Int8Library:
    """The compiled ``int8_gemm.c``: its functions, panel widths and vector ISAs (weight-only:
    ``nr``, ``isa``, ``has_movsx``: the VPMOVSXBD widening is built (x86 with AVX2 or AVX-512); int8
    activations: ``vnni_nr``, ``vnni_isa``, "generic" without VNNI; the passes around
    ``torch._int_mm``: ``quantize_s8``, ``scale_out``, part 3)."""

    path: str
    pack: Callable
    gemm: Callable
    nr: int
    isa: str
    has_movsx: bool
    vnni_pack: Callable
    vnni_gemm: Callable
    vnni_scratch: Callable
    vnni_nr: int
    vnni_isa: str
    quantize_s8: Callable
    scale_out: Callable


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
    lib.hf_contbatch_int8_gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, i64, i64]
    lib.hf_contbatch_int8_gemm.restype = None
    lib.hf_contbatch_int8_vnni_pack.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.hf_contbatch_int8_vnni_pack.restype = None
    lib.hf_contbatch_int8_vnni_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64]
    lib.hf_contbatch_int8_vnni_gemm.restype = None
    lib.hf_contbatch_int8_vnni_scratch.argtypes, lib.hf_contbatch_int8_vnni_scratch.restype = [i64, i64], i64
    lib.hf_contbatch_int8_quantize_s8.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64]
    lib.hf_contbatch_int8_quantize_s8.restype = None
    lib.hf_contbatch_int8_scale_out.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64]
    lib.hf_contbatch_int8_scale_out.restype = None
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
            bool(lib.hf_contbatch_int8_has_movsx()),
            lib.hf_contbatch_int8_vnni_pack,
            lib.hf_contbatch_int8_vnni_gemm,
            lib.hf_contbatch_int8_vnni_scratch,
            int(lib.hf_contbatch_int8_vnni_nr()),
            lib.hf_contbatch_int8_vnni_isa().decode(),
            lib.hf_contbatch_int8_quantize_s8,
            lib.hf_contbatch_int8_scale_out,
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


def native_int8_gemm(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias, out_features: int, lib=None, movsx: bool = False
):
    """``NativeInt8GEMM``'s product: ``x [..., k]`` float32, the packed int8 panels, float32 scales,
    float32 bias or None -> ``[..., out_features]`` float32 (the C kernel trusts its arguments).
    ``movsx``: widen the weights with VPMOVSXBD (``NativeInt8MovsxGEMM``; the same layout and bits;
    only where ``lib.has_movsx``)."""
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
            movsx,
        )
    return y


def vnni_scratch_bytes(m: int, k: int) -> int:
    """Bytes of scratch ``hf_contbatch_int8_vnni_gemm`` needs for ``m`` rows of ``k`` features (its C
    twin ``hf_contbatch_int8_vnni_scratch``, computed here to save a foreign call per step)."""
    return m * (-(-k // 4) * 4 + 4) + 64


def w8a8_gemm(x, data, scales, colsum, bias, out_features: int, lib=None, scratch=None) -> torch.Tensor:
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
    return native_int8_gemm(x, packed, scales, bias, out_features)


register_linear_op("native_int8_linear", _native_int8_op)


def _native_int8_movsx_op(x, packed, scales, zero_points, bias, out_features: int) -> torch.Tensor:
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    return native_int8_gemm(x, packed, scales, bias, out_features, movsx=True)


register_linear_op("native_int8_movsx_linear", _native_int8_movsx_op)


def _w8a8_op(x, packed, scales, zero_points, bias, out_features: int) -> torch.Tensor:
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    return w8a8_gemm(x, packed, scales, zero_points, bias, out_features)


register_linear_op("w8a8_linear", _w8a8_op)
