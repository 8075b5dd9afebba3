"""The one map from ``linear_backend`` names to GEMM kernel classes.

The user-facing names live in :data:`hf_contbatch.config.LINEAR_BACKENDS` (the config layer is
stdlib-only, so it cannot import the kernels); this module maps every name but ``"auto"`` to its
class and checks at import that the two lists agree. Adding a kernel (an int8 weight-only GEMM, say):
its class (keeping :class:`~hf_contbatch.kernels.linears.gemm_kernel.GemmKernel`), one line in
:data:`KERNELS`, and its name in ``LINEAR_BACKENDS``.
"""

from __future__ import annotations

import logging

from ...config import LINEAR_BACKENDS, QUANT_SCHEMES, TORCHAO_INT8, QuantScheme
from .gemm_kernel import GemmKernel
from .int8_gemm import W8A8GEMM, DequantFloatGEMM, NativeInt8GEMM, NativeInt8MovsxGEMM, TorchInt8GEMM
from .native_gemm import NativeGEMM, NativePackedXGEMM, NativeWidenGEMM
from .onednn_gemm import OneDNNGEMM
from .torch_linear import TorchLinear
from .w8a8_torch import IntMMW8A8GEMM, TorchW8A8GEMM, WidenW8A8GEMM
from .widen_gemm import WidenF32GEMM

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The ``linear_backend`` that times the kernels per shape (``autotune``) instead of naming one."""
UNPACKED = TorchLinear.name
"""The kernel that packs nothing (``F.linear`` over the module's own weight)."""

KERNELS: dict[str, type] = {k.name: k for k in (NativeGEMM, OneDNNGEMM, TorchLinear)}
"""Kernel class by ``linear_backend`` name; packed kernels first, in the order "auto" prefers them."""

INT8_KERNELS: dict[str, type] = {
    k.name: k for k in (NativeInt8GEMM, NativeInt8MovsxGEMM, DequantFloatGEMM, TorchInt8GEMM)
}
"""Weight-only int8 kernel class by name (``quantization="int8"``, and torchao int8 weight-only
models): the activations stay in the model's dtype."""
W8A8_KERNELS: dict[str, type] = {k.name: k for k in (W8A8GEMM, IntMMW8A8GEMM, TorchW8A8GEMM, WidenW8A8GEMM)}
"""Int8-weight, int8-activation kernel class by name (``quantization="w8a8"``): each input row is
quantized to int8 on the fly and the products summed in int32."""
QUANTIZED_KERNELS: dict[tuple, dict[str, type]] = {
    ("int8", None, None): INT8_KERNELS,
    ("int8", "int8", None): W8A8_KERNELS,
}
"""The kernels of a quantization scheme, keyed by what they compute: ``(weight dtype, activation
dtype, group size)`` of a :class:`~hf_contbatch.config.QuantScheme` (:func:`kernel_key`): "auto"'s
candidates. Every kernel here quantizes its weight with one scale per output channel (group None)."""
QUANTIZED_FOR_BACKEND: dict[tuple, dict[str, str]] = {
    ("int8", None, None): {"native": NativeInt8GEMM.name, "torch": TorchInt8GEMM.name},
    ("int8", "int8", None): {"native": W8A8GEMM.name, "torch": TorchW8A8GEMM.name},
}
"""The quantized kernel a forced ``linear_backend`` means under each scheme (same keys as
:data:`QUANTIZED_KERNELS`; oneDNN has none here)."""


def kernel_key(scheme: QuantScheme) -> tuple:
    """``(weight_dtype, activation_dtype, group_size)``: the key of ``scheme``'s kernels."""
    return scheme.weight_dtype, scheme.activation_dtype, scheme.group_size


if set(LINEAR_BACKENDS) != {AUTO, *KERNELS}:  # pragma: no cover - a kernel added on one side only
    raise ImportError(f"config.LINEAR_BACKENDS {LINEAR_BACKENDS} and the GEMM registry {sorted(KERNELS)} disagree")
if any(kernel_key(s) not in QUANTIZED_KERNELS for s in (*QUANT_SCHEMES.values(), TORCHAO_INT8)):  # pragma: no cover
    raise ImportError(f"a scheme of config.QUANT_SCHEMES {sorted(QUANT_SCHEMES)} has no kernels in the GEMM registry")


def quantized_kernels(scheme: QuantScheme) -> dict[str, type]:
    """The kernel classes by name that serve ``scheme`` (:data:`QUANTIZED_KERNELS`)."""
    return QUANTIZED_KERNELS[kernel_key(scheme)]


def forced_quantized_kernel(scheme: QuantScheme, mode: str) -> str:
    """The kernel name a forced ``linear_backend`` ``mode`` means under ``scheme``.

    Raises:
        ValueError: ``mode`` has no kernel of the scheme ("linear_backend='onednn' has no int8
            kernel; use one of [...]").
    """
    named = QUANTIZED_FOR_BACKEND[kernel_key(scheme)]
    if mode not in named:
        raise ValueError(f"linear_backend={mode!r} has no {scheme.label} kernel; use one of {sorted([AUTO, *named])}")
    return named[mode]


def make_kernel(name: str) -> GemmKernel:
    """The kernel ``name`` (a key of :data:`KERNELS`).

    Raises:
        KeyError: an unknown name.
        RuntimeError: the kernel cannot run here (no C compiler, no oneDNN); the message says why.
    """
    return {**KERNELS, **INT8_KERNELS, **W8A8_KERNELS}[name]()


def available_kernels() -> dict[str, GemmKernel]:
    """The packed kernels that work here by name (every registered one but ``F.linear``;
    ``"native-widen"`` where the CPU has AVX512-BF16: :class:`~.native_gemm.NativeWidenGEMM`;
    ``"native-packx"`` where the build has the packed-x float32 tiles:
    :class:`~.native_gemm.NativePackedXGEMM`; and, where our GEMM builds, ``"widen-f32"`` for
    half-precision weights: :class:`~.widen_gemm.WidenF32GEMM`): the candidates of
    ``linear_backend="auto"`` besides ``F.linear``."""
    kernels = {}
    for name in KERNELS:
        if name == UNPACKED:
            continue
        try:
            kernels[name] = make_kernel(name)
        except RuntimeError as exc:
            logger.info("packed linears: %s unavailable (%s)", name, exc)
    native = kernels.get(NativeGEMM.name)
    if native is not None and native.half_isa != "widen":
        # A CPU with AVX512-BF16: bfloat16 weights widened to float32 are a candidate beside
        # VDPBF16PS (timing decides per shape and row count; without AVX512-BF16 "native" widens).
        kernels[NativeWidenGEMM.name] = NativeWidenGEMM()
    if native is not None:
        # Half-precision weights widened a group of panels a call for torch's float32 GEMM: on CPUs
        # whose bf16/fp16 GEMMs are slow (no native half precision), prefill's many rows may run
        # faster so; timing decides per shape and row count (it only packs bf16 and fp16 weights).
        kernels[WidenF32GEMM.name] = WidenF32GEMM()
    if native is not None and native.library.gemm_f32_packed_x is not None:
        # Float32 prefill rows with x packed into 14-row tiles (AVX-512 builds): timing decides per
        # shape and row count whether the copy of x pays here (same bits, the same packed weight).
        kernels[NativePackedXGEMM.name] = NativePackedXGEMM()
    return kernels


def available_quantized_kernels(scheme: QuantScheme) -> dict[str, GemmKernel]:
    """The kernels of ``scheme`` that work here by name: the candidates of "auto" under it."""
    kernels = {}
    for name in quantized_kernels(scheme):
        try:
            kernels[name] = make_kernel(name)
        except RuntimeError as exc:
            logger.info("%s linears: %s unavailable (%s)", scheme.label, name, exc)
    return kernels
