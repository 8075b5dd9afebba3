"""Dynamic mask attention (Doge) in an engine step: the per-key bias cached beside the keys.

transformers' ``DogeAttention`` computes, after ``cache.update``, a bias per key and KV head from
that key's value (``dt_states = exp(A * softplus(dt_proj(V)))``) and hands it to its
``prepare_dynamic_mask``, which adds it to the causal mask and, over a row longer than
``keep_window_size``, keeps only the ``keep_window_size`` keys of largest bias (``torch.topk``).
In ``generate`` the bias of every cached key is recomputed from the cached values each step; in an
engine step the cache's ``update`` returns only the step's own K/V, so the model computes the
biases of the step's tokens only. Each is a function of its own key's value, so it is stored once,
beside the key (a pool of the layer: ``KVLayerShape.key_bias_heads``), and read back with the
context.

So each such module gets a per-instance ``prepare_dynamic_mask``: in an engine step it stores the
step's biases in the layer's pool (``PagedCacheStep.store_key_bias``) and returns the step's stand-in
for the dense mask, which the attention function recognizes; attention then applies the bias and
the top-k per request over its own context, with the rows ``generate`` builds
(``torch_paged.key_biased_attention``). Outside an engine step (no K/V stored right before on this
thread) the model's own method runs. Installed by the first engine on the model and removed by the
last one to close (:func:`acquire_dynamic_masks`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from ..config import EngineConfig
from ..kernels.attention import peek_stored
from ..kernels.paged_cache import PagedCacheStep
from . import model_users

_USERS = "_hf_contbatch_dynamic_masks"  # model.__dict__ key: [their InstanceOverrides, engines using them]

logger = logging.getLogger(__name__)


def dynamic_mask_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules with a dynamic mask: a ``prepare_dynamic_mask`` method on their
    class (transformers' Doge), in module order."""
    return [m for m in model.modules() if callable(getattr(type(m), "prepare_dynamic_mask", None))]


def no_prefix_cache_engine_config(config: EngineConfig, model_type) -> EngineConfig:
    """``config`` with prefix caching off, as an engine serving a dynamic mask runs it. Where biases
    tie at the top-k's cut, which keys ``torch.topk`` keeps in a prompt row depends on the row's
    length, the prompt's: ``generate``'s hidden states at a prefix's positions, and so the next
    layers' K/V there, depend on the whole prompt, and K/V cached from a prompt of another length
    are not the ones ``generate`` computes. Logs when it turned prefix caching off."""
    if not config.cache.enable_prefix_caching:
        return config
    logger.info(
        "model type %r has dynamic mask attention (a prefix's K/V depend on the prompt's length "
        "where biases tie): prefix caching off",
        model_type,
    )
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False))


def key_bias_heads(module) -> int:
    """Channels of the per-key bias ``module`` computes (its ``dt_proj``'s outputs: one per KV
    head in Doge), 0 where it has no such projection (then the pool cannot be sized)."""
    proj = getattr(module, "dt_proj", None)
    return int(getattr(proj, "out_features", 0) or 0)


class _StoredBiasMask:
    """A module's ``prepare_dynamic_mask`` in an engine step: the step's biases stored in the layer's
    pool, the step's stand-in returned; the model's own method anywhere else."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.original = type(module).prepare_dynamic_mask.__get__(module)

    def __call__(self, hidden_states, dt_states, keep_window_size: int = 2048, attention_mask=None):
        stored = peek_stored()
        if (
            stored is None
            or not isinstance(stored[0], PagedCacheStep)
            or stored[0].metadata is None
            or stored[1] != getattr(self.module, "layer_idx", None)
            or dt_states.dim() != 3
            or dt_states.shape[-1] != stored[3].shape[2]
        ):
            # Not right after this layer's update in an engine step: the user's own forward.
            return self.original(hidden_states, dt_states, keep_window_size, attention_mask)
        return stored[0].store_key_bias(stored[1], dt_states, keep_window_size)


def acquire_dynamic_masks(model) -> Optional[model_users.InstanceOverrides]:
    """The stored-bias ``prepare_dynamic_mask`` of the model's modules
    (``model_users.InstanceOverrides``), installed by the first engine on it and shared by the later
    ones; None for a model without dynamic mask attention."""
    return model_users.acquire(
        model,
        _USERS,
        lambda: (
            model_users.InstanceOverrides(modules, "prepare_dynamic_mask", _StoredBiasMask)
            if (modules := dynamic_mask_modules(model))
            else None
        ),
    )


def release_dynamic_masks(model) -> None:
    """One engine fewer on ``model``; the last one gives the modules their own method back."""
    model_users.release(model, _USERS)
