"""The contract every GEMM kernel of the packed linears keeps (:class:`GemmKernel`), and the packed
weight it hands back (:class:`PackedWeight`).

A kernel packs an ``[out, in]`` weight once into its own layout and multiplies inputs by it many
times. Everything above the kernels (``packed_forward``, ``fused``, ``autotune``, ``packed_linears``)
talks to this protocol only, so a new kernel (an int8 weight-only one, say) is one class that keeps
it, its C code, and one line in :mod:`~hf_contbatch.kernels.linears.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """One weight in a kernel's layout.

    Attributes:
        data: the kernel's packed values: a tensor (its layout is the kernel's business; oneDNN's is
            opaque), or, for a kernel that dispatches between others by row count, a tuple of their
            ``PackedWeight`` values.
        shape: the logical weight shape ``(out_features, in_features)``.
        dtype: the logical weight dtype (what :meth:`GemmKernel.unpack` gives back; the dtype the
            inputs must have).
        scales: per-output-channel (or per-group) scales of a quantized layout, else None.
        zero_points: the matching zero points of an asymmetric quantized layout, else None.
    """

    data: Any
    shape: tuple[int, int]
    dtype: torch.dtype
    scales: Optional[torch.Tensor] = None
    zero_points: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copy (data, scales and zero points); a tensor that two parts of
        a dispatching kernel's copy share (one int8 weight read by two kernels) counts once."""
        return sum(_tensor_bytes(t) for t in {id(t): t for t in self._tensors()}.values())

    def _tensors(self):
        parts = self.data if isinstance(self.data, tuple) else (self.data,)
        for p in parts:
            if isinstance(p, PackedWeight):
                yield from p._tensors()
            elif isinstance(p, torch.Tensor):
                yield p
        yield from (t for t in (self.scales, self.zero_points) if t is not None)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@runtime_checkable
class GemmKernel(Protocol):
    """A GEMM over weights packed once: ``y = x @ W.T + b``.

    Attributes:
        name: the kernel's name in :data:`~hf_contbatch.config.LINEAR_BACKENDS` (the registry's key).
        dtypes: the weight dtypes it packs on this machine.
        isa: the instruction set it runs on here ("avx512f", "avx2", "neon", "generic", "onednn",
            "torch"): for reports.
        build_id: names the build whose timings stay valid ("" when nothing is compiled): part of the
            tuner's cache key.
        exact_unpack: whether :meth:`unpack` gives the weight back bit for bit, so the module's
            float weight can be released while packed (``packed_forward``).

    Construction raises ``RuntimeError`` when the kernel cannot run here (no C compiler, no oneDNN).
    """

    name: str
    exact_unpack: bool

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]: ...

    @property
    def isa(self) -> str: ...

    @property
    def build_id(self) -> str: ...

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`pack` takes this ``[out, in]`` weight (dtype, device, sizes)."""
        ...

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """The weight in this kernel's layout (a new copy: the weight is only read). Raises
        ``RuntimeError`` for a weight :meth:`supports` rejects."""
        ...

    def unpack(self, packed: PackedWeight) -> Optional[torch.Tensor]:
        """The ``[out, in]`` weight bit for bit, or None where the layout cannot give it back
        (then the float weight must be kept beside the packed copy)."""
        ...

    def step_bias(self, bias: Optional[torch.Tensor]) -> Any:
        """The bias as :meth:`linear_verified` takes it (converted once a step), or None."""
        ...

    def linear(
        self, x: torch.Tensor, packed: PackedWeight, bias: Optional[torch.Tensor], out_features: int
    ) -> torch.Tensor:
        """``x`` ``[..., in]`` (the packed dtype) → ``[..., out_features]``, plus ``bias``
        ``[out_features]``; checks its arguments (``RuntimeError`` on a mismatch)."""
        ...

    def linear_verified(self, x: torch.Tensor, packed: PackedWeight, bias: Any, out_features: int) -> torch.Tensor:
        """:meth:`linear` for arguments checked already, ``bias`` from :meth:`step_bias`."""
        ...
