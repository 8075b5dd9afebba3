"""The packed GEMMs as opaque ``torch.ops.hf_contbatch`` ops, for compiled forwards.

Inductor cannot lower our packed layouts, and each kernel keeps its own row handling there too, so
a compiled forward calls ``torch.ops.hf_contbatch.native_linear`` / ``onednn_linear`` as one op.
Registered with ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter wraps
every call in Python autograd and alias-checking layers, a cost that counts at dozens of calls a
step. The ops are inference-only (no autograd formula) and return new tensors. The schema carries a
packed weight's optional ``scales`` and ``zero_points`` (``gemm_kernel.PackedWeight``), so a
quantized kernel registers its op the same way.
"""

from __future__ import annotations

from typing import Callable

import torch

_OPS = torch.library.Library("hf_contbatch", "FRAGMENT")


def register_linear_op(name: str, impl: Callable) -> None:
    """Register ``impl(x, packed, scales, zero_points, bias, out_features)`` (``x`` ``[..., in]`` →
    ``[..., out_features]``; ``scales``/``zero_points`` None for a float layout) as
    ``torch.ops.hf_contbatch.<name>``, with a fake kernel for tracing."""
    _OPS.define(
        f"{name}(Tensor x, Tensor packed, Tensor? scales, Tensor? zero_points, Tensor? bias, int out_features) -> Tensor"
    )
    _OPS.impl(name, impl, "CompositeExplicitAutograd")

    def fake(x, packed, scales, zero_points, bias, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    torch.library.register_fake(f"hf_contbatch::{name}", fake, lib=_OPS)
