"""Which ``nn.Linear`` modules of a model are packed, and the GEMM units they form (a fused sibling
group is one unit, every other module one of its own)."""

from __future__ import annotations

from typing import Callable, Collection, Optional

import torch

from .fused import sibling_groups

PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes whose linears are packed (bfloat16 where a kernel has a bf16 path)."""

Unit = list[torch.nn.Linear]


def eligible(m: torch.nn.Module) -> bool:
    """Whether ``m`` may get a packed forward: a plain CPU ``nn.Linear`` of a packed dtype, with no
    instance forward or hooks of someone else's."""
    return (
        type(m) is torch.nn.Linear  # subclasses (quantized, LoRA, ...) have their own forward
        and "forward" not in m.__dict__  # accelerate's hooks and other wrappers live here
        and not getattr(m, "_hf_hook", None)
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and m.weight.device.type == "cpu"
        and m.weight.dtype in PACKED_DTYPES
        and m.weight.numel() > 0
    )


def packable_modules(model: torch.nn.Module, exclude: Collection[torch.nn.Module] = ()) -> list[torch.nn.Linear]:
    """The model's eligible linears, minus ``exclude`` (LoRA's A and B, which ``kernels.lora`` reads)."""
    skip = {id(m) for m in exclude}
    return [m for m in model.modules() if eligible(m) and id(m) not in skip]


def weight_bytes(modules: list[torch.nn.Linear]) -> int:
    """Bytes of the modules' weights: what one packed copy of them costs."""
    return sum(m.weight.numel() * m.weight.element_size() for m in modules)


def fits_auto(total: int, available_bytes: Optional[Callable[[], Optional[int]]]) -> tuple[bool, bool]:
    """``(pack, dual)`` for ``linear_backend="auto"``: pack when one packed copy of ``total`` bytes
    takes at most a quarter of the available host memory, keep a second kernel's copy per shape when
    two do (unknown memory: both)."""
    avail = available_bytes() if available_bytes is not None else None
    if avail is None:
        return True, True
    return total <= avail // 4, 2 * total <= avail // 4


def linear_units(model: torch.nn.Module, modules: list[torch.nn.Linear], fuse: bool) -> list[Unit]:
    """The GEMM units: each fused sibling group as one unit, every other module alone."""
    groups = sibling_groups(model, modules) if fuse else []
    grouped = {id(m) for g in groups for m in g}
    return groups + [[m] for m in modules if id(m) not in grouped]


def unit_shape(unit: Unit) -> tuple[int, int, torch.dtype]:
    """``(in_features, out_features, dtype)`` of the unit's one GEMM."""
    return unit[0].in_features, sum(m.out_features for m in unit), unit[0].weight.dtype
