"""The one map from ``linear_backend`` names to GEMM kernel classes.

The user-facing names live in :data:`hf_contbatch.config.LINEAR_BACKENDS` (the config layer is
stdlib-only, so it cannot import the kernels); this module maps every name but ``"auto"`` to its
class and checks at import that the two lists agree. Adding a kernel (an int8 weight-only GEMM, say):
its class (keeping :class:`~hf_contbatch.kernels.linears.gemm_kernel.GemmKernel`), one line in
:data:`KERNELS`, and its name in ``LINEAR_BACKENDS``.
"""

from __future__ import annotations

import logging

from ...config import LINEAR_BACKENDS
from .gemm_kernel import GemmKernel
from .int8_gemm import W8A8GEMM, DequantFloatGEMM, NativeInt8GEMM, TorchInt8GEMM
from .native_gemm import NativeGEMM
from .onednn_gemm import OneDNNGEMM
from .torch_linear import TorchLinear

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The ``linear_backend`` that times the kernels per shape (``autotune``) instead of naming one."""
UNPACKED = TorchLinear.name
"""The kernel that packs nothing (``F.linear`` over the module's own weight)."""

KERNELS: dict[str, type] = {k.name: k for k in (NativeGEMM, OneDNNGEMM, TorchLinear)}
"""Kernel class by ``linear_backend`` name; packed kernels first, in the order "auto" prefers them."""

INT8_KERNELS: dict[str, type] = {k.name: k for k in (NativeInt8GEMM, DequantFloatGEMM, TorchInt8GEMM, W8A8GEMM)}
"""Int8 kernel class by name (``quantization="int8"``, and torchao int8 weight-only models)."""
INT8_FOR_BACKEND = {"native": NativeInt8GEMM.name, "torch": TorchInt8GEMM.name, W8A8GEMM.name: W8A8GEMM.name}
"""The int8 kernel a forced ``linear_backend`` means under int8 weights (oneDNN has none here)."""
INT8_ONLY_BACKENDS = (W8A8GEMM.name,)
"""``linear_backend`` names with an int8 kernel only (valid with ``quantization="int8"`` alone)."""
ACTIVATION_QUANTIZING = frozenset({W8A8GEMM.name})
"""Int8 kernels that also round the activations to int8: never "auto" candidates (their outputs are
not the weight-only scheme's; see ``W8A8GEMM``), served only when named."""

if set(LINEAR_BACKENDS) != {AUTO, *KERNELS, *INT8_ONLY_BACKENDS}:  # pragma: no cover - a kernel added on one side only
    raise ImportError(
        f"config.LINEAR_BACKENDS {LINEAR_BACKENDS} and the GEMM registry {sorted([*KERNELS, *INT8_ONLY_BACKENDS])} "
        "disagree"
    )


def make_kernel(name: str) -> GemmKernel:
    """The kernel ``name`` (a key of :data:`KERNELS`).

    Raises:
        KeyError: an unknown name.
        RuntimeError: the kernel cannot run here (no C compiler, no oneDNN); the message says why.
    """
    return {**KERNELS, **INT8_KERNELS}[name]()


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


def available_int8_kernels() -> dict[str, GemmKernel]:
    """The weight-only int8 kernels that work here by name: the candidates of int8 "auto" (the
    activation-quantizing ones are not: :data:`ACTIVATION_QUANTIZING`)."""
    kernels = {}
    for name in INT8_KERNELS:
        if name in ACTIVATION_QUANTIZING:
            continue
        try:
            kernels[name] = make_kernel(name)
        except RuntimeError as exc:
            logger.info("int8 linears: %s unavailable (%s)", name, exc)
    return kernels
