"""The packed GEMMs as opaque ``torch.ops.hf_contbatch`` ops, for compiled forwards.

Inductor cannot lower our packed layouts, and each kernel keeps its own row handling there too, so
a compiled forward calls ``torch.ops.hf_contbatch.native_linear`` / ``onednn_linear`` as one op.
Registered with ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter wraps
every call in Python autograd and alias-checking layers, a cost that counts at dozens of calls a
step. The ops are inference-only (no autograd formula) and return new tensors.
"""

from __future__ import annotations

from typing import Callable

import torch

_OPS = torch.library.Library("hf_contbatch", "FRAGMENT")


def register_linear_op(name: str, impl: Callable) -> None:
    """Register ``impl(x, packed, bias, out_features)`` (``x`` ``[..., in]`` → ``[..., out_features]``)
    as ``torch.ops.hf_contbatch.<name>``, with a fake kernel for tracing."""
    _OPS.define(f"{name}(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
    _OPS.impl(name, impl, "CompositeExplicitAutograd")

    def fake(x, packed, bias, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    torch.library.register_fake(f"hf_contbatch::{name}", fake, lib=_OPS)
