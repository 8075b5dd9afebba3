"""One walk of a model's modules, as a value (:class:`ModelLayout`): its attention layers and their
kinds, its linears, its norms, and every module in walk order for the few questions the views do
not answer (a fused group's parent, a module's name).

The engine walks its model once (``ModelLayout.of``) and hands the layout to everything that used
to walk it again: packing and quantizing the linears (``linears.linear_units``, ``linears.fused``,
``linears.linear_choices``, ``linears.packed_linears``), the fused norms and MLPs (``fused_ops``)
and the check of quantizers' weights. The layout holds references to the modules, never copies;
it describes the model as it was when walked (a module added later is not in it).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Optional

import torch

FULL_ATTENTION = "full_attention"
"""The kind of a layer that attends over its whole context (transformers' ``layer_types`` name)."""
SLIDING_ATTENTION = "sliding_attention"
"""The kind of a layer that attends over its last ``sliding_window`` tokens."""


@dataclass(frozen=True)
class AttentionLayer:
    """One decoder layer's attention module.

    Attributes:
        index: its ``layer_idx`` (the index of its slice of the KV cache).
        name: its path in the model (``"model.layers.0.self_attn"``).
        module: the module itself (a reference).
        kind: ``config.layer_types[index]`` where the config lists kinds ("full_attention",
            "sliding_attention", ...), else "sliding_attention" where the layer has a window and
            "full_attention" where not.
        sliding_window: tokens the layer attends over, as its forward passes them to the
            attention function (see :func:`_kind`), None for full attention. The attention
            function's own ``sliding_window`` argument stays the definitive value at run time.
    """

    index: int
    name: str
    module: torch.nn.Module
    kind: str
    sliding_window: Optional[int]


def _kind(module, index: int, layer_types, config_window) -> tuple[str, Optional[int]]:
    """``(kind, sliding window)`` of one attention layer, as its forward will pass them to the
    attention function: the module's own ``sliding_window`` where it keeps one (Gemma-2, Qwen2: None
    on its full-attention layers), else the config's kinds with the config's window, else (Mistral:
    every layer passes ``config.sliding_window``) the config's window for every layer."""
    listed = layer_types[index] if layer_types and index < len(layer_types) else None
    if hasattr(module, "sliding_window"):
        window = module.sliding_window if isinstance(module.sliding_window, int) else None
    elif listed is not None:
        window = config_window if listed == SLIDING_ATTENTION and isinstance(config_window, int) else None
    else:
        window = config_window if isinstance(config_window, int) else None
    kind = listed or (SLIDING_ATTENTION if window is not None else FULL_ATTENTION)
    return kind, window


def _class_sources(cls: type) -> str:
    """The source of ``cls`` and of its bases up to (not including) ``torch.nn.Module``; "" where
    a class has none to read (built in, or defined in a REPL)."""
    parts = []
    for c in cls.__mro__:
        if c is torch.nn.Module or c is object:
            break
        try:
            parts.append(inspect.getsource(c))
        except (OSError, TypeError):
            pass
    return "\n".join(parts)


def _weight_read_directly(name: str, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether the module that owns the linear at ``name`` reads that linear's weight's values in
    its own code (``self.<child>.weight`` other than its ``.dtype``, ``.device`` or ``.shape``, which
    a spilled weight still answers) instead of only calling it."""
    parent_name, _, child = name.rpartition(".")
    parent = modules.get(parent_name)
    if parent is None:
        return False
    pattern = rf"self\.{re.escape(child)}\.weight\b(?!\.(?:dtype|device|shape)\b)"
    return re.search(pattern, _class_sources(type(parent))) is not None


@dataclass(frozen=True)
class ModelLayout:
    """A model's modules as one walk found them (see the module docstring).

    Attributes:
        modules: every ``(name, module)`` of ``model.named_modules()``, in its order (shared modules
            once).
        attention: the attention layers, by ``layer_idx``.
        linears: every ``(name, module)`` that is an ``nn.Linear`` (subclasses included: PEFT's
            and quantizers' wrappers; whoever packs filters them), except a linear whose weight its
            parent module's code reads directly (Mamba's ``dt_proj``: ``self.dt_proj.weight @ x``).
            Packing, quantizing or spilling such a linear would not change what its parent computes
            and would take away the values it reads, so it steps aside and stays float.
        norms: every ``(name, module)`` whose class is a norm (its name ends in "Norm": RMSNorm,
            LayerNorm, ...).
    """

    modules: tuple[tuple[str, torch.nn.Module], ...]
    attention: tuple[AttentionLayer, ...]
    linears: tuple[tuple[str, torch.nn.Linear], ...]
    norms: tuple[tuple[str, torch.nn.Module], ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelLayout":
        """The layout of ``model`` (any ``nn.Module``; a transformers model's config gives the
        layers' kinds), from one ``named_modules()`` walk."""
        modules = tuple(model.named_modules())
        names = dict(modules)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        layer_types = getattr(config, "layer_types", None)
        attention = []
        for name, m in modules:
            index = getattr(m, "layer_idx", None)
            if not (isinstance(index, int) and type(m).__name__.endswith("Attention")):
                continue
            kind, window = _kind(m, index, layer_types, getattr(config, "sliding_window", None))
            attention.append(AttentionLayer(index, name, m, kind, window))
        return cls(
            modules=modules,
            attention=tuple(sorted(attention, key=lambda a: a.index)),
            linears=tuple(
                (n, m) for n, m in modules if isinstance(m, torch.nn.Linear) and not _weight_read_directly(n, names)
            ),
            norms=tuple((n, m) for n, m in modules if type(m).__name__.endswith("Norm")),
        )

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each attention layer's kind, by ``layer_idx``: what the KV cache groups are formed from."""
        return tuple(a.kind for a in self.attention)
