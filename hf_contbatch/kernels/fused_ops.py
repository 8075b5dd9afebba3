"""Fused RMSNorm and SiLU-and-mul (``fused_ops.c``), built with the system C compiler and called
through ctypes; see the C file for the arithmetic and its sources. The same library has the rotary
embedding (:func:`rotary`) and the residual add + RMSNorm (:func:`add_rms_norm`) that the fused
decoder-layer step (``kernels.fused_layer``) calls.

:func:`rms_norm` and :func:`silu_mul` take what transformers' modules take and return what they
return (float32, bfloat16, or float16 where the compiler has ``_Float16``: CPU tensors); anything else (another dtype or device, autograd) is the
caller's to route to the module's own forward (:func:`fits`). The library is built once per process
(``native_build`` caches it on disk per CPU); where it cannot be built, :func:`fused_library`
returns None and the modules keep their forwards.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .model_layout import ModelLayout
from .native_build import build_library
from .tuning import Tuner, time_interleaved

_SOURCE = Path(__file__).with_name("fused_ops.c")
# -ffp-contract=off: a square is rounded before it is summed and a product before it is added, as
# torch's separate ops do (and so every ISA's build gives the same bits).
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes of the kernels (float16 where the build has it: :attr:`FusedLibrary.dtypes`)."""


@dataclass(frozen=True)
class FusedLibrary:
    """The compiled kernels (ctypes functions; the float16 ones None where the compiler has no
    ``_Float16``) and the instruction set the build targets."""

    path: str
    isa: str
    rms_norm_f32: Callable
    rms_norm_bf16: Callable
    silu_mul_f32: Callable
    silu_mul_bf16: Callable
    rotary_f32: Callable
    rotary_bf16: Callable
    add_rms_norm_f32: Callable
    add_rms_norm_bf16: Callable
    rms_norm_rotary_f32: Callable
    rms_norm_rotary_bf16: Callable
    rms_norm_f16: Optional[Callable] = None
    silu_mul_f16: Optional[Callable] = None
    rotary_f16: Optional[Callable] = None
    add_rms_norm_f16: Optional[Callable] = None
    rms_norm_rotary_f16: Optional[Callable] = None
    decode_layers_f32: Optional[Callable] = None  # (step, layers, n, hidden in, hidden out) -> 0 / 1 / 2
    decode_layers_bf16: Optional[Callable] = None
    decode_scratch_floats: Optional[Callable] = None

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes this build's kernels take."""
        return DTYPES if self.rms_norm_f16 is not None else DTYPES[:2]


