"""The model runner of models whose layers keep their state in a cache layer class of their own
(``engine.kv_groups.own_cache_kinds``: DeepSeek V4's compressed attention).

DeepSeek V4's compressed layers append to the keys, after ``cache.update``, entries their
compressor pooled from every ``compress_rate`` tokens, with a mask over them (causality, and for
the sparse kind the top-k its indexer picks per query); the compressor keeps, per request, a partial
window of projections, the previous window's overlap half and the growing list of entries, through
methods of transformers' own cache layer class for the kind (``store_compression_weights``,
``update_overlap_state``, ``update_compressor_states`` on ``cache.layers[i]``). None of that is K/V
the paged pool stores, so each request keeps that cache itself: a ``transformers.DynamicCache``
built from the model's config (which builds the kind's own layer class), and its forwards run one
request at a time, each a shape ``generate`` runs, attention by the model's own function (no
``paged_cache`` reaches it) over what that cache returns:

- a prefill alone, ``[1, T]`` from position 0, on a new cache;
- a decode alone, ``[1, 1]``, on the request's cache;
- a request resuming a prefill it could not run whole (a recomputed request past the step's token
  budget) as one-token forwards, the path ``generate`` took for those tokens.

The rest is ``engine.recurrent_runner``'s: the engine configuration (whole prefills, no prefix
caching, no drafts, preemption by recompute: a preempted request's cache is dropped, and it is
recomputed from its tokens), the check that a row starts where its request's cache ends, and a
step whose forwards all succeeded before any cache changes: each forward works on a copy of the
request's cache layers (new tensors replace the layers' tensors as they grow, never written in
place, so the copy shares them), kept only when the whole step ran.

The blocks the scheduler hands out still count each request's tokens (admission, preemption and
the pool's fit), over a pool of one channel per layer (``engine.kv_groups.layer_kv_shapes``); the
caches' memory is the requests' own, as it is under ``generate``.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ..config import EngineConfig
from ..core.plan import RunnerOutput, ScheduledRequest, StepPlan
from .recurrent_runner import RecurrentModelRunner, recurrent_engine_config
from .runner import StepInputs

__all__ = ["OwnCacheModelRunner", "own_cache_engine_config"]


def own_cache_engine_config(config: EngineConfig, model_type) -> EngineConfig:
    """``config`` as an engine serving a model whose requests keep their own caches runs it: the
    recurrent models' rules (``recurrent_engine_config``: no prefix caching, whole prefills, no
    forks, recompute).

    Raises:
        ValueError: ``CacheConfig.dtype`` set (an int8 or other KV cache dtype would change nothing:
            the K/V live in transformers' cache, in the model's dtype), prompt-lookup drafts or
            ``compile_model=True`` (one line).
    """
    if config.cache.dtype is not None:
        raise ValueError(
            f"model type {model_type!r} has layers keeping their own cache: a KV cache dtype "
            f"(CacheConfig.dtype={config.cache.dtype!r}) is not served for it (its K/V stay in transformers' cache, "
            "in the model's dtype); leave it None"
        )
    return recurrent_engine_config(config, model_type, what="layers keeping their own cache")


class OwnCacheModelRunner(RecurrentModelRunner):
    """``RecurrentModelRunner`` for a model whose layers keep their state in transformers' own cache
    (see the module docstring): one ``DynamicCache`` per running request, one forward per request.

    Args:
        *args, **kwargs: as ``RecurrentModelRunner``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._caches: dict[int, object] = {}  # request id -> its DynamicCache, as the last whole step left it
        self._pending: dict[int, object] = {}  # this step's forwards' caches, kept when the step ran

    def _apply_slots(self, plan: StepPlan) -> None:
        """As ``RecurrentModelRunner._apply_slots``; a request leaving the batch drops its cache."""
        super()._apply_slots(plan)
        for rid in (*plan.finished_ids, *plan.preempted_ids):
            self._caches.pop(rid, None)

    def _parts(self, plan: StepPlan) -> list[tuple[list[ScheduledRequest], bool]]:
        """``RecurrentModelRunner._parts`` with the decodes run one request per forward (each
        request's compressor is at its own point of its window)."""
        parts: list[tuple[list[ScheduledRequest], bool]] = []
        for rows, previous in super()._parts(plan):
            parts.extend(([row], previous) for row in rows)
        return parts

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """As ``RecurrentModelRunner.execute``; the requests' caches change only when every forward
        of the step succeeded."""
        self._pending = {}
        try:
            output = super().execute(plan)
            self._caches.update(self._pending)
        finally:
            self._pending = {}
        return output

    def release(self) -> None:
        """Drop every request's cache (``close()``)."""
        self._caches.clear()
        self.states.release()

    def _forward(self, plan: StepPlan, inputs: StepInputs) -> torch.Tensor:
        """One request's forward (``plan`` holds its one row) on a copy of its cache (a new one for
        a prefill from position 0): the logits of the rows the LM head reads."""
        (row,) = plan.scheduled
        rid = row.request_id
        if row.start_position == 0:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
        else:
            cache = _copied(self._pending[rid] if rid in self._pending else self._caches[rid])
        self._pending[rid] = cache
        kwargs = {
            "input_ids": inputs.input_ids.unsqueeze(0),
            "position_ids": inputs.positions.unsqueeze(0),
            self._cache_arg: cache,
            "use_cache": True,
        }
        rows = inputs.logits_index
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        rotary = (
            contextlib.nullcontext() if self.rotary_variants is None else self.rotary_variants.step(plan, self.batch)
        )
        with self._linears_step(), self._lora_step(inputs), rotary:
            logits = self.model(**kwargs).logits[0]
        return logits if self._supports_logits_to_keep else logits.index_select(0, rows)


def _copied(cache):
    """A copy of ``cache`` (a ``DynamicCache``) whose layers a forward may update without changing
    ``cache``'s: each layer copied with its dicts and lists of state (the compressor's per-name
    buffers), the tensors shared (the layers replace them as they grow, they never write them in
    place)."""
    new = copy.copy(cache)
    new.layers = [_copied_layer(layer) for layer in cache.layers]
    return new


def _copied_layer(layer):
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, (dict, list)):
            setattr(new, name, copy.copy(value))
    return new
