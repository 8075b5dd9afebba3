"""The weights a quantization leaves float, counted (:func:`unquantized_weights`).

Why: the int8 kernels serve ``nn.Linear`` modules only. transformers 5 keeps a mixture of experts'
weights as 3-D parameters of one experts module (Mixtral's ``experts.gate_up_proj``
``[experts, 2 * intermediate, hidden]`` and ``experts.down_proj``, the bulk of such a model) and its
router as a plain parameter; an int8 engine leaves those in float. The engine warns
(:class:`FloatWeightsWarning`) naming them with their bytes and share of the model, and the stats
and the quality report carry the same figures, so "int8" never silently means "int8 for a quarter
of the weights".

What counts: every floating-point parameter of two or more dimensions (a GEMM's weight, or a stack
of them) outside the quantized linears. Not counted: embeddings (``nn.Embedding``: a table read by
index, kept float by design, also when an LM head is tied to it), 1-D parameters (norms, biases)
and the modules the caller excludes (LoRA's A and B, served in float on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional

import torch

from ..model_layout import ModelLayout


class FloatWeightsWarning(UserWarning):
    """A quantization leaves some of the model's weights float (see :func:`unquantized_weights`)."""


@dataclass(frozen=True)
class UnquantizedWeights:
    """The weights a quantization leaves float.

    Attributes:
        names: the parameters' names in the model (``"model.layers.0.mlp.experts.gate_up_proj"``),
            in the model's order, each tensor once.
        bytes: their bytes, as stored (float).
        model_bytes: bytes of all the model's parameters as loaded (each tensor once, float).
    """

    names: tuple[str, ...] = ()
    bytes: int = 0
    model_bytes: int = 0

    @property
    def fraction(self) -> float:
        """``bytes / model_bytes`` (0.0 for a model without parameters)."""
        return self.bytes / self.model_bytes if self.model_bytes else 0.0

    def describe(self, label: str) -> str:
        """One sentence for a warning or a report line: how many tensors, which (the first few),
        their MiB and share of the model."""
        shown = ", ".join(self.names[:4]) + (f" and {len(self.names) - 4} more" if len(self.names) > 4 else "")
        return (
            f"quantization={label!r} leaves {len(self.names)} weight tensor{'s' if len(self.names) != 1 else ''} "
            f"in float ({shown}): {self.bytes / 2**20:.2f} MiB, {100 * self.fraction:.1f}% of the model's "
            f"{self.model_bytes / 2**20:.2f} MiB of parameters. Its int8 kernels serve nn.Linear modules only; "
            "these are other modules' parameters (a mixture of experts' 3-D expert weights, its router), "
            "computed in float by their own forward"
        )


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def unquantized_weights(
    model: torch.nn.Module,
    quantized: Collection[torch.nn.Module],
    exclude: Collection[torch.nn.Module] = (),
    layout: Optional[ModelLayout] = None,
) -> UnquantizedWeights:
    """The float weights outside the ``quantized`` modules (see the module docstring for what
    counts), ``exclude`` left out; ``layout``: the model's walk (default: walked here). Call it
    before the float weights are spilled (their sizes are read, never their values)."""
    skip = {id(m) for m in (*quantized, *exclude)}
    seen: set[int] = set()
    names, total = [], 0
    for module_name, m in (layout or ModelLayout.of(model)).modules:
        for param_name, p in m.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(m) in skip or isinstance(m, torch.nn.Embedding) or p.dim() < 2 or not p.is_floating_point():
                continue
            names.append(f"{module_name}.{param_name}" if module_name else param_name)
            total += _nbytes(p)
    model_bytes = sum(_nbytes(p) for p in model.parameters())
    return UnquantizedWeights(tuple(names), total, model_bytes)
