"""LoRA adapters of a ``peft.PeftModel``, each row of a flattened step with its own adapter.

Why: the rows of one continuous-batching step belong to many requests, and with several adapters
loaded each request may name another one (S-LoRA, Punica). PEFT's own mixed batches
(``generate(adapter_names=...)``) split a padded batch along its first dimension, which the
engine's ``[1, T]`` step does not have. Here every LoRA-wrapped linear runs its base layer over all
``T`` rows (packed as for a plain model) and then, per adapter present in the step, adds
``x[rows] @ A.T @ B.T * scaling`` to those rows (gather, two small GEMMs, scatter-add; a slice
instead of a gather when the rows are contiguous). The sum is the one PEFT's ``lora.Linear``
computes for that adapter (dropout off in eval mode; ``scaling`` is PEFT's own, so
``lora_alpha / r`` and rslora's ``lora_alpha / sqrt(r)`` are exact; a ``lora_bias`` is added with
the B matrix, scaled as PEFT does).

How it is plugged in: each ``peft.tuners.lora.Linear`` *instance* gets a ``forward`` attribute (its
class is never touched), :meth:`LoraLayers.restore` deletes them. The step's row -> adapter mapping
(:class:`AdapterRows`, built by the engine's runner with the step's metadata) is set for the
calling thread by :meth:`LoraLayers.step`; outside a step (the user's own ``generate``) a layer runs
PEFT's forward unchanged. What the rows cannot express is refused by name at install
(:func:`find_lora_layers`): DoRA and the other LoRA variants, LoRA on embeddings or convolutions,
merged adapters, ``modules_to_save``, trainable tokens and other tuner types.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

#: Rows of one adapter: a contiguous ``slice``, or an int64 index tensor.
Rows = Union[slice, torch.Tensor]


@dataclass(frozen=True)
class AdapterRows:
    """Which rows of one step run which LoRA adapter (rows of the base model are in no group).

    Attributes:
        num_rows: rows of the step's flattened ``[1, T]`` batch (``T``).
        groups: ``(adapter name, rows)`` per adapter in the step, rows into ``[0, T)``.
        num_logits_rows: rows the LM head reads (``StepInputs.logits_rows``; ``T`` when the model
            computes logits for every row).
        logits_groups: the same as ``groups`` for the LM head's rows, in the order it reads them.
    """

    num_rows: int
    groups: tuple[tuple[str, Rows], ...]
    num_logits_rows: int
    logits_groups: tuple[tuple[str, Rows], ...]

    @classmethod
    def build(
        cls, segments: Sequence[tuple[Optional[str], int]], logits_rows: Optional[Sequence[int]], device
    ) -> "AdapterRows":
        """The mapping of a step whose rows are ``segments`` in order: ``(adapter or None, rows)``
        per request. ``logits_rows``: the rows the LM head reads (None: all rows, in order)."""
        row_adapter: list[Optional[str]] = []
        for name, n in segments:
            row_adapter.extend([name] * n)
        groups = _groups(row_adapter, device)
        if logits_rows is None:
            return cls(len(row_adapter), groups, len(row_adapter), groups)
        logits = _groups([row_adapter[r] for r in logits_rows], device)
        return cls(len(row_adapter), groups, len(logits_rows), logits)


def _groups(row_adapter: Sequence[Optional[str]], device) -> tuple[tuple[str, Rows], ...]:
    """``(adapter, rows)`` for each adapter named in ``row_adapter`` (None: the base model)."""
    by_name: dict[str, list[int]] = {}
    for i, name in enumerate(row_adapter):
        if name is not None:
            by_name.setdefault(name, []).append(i)
    out = []
    for name, rows in by_name.items():
        if rows[-1] - rows[0] + 1 == len(rows):  # contiguous: a slice, no gather
            out.append((name, slice(rows[0], rows[-1] + 1)))
        else:
            out.append((name, torch.tensor(rows, dtype=torch.long, device=device)))
    return tuple(out)


class LoraForward:
    """The instance ``forward`` of one PEFT ``lora.Linear``: input ``[..., in_features]`` ->
    ``[..., out_features]``, the base layer's output plus each step row's adapter delta.

    Args:
        layers: the model's :class:`LoraLayers` (holds the step's mapping per thread).
        module: the ``peft.tuners.lora.Linear`` it serves.
        is_output: the model's LM head (it reads the step's logits rows, not all rows).
    """

    def __init__(self, layers: "LoraLayers", module: torch.nn.Module, is_output: bool) -> None:
        self.layers = layers
        self.module = module
        self.is_output = is_output

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows = self.layers.current()
        module = self.module
        if rows is None or args or kwargs:  # outside an engine step: PEFT's own forward
            return type(module).forward(module, x, *args, **kwargs)
        result = module.base_layer(x)
        groups, expected = (
            (rows.logits_groups, rows.num_logits_rows) if self.is_output else (rows.groups, rows.num_rows)
        )
        if not groups:
            return result
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] != expected:
            raise RuntimeError(
                f"LoRA layer {type(module).__name__} got {x2.shape[0]} rows in a step of {expected}: the model "
                "calls it on a subset of the step's tokens (e.g. MoE experts), which per-row adapters cannot serve"
            )
        try:
            out2 = result.view(-1, result.shape[-1])
        except RuntimeError:  # not viewable as rows (an unusual base layer): work on a copy
            result = result.contiguous()
            out2 = result.view(-1, result.shape[-1])
        lora_a, lora_b, scaling = module.lora_A, module.lora_B, module.scaling
        for name, sel in groups:
            if name not in lora_a:  # this adapter does not target this layer (as in PEFT)
                continue
            a, b = lora_a[name], lora_b[name]
            xs = x2[sel].to(a.weight.dtype)
            delta = torch.nn.functional.linear(torch.nn.functional.linear(xs, a.weight), b.weight, b.bias)
            delta = (delta * scaling[name]).to(out2.dtype)
            if isinstance(sel, slice):
                out2[sel] += delta
            else:
                out2.index_add_(0, sel, delta)
        return result


class LoraLayers:
    """The LoRA-wrapped linears of one model with their instance forwards installed.

    Args:
        modules: the model's ``peft.tuners.lora.Linear`` modules (:func:`find_lora_layers`).
        output_module: the model's LM head (``get_output_embeddings()``), to tell it apart.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], output_module: Optional[torch.nn.Module]) -> None:
        self._steps: dict[int, AdapterRows] = {}  # thread id -> the step it is running
        self.forwards = [LoraForward(self, m, m is output_module) for m in modules]
        for f in self.forwards:
            f.module.__dict__["forward"] = f

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The LoRA layers served per row (empty after :meth:`restore`)."""
        return [f.module for f in self.forwards]

    def current(self) -> Optional[AdapterRows]:
        """The step the calling thread is running, or None."""
        return self._steps.get(threading.get_ident())

    @contextlib.contextmanager
    def step(self, rows: AdapterRows):
        """For the ``with`` block, the calling thread's LoRA layers serve ``rows``. Per thread, so
        engines sharing the model and driven from different threads do not see each other's steps."""
        thread = threading.get_ident()
        self._steps[thread] = rows
        try:
            yield
        finally:
            self._steps.pop(thread, None)

    def restore(self) -> None:
        """Remove the instance forwards installed here (idempotent)."""
        for f in self.forwards:
            if f.module.__dict__.get("forward") is f:
                del f.module.__dict__["forward"]
        self.forwards = []


