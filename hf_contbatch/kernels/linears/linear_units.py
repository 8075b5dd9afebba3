"""Which ``nn.Linear`` modules of a model are packed, and the GEMM units they form (a fused sibling
group is one unit, every other module one of its own)."""

from __future__ import annotations

from typing import Callable, Collection, Optional

import torch

from ...config import QuantScheme
from ..model_layout import ModelLayout
from .fused import sibling_groups
from .int8_weights import is_plain_tensor, is_torchao_int8_weight_only

PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Weight dtypes whose linears are packed (where a kernel packs the dtype: ``GemmKernel.supports``)."""

Unit = list[torch.nn.Linear]


def _own_linear(m: torch.nn.Module) -> bool:
    """A plain CPU ``nn.Linear`` with no instance forward or hooks of someone else's."""
    return (
        type(m) is torch.nn.Linear  # subclasses (quantized, LoRA, ...) have their own forward
        and "forward" not in m.__dict__  # accelerate's hooks and other wrappers live here
        and not getattr(m, "_hf_hook", None)
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and m.weight.device.type == "cpu"
        and m.weight.numel() > 0
    )


def eligible(m: torch.nn.Module) -> bool:
    """Whether ``m`` may get a packed float forward: a plain CPU ``nn.Linear`` whose weight (and
    bias) is an ordinary dense tensor of a packed dtype. A weight that is a tensor subclass (a
    torchao ``Int8Tensor``: its storage is not float data) never reaches a float kernel."""
    return (
        _own_linear(m)
        and is_plain_tensor(m.weight)
        and (m.bias is None or is_plain_tensor(m.bias))
        and m.weight.dtype in PACKED_DTYPES
    )


def int8_eligible(m: torch.nn.Module, quantize_float: bool) -> bool:
    """Whether ``m`` may get a packed weight-only int8 forward: one whose weight torchao quantized
    to int8 weight-only (repacked exactly), or, with ``quantize_float``, any float-eligible one."""
    if not _own_linear(m) or (m.bias is not None and not is_plain_tensor(m.bias)):
        return False
    return is_torchao_int8_weight_only(m.weight) or (quantize_float and eligible(m))


def packable_modules(
    model: torch.nn.Module,
    exclude: Collection[torch.nn.Module] = (),
    quantization: Optional[QuantScheme] = None,
    layout: Optional[ModelLayout] = None,
) -> list[torch.nn.Linear]:
    """The model's eligible linears, minus ``exclude`` (LoRA's A and B, which ``kernels.lora`` reads),
    from ``layout`` (the engine's one walk of the model; default: walked here).

    ``quantization``: None, the float linears; a scheme, the torchao int8 weight-only linears and,
    when it ``quantize_float_weights`` ("int8", "w8a8"), the float ones too (all served with int8
    weights)."""
    skip = {id(m) for m in exclude}
    if quantization is None:
        test = eligible
    else:
        quantize_float = quantization.quantize_float_weights
        test = lambda m: int8_eligible(m, quantize_float)  # noqa: E731
    linears = (layout or ModelLayout.of(model)).linears
    return [m for _, m in linears if test(m) and id(m) not in skip]


def weight_bytes(modules: list[torch.nn.Linear]) -> int:
    """Bytes of the modules' weights as float values (what one packed float copy of them costs)."""
    return sum(m.weight.numel() * m.weight.dtype.itemsize for m in modules)


def fits_auto(total: int, available_bytes: Optional[Callable[[], Optional[int]]]) -> tuple[bool, bool]:
    """``(pack, dual)`` for ``linear_backend="auto"``: pack when one packed copy of ``total`` bytes
    takes at most a quarter of the available host memory, keep a second kernel's copy per shape when
    two do (unknown memory: both)."""
    avail = available_bytes() if available_bytes is not None else None
    if avail is None:
        return True, True
    return total <= avail // 4, 2 * total <= avail // 4


def linear_units(
    model: torch.nn.Module, modules: list[torch.nn.Linear], fuse: bool, layout: Optional[ModelLayout] = None
) -> list[Unit]:
    """The GEMM units: each fused sibling group as one unit, every other module alone (``layout``:
    the model's walk, see :func:`packable_modules`)."""
    groups = sibling_groups(model, modules, layout) if fuse else []
    grouped = {id(m) for g in groups for m in g}
    return groups + [[m] for m in modules if id(m) not in grouped]


def unit_shape(unit: Unit) -> tuple[int, int, torch.dtype]:
    """``(in_features, out_features, dtype)`` of the unit's one GEMM."""
    return unit[0].in_features, sum(m.out_features for m in unit), unit[0].weight.dtype


def quantized_linears(model: torch.nn.Module, layout: Optional[ModelLayout] = None) -> dict[str, str]:
    """``{module name: weight type name}`` of the model's linears whose weight is a tensor subclass
    (a quantizer's: torchao's ``Int8Tensor``, ...): never handed to a float kernel. A float weight an
    open int8 engine spilled to disk (``weight_spill.SpilledWeight``) is a float weight, not listed."""
    from .weight_spill import SpilledWeight

    return {
        name: type(m.weight).__name__
        for name, m in (layout or ModelLayout.of(model)).linears
        if isinstance(m.weight, torch.Tensor)
        and not is_plain_tensor(m.weight)
        and not isinstance(m.weight, SpilledWeight)
    }


def check_quantized_linears(model: torch.nn.Module, layout: Optional[ModelLayout] = None) -> dict[str, str]:
    """Check that every linear with a quantized (tensor-subclass) weight runs its own ``F.linear``
    on an input of the model's dtype, once, with a one-row probe; returns :func:`quantized_linears`.

    Raises:
        ValueError: naming the module and its weight's type, for a weight whose own ``F.linear``
            fails (so it is refused when the engine is built, not in a step).
    """
    layout = layout or ModelLayout.of(model)
    found = quantized_linears(model, layout)
    modules = dict(layout.modules)
    probed: set = set()
    for name, kind in found.items():
        m = modules[name]
        key = (kind, str(getattr(m.weight, "block_size", "")), type(getattr(m.weight, "act_quant_kwargs", None)))
        if key in probed:  # one probe per kind of weight: each costs a forward
            continue
        x = torch.zeros(1, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
        try:
            with torch.no_grad():
                m(x)
        except Exception as exc:  # a quantizer's own dispatch may raise anything
            raise ValueError(
                f"cannot serve {name!r}: its weight is a {type(m.weight).__module__}.{kind} whose own linear fails "
                f"here ({type(exc).__name__}: {exc})"
            ) from exc
        probed.add(key)
    return found
