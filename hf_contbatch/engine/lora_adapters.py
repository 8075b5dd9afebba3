"""The LoRA adapters of a served ``peft.PeftModel``: which exist, which one a request runs, and the
per-row LoRA forwards shared by the engines that serve the model.

A ``PeftModel`` with adapters loaded (``load_adapter(path, adapter_name=...)``) is served as its
inner transformers model (so the runner keeps ``logits_to_keep`` and the packed linears), with every
LoRA layer adding its adapter per row (``hf_contbatch.kernels.lora``). A request names its adapter
in ``SamplingParams.adapter_name`` (PEFT's ``adapter_names`` entry, ``"__base__"`` for the base
model); :meth:`LoraAdapters.resolve` turns that into the adapter that runs at build time, so a
later ``set_adapter`` does not change requests already queued.
"""

from __future__ import annotations

import sys
from typing import Optional

from ..kernels.lora import LoraLayers, find_lora_layers
from ..request import BASE_ADAPTER

_LORA_USERS = "_hf_contbatch_lora"  # on the inner model: its LoraLayers and the open engines


def is_peft_model(model) -> bool:
    """True for a ``peft.PeftModel`` (without importing peft when nothing did)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


class LoraAdapters:
    """The adapters of one ``peft.PeftModel`` an engine serves.

    Args:
        peft_model: the ``PeftModel``; every adapter in ``peft_config`` must be a LoRA adapter.

    Attributes:
        names: the adapters loaded when the engine started (the ones it serves), in load order.

    Raises:
        ValueError: a prompt-learning or other non-LoRA adapter, named with its type.
    """

    def __init__(self, peft_model) -> None:
        self.peft_model = peft_model
        for name, cfg in peft_model.peft_config.items():
            kind = getattr(cfg.peft_type, "value", cfg.peft_type)
            if kind != "LORA":
                raise ValueError(
                    f"adapter {name!r} is a {kind} adapter; hf_contbatch serves LoRA adapters only (peft_type LORA)"
                )
        self.names = tuple(peft_model.peft_config)
        # One LoRA layer, read for the enabled state (``disable_adapter()`` switches every layer).
        self._probe = next((m for m in self.model.modules() if hasattr(m, "lora_A")), None)

    @property
    def model(self):
        """The inner transformers model (what the engine runs, with the LoRA layers in it)."""
        return self.peft_model.get_base_model()

    def resolve(self, adapter_name: Optional[str]) -> Optional[str]:
        """The adapter a request with ``SamplingParams.adapter_name`` runs (None: the base model).

        None takes the model's active adapter as its own ``generate`` would (the base model inside
        ``disable_adapter()``).

        Raises:
            ValueError: an unknown name (the message lists the loaded adapters), one loaded after the
                engine started, or None while several adapters are active at once.
        """
        if adapter_name is None:
            if self._probe is not None and self._probe.disable_adapters:
                return None
            active = list(self.peft_model.active_adapters)
            if len(active) != 1:
                raise ValueError(
                    f"the model has {len(active)} active adapters ({', '.join(active)}); pass `adapter_names` "
                    f"to choose one per prompt from {self._allowed()}"
                )
            adapter_name = active[0]
        if adapter_name == BASE_ADAPTER:
            return None
        if not isinstance(adapter_name, str):
            raise ValueError(f"`adapter_names` entries must be strings, got {adapter_name!r}")
        if adapter_name not in self.names:
            later = adapter_name in self.peft_model.peft_config
            raise ValueError(
                f"unknown adapter {adapter_name!r}"
                + (" (loaded after this engine started: create a new pipeline to serve it)" if later else "")
                + f"; `adapter_names` entries must be one of {self._allowed()}"
            )
        return adapter_name

    def _allowed(self) -> str:
        return ", ".join(repr(n) for n in (*self.names, BASE_ADAPTER))


def resolve_without_adapters(adapter_name: Optional[str]) -> None:
    """``LoraAdapters.resolve`` for a model without adapters: only the base model.

    Raises:
        ValueError: any other adapter name.
    """
    if adapter_name not in (None, BASE_ADAPTER):
        raise ValueError(
            f"unknown adapter {adapter_name!r}: the model has no LoRA adapters (serve a peft.PeftModel with "
            f"adapters loaded); `adapter_names` entries must be {BASE_ADAPTER!r}"
        )


def acquire_lora_layers(model) -> Optional[LoraLayers]:
    """The per-row LoRA forwards of ``model`` (the inner model), installed by the first engine that
    serves it and shared by the others (the count lives on the model: no globals). None when the
    model has no LoRA layers. Raises ``ValueError`` as ``find_lora_layers``, with nothing installed."""
    users = model.__dict__.get(_LORA_USERS)
    if users is None:
        modules = find_lora_layers(model)
        if not modules:
            return None
        users = model.__dict__[_LORA_USERS] = {"layers": LoraLayers(modules, model.get_output_embeddings()), "open": 0}
    users["open"] += 1
    return users["layers"]


def release_lora_layers(model) -> None:
    """One engine fewer on ``model``; the last one removes the LoRA forwards (never raises)."""
    users = model.__dict__.get(_LORA_USERS)
    if users is None:
        return
    users["open"] -= 1
    if users["open"] <= 0:
        model.__dict__.pop(_LORA_USERS, None)
        users["layers"].restore()