def find_lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``peft.tuners.lora.Linear`` modules of ``model`` (the PEFT model's inner transformers
    model), after checking that per-row adapters can serve every adapter module in it.

    Raises:
        ValueError: a module the rows cannot serve, named with its path: a LoRA variant (DoRA,
            aLoRA, ...), LoRA on an embedding, a convolution or a parameter (``target_parameters``),
            merged adapter weights, ``modules_to_save`` / trainable tokens, another tuner type, or
            a LoRA layer someone else already wrapped.
    """
    if "peft" not in sys.modules:  # nothing imported peft: the model cannot hold its layers
        return []
    from peft.tuners.lora import layer as lora_layer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
    from transformers.pytorch_utils import Conv1D

    found = []
    for path, m in model.named_modules():
        if isinstance(m, AuxiliaryTrainingWrapper):
            raise ValueError(
                f"{path}: {type(m).__name__} (`modules_to_save` / `trainable_token_indices`) is not supported "
                "for per-request adapters; serve a merged model (merge_and_unload) instead"
            )
        if not isinstance(m, BaseTunerLayer):
            continue
        if type(m) is not lora_layer.Linear:
            kind = "LoRA on an embedding" if isinstance(m, lora_layer.Embedding) else type(m).__name__
            raise ValueError(
                f"{path}: {kind} is not supported for per-request adapters (only LoRA on nn.Linear layers)"
            )
        # A Conv1D base (GPT-2's transposed linear, PEFT's fan_in_fan_out) runs as its own module;
        # its LoRA A and B are plain linears all the same.
        if type(m.base_layer) not in (torch.nn.Linear, Conv1D):
            raise ValueError(
                f"{path}: LoRA over a {type(m.base_layer).__name__} (only over nn.Linear or Conv1D) is not supported"
            )
        if m.lora_variant:
            variants = ", ".join(f"{name}: {type(v).__name__}" for name, v in m.lora_variant.items())
            raise ValueError(
                f"{path}: LoRA variants ({variants}; e.g. use_dora=True) are not supported for per-request adapters"
            )
        if m.merged:
            raise ValueError(
                f"{path}: adapter weights are merged into the base weights ({', '.join(m.merged_adapters)}); "
                "call unmerge_adapter() first"
            )
        if "forward" in m.__dict__:
            raise ValueError(f"{path}: its forward is already wrapped (hooks or another engine's forward)")
        found.append(m)
    return found