@functools.cache
def _load() -> tuple[Optional[FusedLibrary], Optional[str]]:
    try:
        path = build_library(_SOURCE, _FLAGS)
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # no/broken compiler, dlopen failed
        return None, f"{type(exc).__name__}: {exc}"
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
    lib.hf_contbatch_rms_norm_f32.argtypes = [ptr, i64, i64, i64, ptr, f32, ptr, i64, i32]
    lib.hf_contbatch_rms_norm_bf16.argtypes = [ptr, i64, i64, i64, ptr, f32, i32, ptr, i64, i32]
    lib.hf_contbatch_silu_mul_f32.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i32]
    lib.hf_contbatch_silu_mul_bf16.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i32]
    rotary = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, i32]
    lib.hf_contbatch_rotary_f32.argtypes = lib.hf_contbatch_rotary_bf16.argtypes = rotary
    lib.hf_contbatch_add_rms_norm_f32.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, f32, ptr, ptr, i32]
    lib.hf_contbatch_add_rms_norm_bf16.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, f32, i32, ptr, ptr, i32]
    norm_rotary = [ptr, i64, i64, i64, i64, i64, ptr, f32, i32, ptr, ptr, i64, ptr, i32]
    lib.hf_contbatch_rms_norm_rotary_f32.argtypes = lib.hf_contbatch_rms_norm_rotary_bf16.argtypes = norm_rotary
    has_f16 = bool(lib.hf_contbatch_fused_has_f16())
    ops = ("rms_norm", "silu_mul", "rotary", "add_rms_norm", "rms_norm_rotary")
    if has_f16:
        for op in ops:
            getattr(lib, f"hf_contbatch_{op}_f16").argtypes = getattr(lib, f"hf_contbatch_{op}_bf16").argtypes
    names = [f"{op}_{t}" for op in ops for t in ("f32", "bf16", "f16")]
    for name in names:
        if has_f16 or not name.endswith("_f16"):
            getattr(lib, f"hf_contbatch_{name}").restype = None
    lib.hf_contbatch_fused_isa.restype = ctypes.c_char_p
    # The decode program's structs by pointer (kernels/decode_program.py mirrors them).
    for name in ("decode_layers_f32", "decode_layers_bf16"):
        getattr(lib, f"hf_contbatch_{name}").argtypes = [ptr, ptr, i64, ptr, ptr]
        getattr(lib, f"hf_contbatch_{name}").restype = i64
    lib.hf_contbatch_decode_scratch_floats.argtypes = [i64] * 6
    lib.hf_contbatch_decode_scratch_floats.restype = i64
    return (
        FusedLibrary(
            path=str(path),
            isa=lib.hf_contbatch_fused_isa().decode(),
            rms_norm_f32=lib.hf_contbatch_rms_norm_f32,
            rms_norm_bf16=lib.hf_contbatch_rms_norm_bf16,
            silu_mul_f32=lib.hf_contbatch_silu_mul_f32,
            silu_mul_bf16=lib.hf_contbatch_silu_mul_bf16,
            rotary_f32=lib.hf_contbatch_rotary_f32,
            rotary_bf16=lib.hf_contbatch_rotary_bf16,
            add_rms_norm_f32=lib.hf_contbatch_add_rms_norm_f32,
            add_rms_norm_bf16=lib.hf_contbatch_add_rms_norm_bf16,
            rms_norm_rotary_f32=lib.hf_contbatch_rms_norm_rotary_f32,
            rms_norm_rotary_bf16=lib.hf_contbatch_rms_norm_rotary_bf16,
            rms_norm_f16=lib.hf_contbatch_rms_norm_f16 if has_f16 else None,
            silu_mul_f16=lib.hf_contbatch_silu_mul_f16 if has_f16 else None,
            rotary_f16=lib.hf_contbatch_rotary_f16 if has_f16 else None,
            add_rms_norm_f16=lib.hf_contbatch_add_rms_norm_f16 if has_f16 else None,
            rms_norm_rotary_f16=lib.hf_contbatch_rms_norm_rotary_f16 if has_f16 else None,
            decode_layers_f32=lib.hf_contbatch_decode_layers_f32,
            decode_layers_bf16=lib.hf_contbatch_decode_layers_bf16,
            decode_scratch_floats=lib.hf_contbatch_decode_scratch_floats,
        ),
        None,
    )


def fused_library() -> Optional[FusedLibrary]:
    """The compiled kernels, or None where they cannot be built here (no C compiler, compile error)."""
    return _load()[0]


def _library_for(dtype: torch.dtype) -> FusedLibrary:
    """The library, checked to have kernels for ``dtype``; RuntimeError saying why not."""
    lib = fused_library()
    if lib is None:
        raise RuntimeError(f"fused ops unavailable: {fused_library_error()}")
    if dtype not in lib.dtypes:
        raise RuntimeError(f"fused ops: no {dtype} kernels in this build (it has {lib.dtypes})")
    return lib


def fused_library_error() -> Optional[str]:
    """Why :func:`fused_library` is None (None when it is not)."""
    return _load()[1]


def _rows_view(x: torch.Tensor) -> Optional[tuple[int, int]]:
    """(rows, row stride) when ``x`` ``[..., n]`` is rows of unit-stride elements at one fixed stride
    (a contiguous tensor, or a column slice of one: a fused GEMM's gate half), else None."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return None
    n = x.shape[-1]
    if x.dim() == 1:
        return 1, n
    rows = x.numel() // n if n else 0
    # The leading dims must collapse into one at stride `stride` (outer stride = inner stride * size).
    # Size-1 dims are skipped: their stride is arbitrary, and contiguous() keeps it (a QK norm's
    # [1, H, 1, D] decode view, transposed from [1, 1, H, D], has the T dim's stride H * D there).
    stride = expected = None
    for d in range(x.dim() - 2, -1, -1):
        if x.shape[d] == 1:
            continue
        if stride is None:
            stride = expected = x.stride(d)
        elif x.stride(d) != expected:
            return None
        expected *= x.shape[d]
    return rows, n if stride is None else stride


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(x, rows, row stride)`` for the kernels: ``x`` itself where :func:`_rows_view` takes it,
    else a contiguous copy of it."""
    view = _rows_view(x)
    if view is None:
        x = x.contiguous()
        view = _rows_view(x)
    return x, *view


def remove_forwards(installed) -> None:
    """Take each ``(module, forward)`` of ``installed`` off its module, where that forward is still
    the module's instance ``forward`` (something installed since keeps its own); the class's
    ``forward`` serves again."""
    for module, fwd in installed:
        if module.__dict__.get("forward") is fwd:
            del module.forward


