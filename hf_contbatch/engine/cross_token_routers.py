"""Mixture-of-experts blocks whose router mixes the tokens of one forward (Doge's CDMoE), run per request.

transformers' ``DogeCDMoE`` views its router logits ``[batch, tokens, 2 * keys]`` as ``[2, batch *
tokens, keys]``: the two halves of the product-key scores of row ``j`` come from tokens ``j // 2``
and ``(n + j) // 2`` of the forward's ``n`` (the modeling file says so: routing is not causal in a
full forward; with one token it is that token's own two halves). What a token is routed to thus
depends on the forward it is computed in. ``generate`` computes a prompt in one forward of the
prompt's length and every generated token in a forward of its own, so an engine step, whose rows
are many requests' chunks and decodes flattened together, would route them otherwise.

So such a block gets a per-instance forward that runs the model's own forward once per group of
rows ``generate`` would have computed together: a request's prompt (whole: the engine prefills
such a model's prompts in one step and keeps no prefix cache, :func:`whole_prompt_engine_config`),
and each generated token alone (a decode, a draft being verified, a token recomputed after
preemption). The step is the one whose K/V the decoder layer's attention stored right before on
this thread (``kernels.attention.peek_stored``); outside an engine step the model's forward runs as
it is. Installed by the first engine on the model and removed by the last one to close
(:func:`acquire_cross_token_routers`).
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

logger = logging.getLogger(__name__)

_USERS = "_hf_contbatch_cross_token_routers"  # model.__dict__ key: [their InstanceOverrides, engines using them]


def cross_token_router_modules(model) -> list[torch.nn.Module]:
    """The model's MoE blocks whose router mixes a forward's tokens: product-key routers with
    expert embeddings (``router_gate``, ``num_keys``, ``down_embed``, ``up_embed``: transformers'
    ``DogeCDMoE``)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "router_gate", None), torch.nn.Module)
        and isinstance(getattr(m, "num_keys", None), int)
        and isinstance(getattr(m, "down_embed", None), torch.nn.Embedding)
        and isinstance(getattr(m, "up_embed", None), torch.nn.Embedding)
    ]


def whole_prompt_engine_config(config: EngineConfig, model_type) -> EngineConfig:
    """``config`` as an engine serving a model with cross-token routers runs it: whole prefills
    (``SchedulerConfig.per_request_state``: a prompt's rows routed together need every one of them
    in the step; parallel samples run as independent requests), no prefix caching (a cached
    prefix was routed with another prompt's later tokens), no ``long_prefill_token_threshold``.
    Logs what it turned off."""
    sched, cache = config.scheduler, config.cache
    off = [name for name, on in (("prefix caching", cache.enable_prefix_caching),) if on]
    if sched.long_prefill_token_threshold is not None:
        off.append("long_prefill_token_threshold")
    if off:
        logger.info(
            "model type %r routes a forward's tokens together (%s): %s off; prompts are prefilled whole",
            model_type,
            "Doge's CDMoE",
            ", ".join(off),
        )
    return dataclasses.replace(
        config,
        cache=dataclasses.replace(cache, enable_prefix_caching=False),
        scheduler=dataclasses.replace(sched, per_request_state=True, long_prefill_token_threshold=None),
    )


def _row_groups(step: PagedCacheStep, module) -> list[tuple[int, int]]:
    """``(start, end)`` row ranges of the step's flattened tokens that ``generate`` computes in one
    forward: each metadata entry's prompt rows together, each of its generated rows alone.

    Raises:
        ValueError: a prompt's rows split across steps (one line; the engine prefills whole prompts).
    """
    meta = step.metadata
    groups = []
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        first = seq_len - (end - start)
        prompt_len = step.prompt_lens[i]
        prompt_end = min(end, start + max(prompt_len - first, 0))
        if prompt_end > start:
            if first != 0 or prompt_end - start != prompt_len:
                raise ValueError(
                    f"{type(module).__name__} routes a prompt's tokens together, but this step holds positions "
                    f"{first}..{first + prompt_end - start - 1} of a {prompt_len}-token prompt: not served by "
                    "hf_contbatch (raise max_num_batched_tokens)"
                )
            groups.append((start, prompt_end))
        groups.extend((r, r + 1) for r in range(prompt_end, end))
    return groups


class _PerRequestRows:
    """A cross-token router block's forward in an engine step: the model's own forward once per
    group of rows ``generate`` computes together (see the module docstring), the outputs put back
    in the step's row order; the model's forward unchanged anywhere else."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.original = type(module).forward.__get__(module)

    def __call__(self, hidden_states, *args, **kwargs):
        stored = peek_stored()
        step = stored[0] if stored is not None else None
        if (
            not isinstance(step, PagedCacheStep)
            or step.metadata is None
            or step.prompt_lens is None
            or hidden_states.dim() != 3
            or hidden_states.shape[0] != 1
            or hidden_states.shape[1] != step.metadata.slot_mapping.shape[0]
        ):
            return self.original(hidden_states, *args, **kwargs)
        groups = _row_groups(step, self.module)
        if len(groups) == 1:
            return self.original(hidden_states, *args, **kwargs)
        outs = [self.original(hidden_states[:, a:b], *args, **kwargs) for a, b in groups]
        if isinstance(outs[0], tuple):
            # DogeCDMoE returns (hidden states [1, n, D], router logits [2, n, keys]): tokens on dim 1 of both.
            return tuple(torch.cat(parts, dim=1) for parts in zip(*outs))
        return torch.cat(outs, dim=1)


def acquire_cross_token_routers(model) -> Optional[model_users.InstanceOverrides]:
    """The per-request forwards of the model's cross-token router blocks
    (``model_users.InstanceOverrides``), installed by the first engine on it and shared by the later
    ones; None for a model without such a block."""
    return model_users.acquire(
        model,
        _USERS,
        lambda: (
            model_users.InstanceOverrides(modules, "forward", _PerRequestRows)
            if (modules := cross_token_router_modules(model))
            else None
        ),
    )


def release_cross_token_routers(model) -> None:
    """One engine fewer on ``model``; the last one gives the blocks their own forward back."""
    model_users.release(model, _USERS)
