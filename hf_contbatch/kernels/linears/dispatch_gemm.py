"""Two packed kernels for one shape class, each serving the row buckets it won (``autotune``)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .gemm_kernel import GemmKernel, PackedWeight


def bucket_of(rows: int, buckets: Sequence[int]) -> int:
    """Index in ``buckets`` (ascending) of the smallest bucket >= ``rows`` (the last one beyond it)."""
    for i, b in enumerate(buckets):
        if rows <= b:
            return i
    return len(buckets) - 1


class DispatchGEMM:
    """Two packed kernels for one shape class, each serving the row buckets it won; keeps the
    :class:`~hf_contbatch.kernels.linears.gemm_kernel.GemmKernel` protocol itself.

    :meth:`pack` returns a :class:`PackedWeight` whose ``data`` is one packed copy per kernel,
    :meth:`step_bias` one bias per kernel; :meth:`linear` runs the kernel of the call's row bucket.
    Under ``torch.compile`` (symbolic row counts) the first kernel serves every call.

    Args:
        kernels: the packed kernels, the overall winner first.
        table: per entry of ``buckets``, the index in ``kernels`` that serves it.
        buckets: the ascending row buckets (``autotune.ROW_BUCKETS``).
    """

    def __init__(self, kernels: Sequence[GemmKernel], table: Sequence[int], buckets: Sequence[int]) -> None:
        self.kernels = tuple(kernels)
        self.table = tuple(table)
        self.buckets = tuple(buckets)
        self.names = tuple(k.name for k in self.kernels)
        self.name = self.names[0]  # the overall winner, for messages
        self.isa = "+".join(k.isa for k in self.kernels)
        self.build_id = ",".join(k.build_id for k in self.kernels)
        self.exact_unpack = any(k.exact_unpack for k in self.kernels)

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(d for d in self.kernels[0].dtypes if all(d in k.dtypes for k in self.kernels[1:]))

    def supports(self, weight: torch.Tensor) -> bool:
        return all(k.supports(weight) for k in self.kernels)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """One packed copy per kernel, except that a kernel able to read another's copy in place
        (an ``adopt(packed)`` method returning its own ``PackedWeight`` or None) shares it: two
        int8 kernels then hold one int8 weight, not two."""
        parts: list[Optional[PackedWeight]] = [None if hasattr(k, "adopt") else k.pack(weight) for k in self.kernels]
        for i, k in enumerate(self.kernels):
            if parts[i] is None:
                shared = (k.adopt(p) for p in parts if p is not None)
                parts[i] = next((s for s in shared if s is not None), None) or k.pack(weight)
        return PackedWeight(tuple(parts), tuple(weight.shape), weight.dtype)

    def unpack(self, packed: PackedWeight) -> Optional[torch.Tensor]:
        for kernel, part in zip(self.kernels, packed.data):
            if kernel.exact_unpack:
                return kernel.unpack(part)
        return None

    def reference_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The float weight the kernels multiply by (a quantized kernel's dequantized weight)."""
        ref = getattr(self.kernels[0], "reference_weight", None)
        return weight if ref is None else ref(weight)

    def step_bias(self, bias: Optional[torch.Tensor]):
        return None if bias is None else tuple(k.step_bias(bias) for k in self.kernels)

    def index_for_rows(self, rows: int) -> int:
        """Index in :attr:`kernels` (and in a packed weight's ``data``) of the kernel serving calls
        of ``rows`` input rows."""
        return self.table[bucket_of(rows, self.buckets)]

    def _pick(self, x: torch.Tensor) -> int:
        if torch.compiler.is_compiling() or not x.dim() or not x.shape[-1]:
            return 0
        return self.index_for_rows(x.numel() // x.shape[-1])

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        i = self._pick(x)
        return self.kernels[i].linear(x, packed.data[i], None if bias is None else bias[i], out_features)

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        i = self._pick(x)
        return self.kernels[i].linear_verified(x, packed.data[i], None if bias is None else bias[i], out_features)
