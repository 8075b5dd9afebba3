"""Packed linear layers for CPU serving: a model's float32 ``nn.Linear`` weights packed once for a
faster GEMM, ours (``cpu_gemm.c``) or oneDNN's, and sibling projections fused into one GEMM.

Why: torch's ``F.linear`` on CPU calls a BLAS ``sgemm`` that is slow at the small row counts of a
decode step (a few to a few dozen tokens). oneDNN over weights reordered once into its blocked
layout is faster there, and our kernel, which streams the packed weights, faster still at decode
sizes and about the same at prefill sizes (``benchmarks/bench_gemm.py``, ``docs/benchmarks.md``).
``linear_backend="auto"`` uses ours where it builds, else oneDNN, else ``F.linear``; greedy tokens
are unchanged either way.

How it is plugged in: each ``nn.Linear`` *instance* gets a ``forward`` attribute (the class is never
touched) that calls the packed op; :meth:`PackedLinears.restore` deletes the attributes. Modules that
already carry an instance ``forward`` or hooks (accelerate's ``device_map`` offload wraps
``forward`` that way) are left alone. The packed copy costs as much memory as the weights it packs;
``linear_backend="auto"`` packs only when that fits comfortably (see :func:`pack_linears`). A weight
changed in place (``load_state_dict``, an optimizer step: the version counter), given new storage
(``.data = ...``, ``.to(...)``) or replaced by another Parameter is repacked before its next use, so
outputs follow the current weights. Writes through ``.data`` (``w.data.mul_(2)``, as some weight
initialisers do) bypass the version counter and cannot be seen: call :meth:`PackedLinears.repack`
after them. Calls that need autograd (grad enabled and any of input, weight or bias requiring grad)
run ``F.linear``. A deepcopy or pickle of the model drops the packed copy and repacks on first use.

Modules, by job: ``gemm_kernel`` (the :class:`GemmKernel` protocol every kernel keeps and the
:class:`PackedWeight` it packs into), ``registry`` (``linear_backend`` name → kernel class),
``native_gemm`` (our GEMM through ctypes), ``onednn_gemm`` (oneDNN's, rows padded), ``torch_linear``
(``F.linear``), ``dispatch_gemm`` (two kernels by row count), ``linear_op`` (the packed GEMMs as
opaque ops for compiled forwards), ``autotune`` (timing, :class:`KernelChoice`), ``linear_choices``
(:func:`tune_linears`: the choices for a model, before packing), ``linear_units`` (which modules
pack, in which units), ``packed_forward`` (the instance forward of one module), ``fused`` (sibling
projections in one GEMM), ``packed_linears`` (a model's collection and :func:`pack_linears`).

Where a quantized (e.g. int8 weight-only) linear goes: its class keeping :class:`GemmKernel`
(``pack`` returns a :class:`PackedWeight` with ``scales``/``zero_points``) with its C code beside
it, registered as an op through ``linear_op.register_linear_op`` (the schema carries the scales),
one line in ``registry.KERNELS`` and its name in ``config.LINEAR_BACKENDS``.
"""

from .autotune import KernelChoice, KernelTuner
from .fused import FUSED_GROUPS, FusedGroup
from .gemm_kernel import GemmKernel, PackedWeight
from .linear_choices import LinearChoices, tune_linears
from .native_gemm import NativeGEMM, NativePackedXGEMM
from .onednn_gemm import OneDNNGEMM, onednn_available, padded_rows
from .packed_forward import PackedForward
from .packed_linears import PackedLinears, pack_linears
from .registry import KERNELS, available_kernels, make_kernel
from .torch_linear import TorchLinear

__all__ = [
    "FUSED_GROUPS",
    "KERNELS",
    "FusedGroup",
    "GemmKernel",
    "KernelChoice",
    "KernelTuner",
    "LinearChoices",
    "NativeGEMM",
    "NativePackedXGEMM",
    "OneDNNGEMM",
    "PackedForward",
    "PackedLinears",
    "PackedWeight",
    "TorchLinear",
    "available_kernels",
    "make_kernel",
    "onednn_available",
    "pack_linears",
    "padded_rows",
    "tune_linears",
]
