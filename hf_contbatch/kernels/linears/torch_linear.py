"""``F.linear`` as a GEMM kernel: nothing packed, the weight itself serves (a tuning candidate, and
``linear_backend="torch"``)."""

from __future__ import annotations

from typing import Optional

import torch

from .gemm_kernel import PackedWeight


class TorchLinear:
    """``F.linear`` over the module's own weight: :meth:`pack` wraps it without copying, so a shape
    it serves keeps its float weight and costs no memory."""

    name = "torch"
    exact_unpack = False  # nothing packed: the weight itself serves
    isa = "torch"
    build_id = ""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.dim() == 2

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        return PackedWeight(weight, tuple(weight.shape), weight.dtype)

    def unpack(self, packed: PackedWeight) -> torch.Tensor:
        return packed.data

    @staticmethod
    def step_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if bias is None else bias.detach()

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        return torch.nn.functional.linear(x, packed.data, bias)

    linear_verified = linear