def fits(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: a CPU tensor of a dtype the build has (float32, bfloat16,
    float16), no autograd graph wanted."""
    lib = fused_library() if x.dtype == torch.float16 else None
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and (x.dtype != torch.float16 or (lib is not None and lib.rms_norm_f16 is not None))
        and x.dim() >= 1
        and not (x.requires_grad and torch.is_grad_enabled())
        and not torch.compiler.is_compiling()
    )


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, round_first: bool) -> torch.Tensor:
    """RMSNorm of the last dimension of ``x`` ``[..., n]`` (float32, bfloat16 or float16, CPU) with a float32
    ``scale`` ``[n]`` (the weight, or ``1 + weight`` for Gemma); returns ``[..., n]`` in ``x``'s dtype.
    ``round_first``: the normalized value is rounded to ``x``'s dtype before the scale multiplies
    it (Llama's order); else one rounding at the end (Gemma's, OLMo2's). Same in float32.

    Raises:
        RuntimeError: the kernels cannot be built here, ``x``'s dtype is not one of the build's
            (:attr:`FusedLibrary.dtypes`), or ``scale`` does not fit.
    """
    lib = _library_for(x.dtype)
    n = x.shape[-1]
    if scale.dtype != torch.float32 or scale.shape != (n,) or not scale.is_contiguous():
        raise RuntimeError(f"rms_norm: scale {tuple(scale.shape)} {scale.dtype} does not fit {n} float32 features")
    x, rows, stride = _as_rows(x)
    y = torch.empty(x.shape, dtype=x.dtype)
    if rows and n:
        threads = torch.get_num_threads()
        if x.dtype == torch.float32:
            lib.rms_norm_f32(x.data_ptr(), rows, n, stride, scale.data_ptr(), eps, y.data_ptr(), n, threads)
        else:
            fn = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm_f16
            fn(x.data_ptr(), rows, n, stride, scale.data_ptr(), eps, int(round_first), y.data_ptr(), n, threads)
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate`` and ``up`` ``[..., n]`` of one shape and dtype (float32,
    bfloat16 or float16, CPU; each contiguous or a column slice of a contiguous tensor, as a fused gate/up GEMM
    gives them); returns a new contiguous ``[..., n]`` tensor.

    Raises:
        RuntimeError: the kernels cannot be built here, the dtype is not one of the build's, or
            shapes/dtypes differ.
    """
    lib = _library_for(gate.dtype)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise RuntimeError(
            f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
        )
    gate, rows, g_stride = _as_rows(gate)
    up, _, u_stride = _as_rows(up)
    n = gate.shape[-1]
    y = torch.empty(gate.shape, dtype=gate.dtype)
    if rows and n:
        fn = {torch.float32: lib.silu_mul_f32, torch.bfloat16: lib.silu_mul_bf16}.get(gate.dtype, lib.silu_mul_f16)
        fn(gate.data_ptr(), up.data_ptr(), rows, n, g_stride, u_stride, y.data_ptr(), torch.get_num_threads())
    return y


def _kernel(lib: FusedLibrary, op: str, dtype: torch.dtype) -> Callable:
    return getattr(lib, f"{op}_{_SUFFIX[dtype]}")


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotary_dim: Optional[int] = None
) -> torch.Tensor:
    """The rotary embedding ``x * cos + rotate_half(x) * sin`` of every head of ``x`` ``[T, heads *
    head_dim]`` (rows of unit-stride features at one row stride: a column slice of a fused q/k/v
    GEMM output will do) at the rows' positions, ``cos``/``sin`` ``[T, rotary_dim]`` (unit stride
    along the features) in ``x``'s dtype, as transformers' ``apply_rotary_pos_emb`` computes it
    (float32: the same bits; bfloat16/float16: each op rounded to the dtype as torch's eager ops).
    ``rotary_dim`` (default ``head_dim``): partial rotary, Phi-3's form: each head's first
    ``rotary_dim`` features rotated, the rest copied.
    Returns a new contiguous ``[T, heads, head_dim]`` tensor: the layout paged attention reads.

    Raises:
        RuntimeError: the kernels cannot be built here, the dtype is not one of the build's, or the
            shapes, dtypes or strides do not fit.
    """
    lib = _library_for(x.dtype)
    rows, width = x.shape if x.dim() == 2 else (-1, -1)
    rot = head_dim if rotary_dim is None else rotary_dim
    if (
        head_dim <= 0
        or not 0 < rot <= head_dim
        or width % head_dim
        or cos.shape != (rows, rot)
        or sin.shape != cos.shape
        or cos.dtype != x.dtype
        or sin.dtype != x.dtype
        or cos.stride() != sin.stride()
        or (rot > 1 and cos.stride(1) != 1)
        or (head_dim > 1 and x.stride(1) != 1)
    ):
        raise RuntimeError(
            f"rotary: x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} "
            f"{sin.dtype} do not fit heads of {head_dim} features"
        )
    heads = width // head_dim
    y = torch.empty((rows, heads, head_dim), dtype=x.dtype)
    if rows and width:
        _kernel(lib, "rotary", x.dtype)(
            x.data_ptr(),
            rows,
            heads,
            head_dim,
            rot,
            x.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            y.data_ptr(),
            torch.get_num_threads(),
        )
    return y


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps: float, round_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` and :func:`rms_norm` of ``s`` in one pass: a decoder layer's residual add
    and the RMSNorm after it. ``x`` and ``residual`` ``[..., n]`` of one shape and dtype (float32,
    bfloat16 or float16, CPU), ``scale`` float32 ``[n]``, ``eps`` and ``round_first`` as in
    :func:`rms_norm`. Returns ``(s, normed)``, new contiguous tensors of ``x``'s shape and dtype;
    ``s`` is exactly torch's ``residual + x``, ``normed`` what :func:`rms_norm` gives for ``s``.

    Raises:
        RuntimeError: the kernels cannot be built here, the dtype is not one of the build's, or the
            shapes, dtypes or scale do not fit.
    """
    lib = _library_for(x.dtype)
    n = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise RuntimeError(
            f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} differ"
        )
    if scale.dtype != torch.float32 or scale.shape != (n,) or not scale.is_contiguous():
        raise RuntimeError(f"add_rms_norm: scale {tuple(scale.shape)} {scale.dtype} does not fit {n} float32 features")
    x, rows, x_stride = _as_rows(x)
    residual, _, r_stride = _as_rows(residual)
    total = torch.empty(x.shape, dtype=x.dtype)
    y = torch.empty(x.shape, dtype=x.dtype)
    if rows and n:
        fn, threads = _kernel(lib, "add_rms_norm", x.dtype), torch.get_num_threads()
        if x.dtype == torch.float32:
            fn(x.data_ptr(), residual.data_ptr(), rows, n, x_stride, r_stride, scale.data_ptr(), eps,
               total.data_ptr(), y.data_ptr(), threads)  # fmt: skip
        else:
            fn(x.data_ptr(), residual.data_ptr(), rows, n, x_stride, r_stride, scale.data_ptr(), eps,
               int(round_first), total.data_ptr(), y.data_ptr(), threads)  # fmt: skip
    return total, y


def rms_norm_rotary(
    x: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    round_first: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    norm_heads: int = 1,
) -> torch.Tensor:
    """An RMSNorm of ``x`` ``[T, heads * head_dim]`` (rows of unit-stride features at one row stride,
    as :func:`rotary` takes them) over each group of ``norm_heads`` heads' features, then the rotary
    embedding of the result per head: Qwen3's per-head ``q_norm``/``k_norm`` (``norm_heads=1``) or
    OLMo2's over the whole projection (``norm_heads=heads``) and ``apply_rotary_pos_emb`` in one pass.
    ``scale`` float32 ``[norm_heads * head_dim]``, ``eps`` and ``round_first`` as in :func:`rms_norm`;
    ``cos``/``sin`` as in :func:`rotary`. Returns a new contiguous ``[T, heads, head_dim]`` tensor of
    ``x``'s dtype, bit for bit :func:`rotary` of :func:`rms_norm` of ``x`` viewed as
    ``[T, heads / norm_heads, norm_heads * head_dim]``.

    Raises:
        RuntimeError: the kernels cannot be built here, the dtype is not one of the build's, or the
            shapes, dtypes, strides or scale do not fit.
    """
    lib = _library_for(x.dtype)
    rows, width = x.shape if x.dim() == 2 else (-1, -1)
    if (
        head_dim <= 0
        or norm_heads <= 0
        or width % (head_dim * norm_heads)
        or scale.dtype != torch.float32
        or scale.shape != (norm_heads * head_dim,)
        or not scale.is_contiguous()
        or cos.shape != (rows, head_dim)
        or sin.shape != cos.shape
        or cos.dtype != x.dtype
        or sin.dtype != x.dtype
        or cos.stride() != sin.stride()
        or (head_dim > 1 and (cos.stride(1) != 1 or x.stride(1) != 1))
    ):
        raise RuntimeError(
            f"rms_norm_rotary: x {tuple(x.shape)} {x.dtype}, scale {tuple(scale.shape)} {scale.dtype}, cos "
            f"{tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype} do not fit heads of {head_dim} features"
        )
    heads = width // head_dim
    y = torch.empty((rows, heads, head_dim), dtype=x.dtype)
    if rows and width:
        _kernel(lib, "rms_norm_rotary", x.dtype)(
            x.data_ptr(), rows, heads, head_dim, x.stride(0), norm_heads, scale.data_ptr(), eps, int(round_first),
            cos.data_ptr(), sin.data_ptr(), cos.stride(0), y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return y


class UncheckedKernels:
    """The kernels of one dtype for a caller that made or checked its tensors itself (the fused
    decoder-layer step, ``kernels.fused_layer``, once per step): the ctypes functions bound once,
    no argument checks, no re-derived strides or dtypes, outputs made with ``torch.empty_like``.
    The checked functions above cost 5-20 µs a call in a decode step; most of it is what these skip.

    Every tensor must be a CPU tensor of :attr:`dtype` with at least one row and one feature;
    ``scale`` float32, contiguous ``[n]``. Arguments that break this read or write out of bounds:
    anything not known to fit goes to the checked functions.

    Args:
        lib: the built library (:func:`fused_library`).
        dtype: one of ``lib.dtypes``.
    """

    def __init__(self, lib: FusedLibrary, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.float32 = dtype == torch.float32
        self._rms_norm = _kernel(lib, "rms_norm", dtype)
        self._silu_mul = _kernel(lib, "silu_mul", dtype)
        self._rotary = _kernel(lib, "rotary", dtype)
        self._add_rms_norm = _kernel(lib, "add_rms_norm", dtype)
        self._rms_norm_rotary = _kernel(lib, "rms_norm_rotary", dtype)

    def rms_norm(self, x: torch.Tensor, scale: torch.Tensor, eps: float, round_first: bool) -> torch.Tensor:
        """:func:`rms_norm` of a contiguous ``x`` ``[..., n]``: a new contiguous tensor like it."""
        n = x.shape[-1]
        y = torch.empty_like(x)
        if self.float32:
            self._rms_norm(x.data_ptr(), x.numel() // n, n, n, scale.data_ptr(), eps, y.data_ptr(), n,
                           torch.get_num_threads())  # fmt: skip
        else:
            self._rms_norm(x.data_ptr(), x.numel() // n, n, n, scale.data_ptr(), eps, int(round_first),
                           y.data_ptr(), n, torch.get_num_threads())  # fmt: skip
        return y

    def rotary(
        self,
        x: torch.Tensor,
        rows: int,
        heads: int,
        head_dim: int,
        row_stride: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotary_dim: Optional[int] = None,
    ) -> torch.Tensor:
        """:func:`rotary` of ``rows`` rows of ``heads * head_dim`` unit-stride features starting at
        ``x``'s first element, ``row_stride`` elements apart; ``cos``/``sin`` contiguous ``[rows,
        rotary_dim]`` (any leading size-1 dims; ``rotary_dim`` default ``head_dim``: partial rotary
        below it). Returns a new contiguous ``[rows, heads, head_dim]``."""
        rot = head_dim if rotary_dim is None else rotary_dim
        y = x.new_empty((rows, heads, head_dim))
        self._rotary(x.data_ptr(), rows, heads, head_dim, rot, row_stride, cos.data_ptr(), sin.data_ptr(), rot,
                     y.data_ptr(), torch.get_num_threads())  # fmt: skip
        return y

    def rms_norm_rotary(
        self,
        x: torch.Tensor,
        rows: int,
        heads: int,
        head_dim: int,
        row_stride: int,
        norm_heads: int,
        scale: torch.Tensor,
        eps: float,
        round_first: bool,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """:func:`rms_norm_rotary` of ``rows`` rows laid out as :meth:`rotary` takes them, ``heads``
        a multiple of ``norm_heads``, ``scale`` float32 contiguous ``[norm_heads * head_dim]``.
        Returns a new contiguous ``[rows, heads, head_dim]``."""
        y = x.new_empty((rows, heads, head_dim))
        self._rms_norm_rotary(x.data_ptr(), rows, heads, head_dim, row_stride, norm_heads, scale.data_ptr(), eps,
                              int(round_first), cos.data_ptr(), sin.data_ptr(), head_dim, y.data_ptr(),
                              torch.get_num_threads())  # fmt: skip
        return y

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, gate_stride: int, up_stride: int) -> torch.Tensor:
        """:func:`silu_mul` of ``gate`` and ``up`` ``[1, T, n]``, each rows of unit-stride features
        at its own row stride in elements (a column slice of one fused gate/up GEMM output, or a
        contiguous tensor: ``n``). Returns a new contiguous ``[1, T, n]``."""
        rows, n = gate.shape[1], gate.shape[2]
        y = gate.new_empty((1, rows, n))
        self._silu_mul(gate.data_ptr(), up.data_ptr(), rows, n, gate_stride, up_stride, y.data_ptr(),
                       torch.get_num_threads())  # fmt: skip
        return y

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps: float, round_first: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`add_rms_norm` of contiguous ``x`` and ``residual`` of one shape: ``(residual + x,
        RMSNorm of it)``, new contiguous tensors like ``x``."""
        n = x.shape[-1]
        rows = x.numel() // n
        total, y = torch.empty_like(x), torch.empty_like(x)
        if self.float32:
            self._add_rms_norm(x.data_ptr(), residual.data_ptr(), rows, n, n, n, scale.data_ptr(), eps,
                               total.data_ptr(), y.data_ptr(), torch.get_num_threads())  # fmt: skip
        else:
            self._add_rms_norm(x.data_ptr(), residual.data_ptr(), rows, n, n, n, scale.data_ptr(), eps,
                               int(round_first), total.data_ptr(), y.data_ptr(), torch.get_num_threads())  # fmt: skip
        return total, y


@functools.cache
def unchecked_kernels(dtype: torch.dtype) -> Optional[UncheckedKernels]:
    """The :class:`UncheckedKernels` of ``dtype`` (one per process and dtype: they hold only the
    library's functions), or None where the library cannot be built or has no ``dtype`` kernels."""
    lib = fused_library()
    return UncheckedKernels(lib, dtype) if lib is not None and dtype in lib.dtypes else None


# --- per-instance forwards of transformers' RMSNorm and gated-MLP modules ------------------------

_PLAIN_TEXT = str.maketrans("", "", " \n\t")


def _source(fn) -> str:
    """``fn``'s source without comments and whitespace ("" where it cannot be read)."""
    try:
        lines = inspect.getsource(fn).splitlines()
    except (OSError, TypeError):
        return ""
    return "".join(line.split("#", 1)[0] for line in lines).translate(_PLAIN_TEXT)


# The normalizations whose arithmetic rms_norm reproduces, recognized by their forward's text (so a
# family that changes its norm keeps its own forward): (round_first, add one to the weight).
_LLAMA_NORM = (
    "input_dtype=hidden_states.dtypehidden_states=hidden_states.to(torch.float32)"
    "variance=hidden_states.pow(2).mean(-1,keepdim=True)"
    "hidden_states=hidden_states*torch.rsqrt(variance+self.variance_epsilon)"
)
_NORM_FORMS = {
    _LLAMA_NORM + "returnself.weight*hidden_states.to(input_dtype)": (True, False),  # Llama, Qwen, Mistral...
    _LLAMA_NORM + "return(self.weight*hidden_states).to(input_dtype)": (False, False),  # OLMo2
    "output=self._norm(x.float())output=output*(1.0+self.weight.float())returnoutput.type_as(x)": (False, True),
}
_GEMMA_INNER = "returnx*torch.rsqrt(x.pow(2).mean(-1,keepdim=True)+self.eps)"
_MLP_FORMS = {
    "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj": "gate_up",
    "up_states=self.gate_up_proj(hidden_states)gate,up_states=up_states.chunk(2,dim=-1)"
    "up_states=up_states*self.activation_fn(gate)returnself.down_proj(up_states)": "fused_gate_up",  # Phi-3
}
_SILU = ("SiLU", "SiLUActivation")


def _body(cls) -> str:
    """The text of ``cls.forward`` after its signature line (no whitespace)."""
    text = _source(cls.forward)
    return text[text.find(":", text.find(")")) + 1 :] if text else ""


def norm_form(module) -> Optional[tuple[bool, bool]]:
    """(round_first, one_plus_weight) when ``module``'s forward is an RMSNorm ``rms_norm``
    reproduces, else None."""
    if not isinstance(getattr(module, "weight", None), torch.Tensor) or module.weight.dim() != 1:
        return None
    body = _body(type(module))
    form = _NORM_FORMS.get(body[body.find("input_dtype") :] if "input_dtype" in body else body)
    if form is None:
        return None
    if form[1] and not _source(type(module)._norm).endswith(_GEMMA_INNER):
        return None
    eps = getattr(module, "eps" if form[1] else "variance_epsilon", None)
    return form if isinstance(eps, float) else None


def gated_mlp_form(module) -> Optional[tuple[str, bool]]:
    """``(kind, silu)`` when ``module``'s forward is a gated MLP ``down(act(gate) * up)`` of one of
    :func:`mlp_form`'s kinds with any activation module (Gemma's GELU-tanh too), else None; ``silu``:
    whether the activation is SiLU (what :func:`silu_mul` computes)."""
    form = _MLP_FORMS.get(_body(type(module)))
    if form is None:
        return None
    act = module.__dict__.get("_modules", {}).get("act_fn" if form == "gate_up" else "activation_fn")
    if not isinstance(act, torch.nn.Module):
        return None
    return form, type(act).__name__ in _SILU


def mlp_form(module) -> Optional[str]:
    """ "gate_up" (``gate_proj``/``up_proj``) or "fused_gate_up" (``gate_up_proj``) when ``module``
    is a gated MLP with SiLU that computes ``down(silu(gate) * up)``, else None."""
    form = _MLP_FORMS.get(_body(type(module)))
    act = getattr(module, "act_fn" if form == "gate_up" else "activation_fn", None)
    return form if form is not None and type(act).__name__ in _SILU else None


class FusedNormForward:
    """``module.forward`` for an RMSNorm :func:`norm_form` recognizes: :func:`rms_norm` where
    :func:`fits` allows, the module's own forward otherwise. The float32 scale (weight, or
    ``1 + weight``) is cached per weight version."""

    def __init__(self, module, round_first: bool, one_plus: bool) -> None:
        self.module, self.round_first, self.one_plus = module, round_first, one_plus
        self.eps = float(module.eps if one_plus else module.variance_epsilon)
        self._key: Optional[tuple] = None
        self._scale: Optional[torch.Tensor] = None

    def original(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return type(self.module).forward(self.module, hidden_states)

    def scale(self) -> torch.Tensor:
        """The float32 scale ``[n]`` of the module's current weight (``1 + weight`` for Gemma's form)."""
        # The parameter dict first: nn.Module.__getattr__ costs about a microsecond, per layer and step.
        w = self.module._parameters.get("weight")
        if w is None:
            w = self.module.weight
        key = (id(w), w.data_ptr(), w._version, w.dtype)
        if key != self._key:
            with torch.no_grad():
                s = (1.0 + w.detach().float()) if self.one_plus else w.detach().float()
                self._scale, self._key = s.contiguous(), key
        return self._scale

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.module.weight
        if (
            not fits(hidden_states)
            or w.device.type != "cpu"
            or w.shape != (hidden_states.shape[-1],)
            or (self.round_first and w.dtype != hidden_states.dtype)  # Llama's output takes w's dtype
            or (w.requires_grad and torch.is_grad_enabled())
        ):
            return self.original(hidden_states)
        return rms_norm(hidden_states, self.scale(), self.eps, self.round_first)


class FusedMLPForward:
    """``module.forward`` for a gated SiLU MLP :func:`mlp_form` recognizes: the projections as the
    module calls them (packed and fused GEMMs, LoRA wrappers), :func:`silu_mul` between them."""

    def __init__(self, module, form: str) -> None:
        self.module, self.form = module, form

    def original(self, x: torch.Tensor) -> torch.Tensor:
        return type(self.module).forward(self.module, x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not fits(x):
            return self.original(x)
        m = self.module
        if self.form == "gate_up":
            gate, up = m.gate_proj(x), m.up_proj(x)
        else:
            gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
        if not (fits(gate) and fits(up)) or gate.shape != up.shape or gate.dtype != up.dtype:
            h = (m.act_fn(gate) * up) if self.form == "gate_up" else (up * m.activation_fn(gate))
        else:
            h = silu_mul(gate, up)
        return m.down_proj(h)


_TIMED_ROWS = (1, 64)  # a decode step's rows, and a prefill chunk's
_ROUNDS, _CALLS = 5, 10


class FusedModelOps:
    """The fused forwards installed on one model: every RMSNorm and gated SiLU MLP that
    :func:`norm_form` / :func:`mlp_form` recognize, per shape class (op, width, dtype) where the
    fused kernel timed faster than the module's own ops on this CPU (both timed interleaved, median
    of rounds, at :data:`_TIMED_ROWS` rows; the kernel must win at each). Instance ``forward``
    attributes only: no class or model code changes; :meth:`restore` removes them.

    Args:
        model: a transformers model (any ``nn.Module``).
        measure: ``(op, width, dtype) -> {"fused": s, "module": s}`` at the timed rows (tests pass
            fixed figures); default: timed here.
        layout: the model's walk (``kernels.model_layout``; default: walked here).

    Attributes:
        choices: ``{"rms_norm 960 bfloat16": ("fused" | "module", {"fused": [s per rows], ...})}``.
        error: why nothing was installed when the kernels cannot be built here (else None).
    """

    def __init__(self, model, measure: Optional[Callable] = None, layout: Optional[ModelLayout] = None) -> None:
        self.installed: list[tuple[torch.nn.Module, object]] = []
        self.choices: dict[str, tuple[str, dict]] = {}
        self.error = None if fused_library() is not None else fused_library_error()
        if self.error is not None:
            return
        lib_dtypes = fused_library().dtypes
        groups: dict[tuple, list] = {}
        for _, module in (layout or ModelLayout.of(model)).modules:
            if "forward" in module.__dict__:  # an instance forward someone else installed: leave it
                continue
            form = norm_form(module)
            if form is not None:
                fwd = FusedNormForward(module, *form)
                groups.setdefault(("rms_norm", module.weight.shape[0], module.weight.dtype), []).append((module, fwd))
                continue
            kind = mlp_form(module)
            if kind is not None:
                proj = module.gate_proj if kind == "gate_up" else module.gate_up_proj
                weight = getattr(proj, "weight", None)
                if isinstance(weight, torch.Tensor):
                    width = proj.out_features if kind == "gate_up" else proj.out_features // 2
                    groups.setdefault(("silu_mul", width, weight.dtype), []).append(
                        (module, FusedMLPForward(module, kind))
                    )
        # The package's one tuner, in memory: the fused forwards are timed per model, on its own
        # module instances (a figure from another process's modules would not be about these).
        tuner = Tuner(("fused", "module"), None, recheck=False, what="model ops")
        for (op, width, dtype), members in groups.items():
            if dtype not in lib_dtypes:
                continue
            run = functools.partial(measure or self._measure, op, width, dtype, members[0][1])
            table = tuner.timings(
                f"{op} {width} {dtype}",
                _TIMED_ROWS,
                lambda rows, run=run: {n: dict(zip(_TIMED_ROWS, s)) for n, s in run().items()},
            )
            times = {n: [t[r] for r in _TIMED_ROWS] for n, t in table.items()}
            won = all(f < m for f, m in zip(times["fused"], times["module"]))
            self.choices[f"{op} {width} {str(dtype).removeprefix('torch.')}"] = ("fused" if won else "module", times)
            if won:
                for module, fwd in members:
                    module.forward = fwd
                    self.installed.append((module, fwd))

    @staticmethod
    def _measure(op: str, width: int, dtype: torch.dtype, fwd) -> dict:
        g = torch.Generator().manual_seed(0)
        out: dict = {"fused": [], "module": []}
        with torch.inference_mode():
            for rows in _TIMED_ROWS:
                if op == "rms_norm":
                    x = torch.randn(rows, width, generator=g).to(dtype)
                    runs = {"fused": lambda x=x: fwd(x), "module": lambda x=x: fwd.original(x)}
                else:  # the element-wise part only: the projections are the same either way
                    both = torch.randn(rows, 2 * width, generator=g).to(dtype)
                    gate, up = both[:, :width], both[:, width:]
                    act = getattr(fwd.module, "act_fn", None) or fwd.module.activation_fn
                    runs = {
                        "fused": lambda gate=gate, up=up: silu_mul(gate, up),
                        "module": lambda gate=gate, up=up, act=act: act(gate) * up,
                    }
                for run in runs.values():  # warm-up
                    run()

                def repeat(run):
                    def go():
                        for _ in range(_CALLS):
                            run()
                        return _CALLS

                    return go

                timed = time_interleaved({n: repeat(r) for n, r in runs.items()}, _ROUNDS)
                for n in out:
                    out[n].append(timed[n])
        return out

    def restore(self) -> None:
        """Remove the installed forwards (the modules' class forwards serve again)."""
        remove_forwards(self.installed)
        self.installed = []

    def report(self) -> str:
        """One line per shape class: what serves it, and both timings (us per call at the timed rows)."""
        if self.error is not None:
            return f"fused model ops unavailable ({self.error})"
        rows = ",".join(map(str, _TIMED_ROWS))
        lines = [f"model ops (us per call at rows {rows}):"]
        for key, (who, times) in self.choices.items():
            cells = "; ".join(f"{n} " + " ".join(f"{1e6 * s:.1f}" for s in secs) for n, secs in times.items())
            lines.append(f"  {key}: {who}  ({cells})")
        return "\n".join(lines)
