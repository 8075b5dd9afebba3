"""Sparse attention's indexer (DeepSeek V3.2's DSA, GLM-MoE-DSA, A.X K2, HY V4) run per request.

transformers' indexer scores every cached indexer key for each query, adds the causal mask and
keeps the ``index_topk`` best (``Tensor.topk``). Where several keys score the same at the cut (a key
every indexer head scores below zero scores exactly 0 after the ReLU), which of them ``topk`` keeps
depends on the whole row it is given: its length and where the masked entries lie. ``generate``'s
rows are one request's: a prompt token's row is the prompt long (later positions masked), a
generated token's is its context long. The engine's flattened step would give a row over every
request's context, so a tie could be cut differently, and a different key attended.

So an engine step calls each indexer once per request and kind of row, with the rows ``generate``
would have built: the request's prompt rows in this step together over a row of the prompt's length
(the keys not yet stored and the later positions masked), each generated token's row alone over its
context (a request recomputed after preemption, or a draft being verified, has such rows in a
prefill). Each call runs the model's own indexer forward on those rows (so the scores and the
``topk`` are transformers' code), with a cache whose ``update_indexer`` stores the rows' indexer keys
in the layer's pool (``PagedCacheStep.update_indexer``) and returns the request's stored keys padded to
the row's length. The picks, positions in the request's context, become positions in the step's
flattened contexts (``torch_paged.context_slots``' layout), which the attention call reads
(``PagedCacheStep.attend``'s ``selected``). Outside an engine step (no ``PagedCacheStep`` with the
prompt lengths) the model's own forward runs as it is.

The forward is per module instance (``module.__dict__["forward"]``), installed by the first engine
on the model and removed by the last one to close (:func:`acquire_sparse_indexers`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.paged_cache import PagedCacheStep
from . import model_users

_USERS = "_hf_contbatch_sparse_indexers"  # model.__dict__ key: [their InstanceOverrides, engines using them]


def _indexer_modules(model) -> list[torch.nn.Module]:
    """The model's sparse-attention indexers: modules with an integer ``index_topk`` and a
    ``weights_proj`` (the per-head weights of their scores), as transformers' DSA families build them."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "index_topk", None), int)
        and isinstance(getattr(m, "weights_proj", None), torch.nn.Module)
    ]


class _RequestIndexerCache:
    """The cache one per-request indexer call gets: ``update_indexer`` stores the call's rows'
    indexer keys and returns the request's stored keys ``[1, length, D]``, zeros past what is stored
    (masked by the call's mask)."""

    def __init__(self, step: PagedCacheStep, request: int, rows: torch.Tensor, stored: int, length: int) -> None:
        self.step, self.request, self.rows, self.stored, self.length = step, request, rows, stored, length

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.step.request_indexer_keys(key_states, layer_idx, self.request, self.rows, self.stored, self.length)


class _PerRequestForward:
    """An indexer's forward in an engine step: the model's own forward once per request and kind of
    row (see the module docstring); the model's forward unchanged anywhere else."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.original = type(module).forward.__get__(module)

    def __call__(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, PagedCacheStep) or cache.metadata is None or cache.prompt_lens is None:
            return self.original(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, **kwargs)
        meta = cache.metadata
        device = hidden_states.device
        cos, sin = position_embeddings
        picks: list[tuple[int, torch.Tensor]] = []  # (first row, [rows, k] flattened-context positions)
        context_start = 0
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            first_position = seq_len - (end - start)
            prompt_len = cache.prompt_lens[i]
            # Prompt rows together over a prompt-long row; each generated token's row alone over its context.
            calls = []
            prompt_end = min(end, start + max(prompt_len - first_position, 0))
            if prompt_end > start:
                calls.append((start, prompt_end, prompt_len))
            calls.extend((r, r + 1, first_position + (r - start) + 1) for r in range(prompt_end, end))
            for a, b, length in calls:
                positions = torch.arange(first_position + (a - start), first_position + (b - start), device=device)
                mask = torch.arange(length, device=device).unsqueeze(0) <= positions.unsqueeze(1)  # [rows, length]
                step_cache = _RequestIndexerCache(
                    cache, i, torch.arange(a, b, device=device), int(positions[-1]) + 1, length
                )
                top = self.original(
                    hidden_states[:, a:b],
                    q_resid[:, a:b],
                    (cos[:, a:b], sin[:, a:b]),
                    mask.unsqueeze(0),
                    None if position_ids is None else position_ids[:, a:b],
                    cache=step_cache,
                )[0].long()  # [rows, k]
                # A pick past the row's own position is a masked key ``topk`` took for want of enough
                # visible ones: replaced by the row's best pick (visible, already picked).
                top = torch.where(top <= positions.unsqueeze(1), top, top[:, :1])
                picks.append((a, top + context_start))
            context_start += seq_len
        width = max(p.shape[1] for _, p in picks)
        out = torch.empty((1, hidden_states.shape[1], width), dtype=torch.int32, device=device)
        for a, p in picks:
            if p.shape[1] < width:  # fewer keys than the widest call's top-k: repeat the best one
                p = torch.cat([p, p[:, :1].expand(-1, width - p.shape[1])], dim=1)
            out[0, a : a + p.shape[0]] = p.to(torch.int32)
        return out


def acquire_sparse_indexers(model) -> Optional[model_users.InstanceOverrides]:
    """The per-request forwards of the model's indexers (``model_users.InstanceOverrides``),
    installed by the first engine on it and shared by the later ones; None for a model without a
    sparse-attention indexer."""
    return model_users.acquire(
        model,
        _USERS,
        lambda: (
            model_users.InstanceOverrides(modules, "forward", _PerRequestForward)
            if (modules := _indexer_modules(model))
            else None
        ),
    )


def release_sparse_indexers(model) -> None:
    """One engine fewer on ``model``; the last one gives the indexers their own forward back."""
    model_users.release(model, _USERS)
