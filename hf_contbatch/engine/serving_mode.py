"""How an engine serves a model, decided in one place from what the model's layers do.

Most models run on the plain paged path (``ModelRunner``): every attention layer goes through the
paged KV cache and the scheduler may chunk prefills, cache prefixes and fork requests. Some models
need another runner or rules the scheduler must follow; each is detected by a capability check on
the model (its classes and their source), never by a list of model types:

- ``own_cache``: layers keeping their state in transformers' own cache-layer classes (DeepSeek V4);
  one ``DynamicCache`` per request (``OwnCacheModelRunner``), the recurrent rules below.
- ``recurrent``: layers with a per-request state beside the KV cache (Mamba, linear attention, short
  convolutions; ``RecurrentModelRunner``): whole prefills, no prefix caching, no forks, recompute.
- ``dense_context``: models computing attention in their own code over what ``cache.update``
  returns (Bloom, Falcon, GPT-Neo, MPT...; ``DenseContextRunner``): eager forward, no LoRA.
- ``paged``: everything else.

Independently of the runner, a router mixing a forward's tokens (Doge's CDMoE) asks for whole
prefills without prefix caching, and a dynamic mask (Doge) for no prefix caching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import EngineConfig
from .cross_token_routers import cross_token_router_modules, whole_prompt_engine_config
from .dense_runner import DenseContextRunner, dense_context_engine_config
from .dynamic_mask import dynamic_mask_modules, no_prefix_cache_engine_config
from .model_support import attends_through_cache_update, has_recurrent_layers, keeps_own_cache
from .own_cache_runner import OwnCacheModelRunner, own_cache_engine_config
from .pool_sizing import text_config
from .recurrent_runner import RecurrentModelRunner, recurrent_engine_config
from .runner import ModelRunner

_STATE_WHY = "a model with a state per request (recurrent layers, or layers keeping their own cache)"
_ROUTER_WHY = "a model whose router mixes tokens"


@dataclass(frozen=True)
class ServingMode:
    """What :func:`serving_mode` decided for one model and config.

    Attributes:
        name: "paged", "recurrent", "own_cache" or "dense_context".
        config: the ``EngineConfig`` as the engine runs the model (the user's, with what the mode
            turns off turned off; each change is logged where it is made).
        runner_class: the ``ModelRunner`` class that executes the steps.
        profile_runner_class: the runner class of the pool-sizing probe forward (one that needs no
            per-request state slots: ``ModelRunner`` for the stateful modes).
        whole_prefill_why: what makes prompts prefill whole, for the refusal of a prompt longer than
            a step's token budget; None where prefills may be chunked.
        drafts_served: whether prompt-lookup drafts are served (not with per-request state).
    """

    name: str
    config: EngineConfig
    runner_class: type
    profile_runner_class: type
    whole_prefill_why: Optional[str]
    drafts_served: bool

    @property
    def stateful(self) -> bool:
        """Whether each running request holds a state slot (recurrent layers or its own cache)."""
        return self.name in ("recurrent", "own_cache")

    def build_runner(self, *runner_args):
        """The step runner: ``runner_class(*runner_args)``, with one state slot per schedulable
        sequence for the stateful modes (``runner_args`` as ``ModelRunner``'s)."""
        if self.stateful:
            return self.runner_class(*runner_args, num_state_slots=self.config.scheduler.max_num_seqs)
        return self.runner_class(*runner_args)


def serving_mode(model, config: EngineConfig, has_adapters: bool = False) -> ServingMode:
    """Decide how an engine serves ``model`` (the inner model of a PEFT model) under ``config``.

    Raises:
        ValueError: a setting the model's mode cannot serve (one line naming it and the model
            type): e.g. ``compile_model=True`` or prompt-lookup drafts for a stateful model, a KV
            cache dtype for one keeping its own cache, per-request LoRA adapters
            (``has_adapters``) for one computing attention in its own code.
    """
    model_type = getattr(text_config(model), "model_type", None)
    cfg = config
    if keeps_own_cache(model):
        name, runner_class = "own_cache", OwnCacheModelRunner
        cfg = own_cache_engine_config(cfg, model_type)
    elif has_recurrent_layers(model):
        name, runner_class = "recurrent", RecurrentModelRunner
        cfg = recurrent_engine_config(cfg, model_type)
    elif attends_through_cache_update(model):
        name, runner_class = "dense_context", DenseContextRunner
    else:
        name, runner_class = "paged", ModelRunner
    stateful = name in ("recurrent", "own_cache")
    cross_token = bool(cross_token_router_modules(model))
    if cross_token:
        cfg = whole_prompt_engine_config(cfg, model_type)
    if dynamic_mask_modules(model):
        cfg = no_prefix_cache_engine_config(cfg, model_type)
    if name == "dense_context":
        if has_adapters:
            raise ValueError(
                f"model type {model_type!r} computes attention in its own code: per-request LoRA adapters "
                "are not served for it"
            )
        cfg = dense_context_engine_config(cfg, model_type)
    return ServingMode(
        name=name,
        config=cfg,
        runner_class=runner_class,
        profile_runner_class=DenseContextRunner if name == "dense_context" else ModelRunner,
        whole_prefill_why=_STATE_WHY if stateful else _ROUTER_WHY if cross_token else None,
        drafts_served=not stateful,
    )
