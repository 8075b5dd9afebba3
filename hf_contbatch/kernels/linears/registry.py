"""The one map from ``linear_backend`` names to GEMM kernel classes.

The user-facing names live in :data:`hf_contbatch.config.LINEAR_BACKENDS` (the config layer is
stdlib-only, so it cannot import the kernels); this module maps every name but ``"auto"`` to its
class and checks at import that the two lists agree. Adding a kernel (an int8 weight-only GEMM, say):
its class (keeping :class:`~hf_contbatch.kernels.linears.gemm_kernel.GemmKernel`), one line in
:data:`KERNELS`, and its name in ``LINEAR_BACKENDS``.
"""

from __future__ import annotations

import logging

from ...config import LINEAR_BACKENDS, QUANTIZATIONS
from .gemm_kernel import GemmKernel
from .int8_gemm import W8A8GEMM, DequantFloatGEMM, NativeInt8GEMM, TorchInt8GEMM
from .native_gemm import NativeGEMM
from .onednn_gemm import OneDNNGEMM
from .torch_linear import TorchLinear
from .w8a8_torch import TorchW8A8GEMM

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The ``linear_backend`` that times the kernels per shape (``autotune``) instead of naming one."""
UNPACKED = TorchLinear.name
"""The kernel that packs nothing (``F.linear`` over the module's own weight)."""

KERNELS: dict[str, type] = {k.name: k for k in (NativeGEMM, OneDNNGEMM, TorchLinear)}
"""Kernel class by ``linear_backend`` name; packed kernels first, in the order "auto" prefers them."""

INT8_KERNELS: dict[str, type] = {k.name: k for k in (NativeInt8GEMM, DequantFloatGEMM, TorchInt8GEMM)}
"""Weight-only int8 kernel class by name (``quantization="int8"``, and torchao int8 weight-only
models): the activations stay in the model's dtype."""
W8A8_KERNELS: dict[str, type] = {k.name: k for k in (W8A8GEMM, TorchW8A8GEMM)}
"""Int8-weight, int8-activation kernel class by name (``quantization="w8a8"``): each input row is
quantized to int8 on the fly and the products summed in int32."""
TORCHAO_INT8 = "torchao-int8"
"""``pack_linears``' quantization for a torchao int8 weight-only model's own linears (repacked exactly,
served by the weight-only kernels) while its other linears stay float."""
QUANTIZED_KERNELS: dict[str, dict[str, type]] = {"int8": INT8_KERNELS, "w8a8": W8A8_KERNELS, TORCHAO_INT8: INT8_KERNELS}
"""The kernels of each ``EngineConfig.quantization`` (``config.QUANTIZATIONS``): "auto"'s candidates."""
_INT8_NAMED = {"native": NativeInt8GEMM.name, "torch": TorchInt8GEMM.name}
QUANTIZED_FOR_BACKEND: dict[str, dict[str, str]] = {
    "int8": _INT8_NAMED,
    "w8a8": {"native": W8A8GEMM.name, "torch": TorchW8A8GEMM.name},
    TORCHAO_INT8: _INT8_NAMED,
}
"""The quantized kernel a forced ``linear_backend`` means under each quantization (oneDNN has none
here)."""

if set(LINEAR_BACKENDS) != {AUTO, *KERNELS}:  # pragma: no cover - a kernel added on one side only
    raise ImportError(f"config.LINEAR_BACKENDS {LINEAR_BACKENDS} and the GEMM registry {sorted(KERNELS)} disagree")
if set(QUANTIZED_KERNELS) != {*QUANTIZATIONS, TORCHAO_INT8}:  # pragma: no cover
    raise ImportError(f"config.QUANTIZATIONS {QUANTIZATIONS} and the registry {sorted(QUANTIZED_KERNELS)} disagree")


def make_kernel(name: str) -> GemmKernel:
    """The kernel ``name`` (a key of :data:`KERNELS`).

    Raises:
        KeyError: an unknown name.
        RuntimeError: the kernel cannot run here (no C compiler, no oneDNN); the message says why.
    """
    return {**KERNELS, **INT8_KERNELS, **W8A8_KERNELS}[name]()


def available_kernels() -> dict[str, GemmKernel]:
    """The packed kernels that work here by name (every registered one but ``F.linear``): the
    candidates of ``linear_backend="auto"`` besides ``F.linear``."""
    kernels = {}
    for name in KERNELS:
        if name == UNPACKED:
            continue
        try:
            kernels[name] = make_kernel(name)
        except RuntimeError as exc:
            logger.info("packed linears: %s unavailable (%s)", name, exc)
    return kernels


def available_quantized_kernels(quantization: str) -> dict[str, GemmKernel]:
    """The kernels of ``quantization`` (a key of :data:`QUANTIZED_KERNELS`) that work here by name:
    the candidates of "auto" under that quantization."""
    kernels = {}
    for name in QUANTIZED_KERNELS[quantization]:
        try:
            kernels[name] = make_kernel(name)
        except RuntimeError as exc:
            logger.info("%s linears: %s unavailable (%s)", quantization, name, exc)
    return kernels
