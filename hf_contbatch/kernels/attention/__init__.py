"""Attention that reads the paged KV cache, plugged in through ``transformers.AttentionInterface``.

The registered function is stateless: the step's cache view, holding the step's metadata, travels in
the forward's keyword arguments (``paged_cache``), so any number of engines can share one
registration. Called without it (the user's own ``model.generate`` while an engine serves the
model), it runs the model's previous implementation.

Under a compiled forward (``EngineConfig.compile_model``, ``hf_contbatch.kernels.compiled_forward``) the
function instead calls one opaque custom op, ``torch.ops.hf_contbatch.paged_attention``, that stores
the step's K/V and attends: torch.compile then fuses everything around it without tracing the
pool, the block tables or the step's Python-side metadata (which change every step and would force
a recompile). The step's view reaches the op as an argument too: wrapped in a :class:`CompiledStep`,
an opaque reference object to torch.compile (a graph input it neither traces nor guards on), passed
by the runner in the forward's keyword arguments like the eager view. No registry: two engines'
steps can never meet, and the op reads nothing but its arguments.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import threading
from typing import Optional

import torch

from .backends import resolve_backend_name

# The prefix of our registered names; no "sdpa"/"flash"/"flex" in it: transformers substring-checks names.
ATTENTION_NAME = "hf_contbatch_paged"


def resolve_backend(requested: str, device: torch.device, **shape) -> str:
    """The backend name "torch" or "triton" for ``device`` (see ``backends.resolve_backend_name``);
    an engine takes its backend object from ``backends.select_backend``."""
    return resolve_backend_name(requested, device, **shape)


def paged_attention_name(previous: Optional[str]) -> str:
    """The registered name of our attention over a model whose own implementation is ``previous``
    ("sdpa", "eager", ...). One name per previous implementation, so the function and the mask
    builder registered under it know which implementation to run outside an engine step, with no
    state of ours beyond transformers' registries. Hex digits only after the prefix: transformers
    substring-checks names for "sdpa", "flash" and "flex"."""
    digest = hashlib.sha1((previous or "eager").encode()).hexdigest()[:8]
    return f"{ATTENTION_NAME}_{digest}"


def is_paged_attention(name: Optional[str]) -> bool:
    """Whether ``name`` (a config's ``_attn_implementation``) is one of ours."""
    return bool(name) and name.startswith(ATTENTION_NAME)


def _previous_attention(module: torch.nn.Module, previous: Optional[str]):
    """The attention function ``module`` ran before the switch: ``previous`` from transformers'
    ``ALL_ATTENTION_FUNCTIONS``, else (``"eager"``) the model module's own ``eager_attention_forward``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if previous and previous in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[previous]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(
            f"attention implementation {previous!r} of {type(module).__name__} cannot run outside an hf_contbatch "
            "engine step while an engine serves the model; close the engine first"
        )
    return eager


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    *,
    previous_implementation: Optional[str] = None,
    **kwargs,
):
    """The ``AttentionInterface`` entry: ``query`` ``[1, H, T, D]`` -> ``([1, T, H, D], None)``.

    Inside an engine step ``paged_cache`` (a keyword argument the runner passes to the forward) is
    the step's cache view (``PagedKVCache.for_step``), or under a compiled forward that view
    wrapped in a :class:`CompiledStep`: ``key``/``value`` are this step's rows, already stored by the view's ``update``
    (under a compiled forward the op stores them) and the context is read from the pool. Without
    ``paged_cache`` (the user's own ``model.generate`` or forward while an engine serves the model)
    the model's previous implementation runs with the arguments as given.
    """
    paged_cache = kwargs.pop("paged_cache", None)
    # Under a compiled forward nothing calls ``update`` (the op stores), and the record is not traced.
    # Peeked, not taken: a layer may attend more than once over what it stored (DiffLlama: once per half of V).
    stored = None if isinstance(paged_cache, CompiledStep) else getattr(_STORED, "record", None)
    if (
        paged_cache is None
        and stored is not None
        and stored[1] == getattr(module, "layer_idx", None)
        and stored[2] is key
    ):
        paged_cache = stored[0]  # a decoder layer that does not pass the forward's kwargs on (Nemotron)
    if paged_cache is None:
        fn = _previous_attention(module, previous_implementation)
        if kwargs.get("indices") is not None and attention_mask is not None:
            # A sparse-attention indexer's top-k (DeepSeek V3.2's DSA): the model folds it into the
            # mask only for "eager"/"sdpa", and the model's implementation is this one while an
            # engine serves it, so fold it here as the model would have.
            attention_mask = _fold_selection(attention_mask, kwargs["indices"], query.dtype)
        return fn(module, query, key, value, attention_mask, **kwargs)
    compiled = isinstance(paged_cache, CompiledStep)
    layer, head_maps = _check_served_call(module, key, value, attention_mask, stored, kwargs, paged_cache, compiled)
    scaling, sliding_window, softcap = kwargs.get("scaling"), kwargs.get("sliding_window"), kwargs.get("softcap")
    if "sliding_window" not in kwargs:
        sliding_window = _mask_only_window(module)
    chunk_size = _layer_chunk_size(module)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(paged_cache, CompiledStep):
        # Compiled forward: the model was called without a real cache, so store and attend in one
        # op, which gets the step's view as an opaque argument (reading the view here would trace
        # its metadata into the graph).
        out = torch.ops.hf_contbatch.paged_attention(
            query,
            key,
            value,
            paged_cache,
            module.layer_idx,
            float(scale),
            -1 if sliding_window is None else int(sliding_window),
            0.0 if softcap is None else float(softcap),
            chunk_size or 0,
        )
        return out, None
    tuning = _temperature_tuning(module)
    if tuning is not None:
        query = _retuned_query(query, paged_cache.metadata.to(query.device), *tuning)
    sinks = kwargs.get("s_aux")
    if sinks is None and kwargs.get("sinks") is not None:
        # Per-query sinks (Inkling 2: [1, H, T, 1], from each token's hidden state) as [T, H].
        sinks = kwargs["sinks"][0, :, :, 0].transpose(0, 1)
    # A sparse-attention indexer's top-k (DeepSeek V3.2's DSA), passed by its model as ``indices``.
    selected = kwargs.get("indices") if attention_mask is not None else None
    # A per-key bias the layer stored this step (Doge's dynamic mask), its stand-in as the mask.
    key_bias = paged_cache.key_bias_call(layer, attention_mask)
    out = paged_cache.attend(
        layer,
        query,
        key,
        value,
        scale,
        sliding_window,
        softcap,
        sinks,
        chunk_size,
        head_maps,
        selected=selected,
        key_bias=key_bias,
        position_bias=kwargs.get("position_bias"),
    )
    return out, None


def _fold_selection(attention_mask: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``attention_mask`` ``[B, 1, S, T]`` (bool: True attends; float: added) restricted to the keys
    ``indices`` ``[B, S, k]`` picks for each query, as transformers' DSA attention modules fold their
    indexer's top-k into the mask for the eager and SDPA paths."""
    b, _, s, t = attention_mask.shape
    unpicked = torch.ones((b, s, t), dtype=torch.bool, device=attention_mask.device)
    unpicked = unpicked.scatter(-1, indices.to(attention_mask.device, torch.long), False).unsqueeze(1)
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~unpicked
    return attention_mask.masked_fill(unpicked, torch.finfo(dtype).min)


# --- what an engine step's attention call must look like ------------------------------------------
# The last K/V a step's ``update`` stored on this thread: (step, layer_idx, the key and value it
# returned). Held, not weakly referenced: a model may drop the tensors ``update`` returned once it
# has picked heads from them (JetMoE), and the check needs them; they are one layer's rows of one
# step, let go at the next ``update`` and when the step's forward ends (``PagedCacheStep.end``).
# Thread-local, so a user's own ``generate`` on another thread never sees it.
# Read by the attention calls that follow, for three things: the step, where a decoder layer drops the
# forward's keyword arguments (``paged_cache``) instead of passing them to its attention module;
# whether the K/V reaching attention are the ones stored (the kernels read the pool, not the
# arguments) or heads picked from them; and which layer's pool holds them (HRM's recurrent cycles
# run one module as several cache layers).
_STORED = threading.local()


def note_stored(step, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Record that ``step`` stored ``key``/``value`` for ``layer_idx`` on this thread (``PagedCacheStep.update``)."""
    _STORED.record = (step, layer_idx, key, value)


def peek_stored():
    """The record :func:`note_stored` left on this thread, kept: ``(step, layer_idx, key, value)``
    or None."""
    return getattr(_STORED, "record", None)


def take_stored():
    """The record :func:`note_stored` left on this thread (then forgotten), or None."""
    record = getattr(_STORED, "record", None)
    _STORED.record = None
    return record


def _mask_only_window(module) -> Optional[int]:
    """The sliding window of a layer whose model applies it through its mask alone (PhiMoE builds a
    sliding-window mask from ``config.sliding_window`` and passes no ``sliding_window`` to attention):
    an engine step builds no mask, so the kernels must be told. None for a full-attention layer.
    Read from the config once per module and kept in its ``__dict__`` (a config lookup of a missing
    attribute costs about 15 us, per layer and step)."""
    window = module.__dict__.get("_hf_contbatch_mask_window")
    if window is None:
        cfg = getattr(module, "config", None)
        window = getattr(cfg, "sliding_window", None) or 0
        if getattr(cfg, "use_sliding_window", True) is False:
            window = 0
        kinds = getattr(cfg, "layer_types", None)
        if isinstance(kinds, (list, tuple)) and kinds[module.layer_idx] != "sliding_attention":
            window = 0
        window = int(window)
        if not torch.compiler.is_compiling():  # a traced forward reads the config (guards), never writes
            module.__dict__["_hf_contbatch_mask_window"] = window
    return window or None


def _layer_chunk_size(module) -> Optional[int]:
    """The chunk of a chunked local attention layer (Llama 4: ``config.layer_types[i]`` is
    ``"chunked_attention"``, and transformers masks such a layer with ``config.attention_chunk_size``
    through its mask alone, passing attention no argument for it), None for any other layer. Read
    once per module and kept in its ``__dict__``, as :func:`_mask_only_window` does."""
    chunk = module.__dict__.get("_hf_contbatch_chunk_size")
    if chunk is None:
        cfg = getattr(module, "config", None)
        kinds = getattr(cfg, "layer_types", None)
        chunk = 0
        idx = getattr(module, "layer_idx", None)
        if (
            isinstance(kinds, (list, tuple))
            and isinstance(idx, int)
            and idx < len(kinds)
            and kinds[idx] == "chunked_attention"
        ):
            chunk = int(getattr(cfg, "attention_chunk_size", None) or 0)
        if not torch.compiler.is_compiling():
            module.__dict__["_hf_contbatch_chunk_size"] = chunk
    return chunk or None


def _temperature_tuning(module) -> Optional[tuple]:
    """``(floor_scale, attn_scale)`` of a layer that scales its queries by position before
    attention (Llama 4's NoPE layers with ``attn_temperature_tuning``), None for any other layer.
    Kept in the module's ``__dict__`` (a missing attribute costs a module ``__getattr__`` per call)."""
    tuning = module.__dict__.get("_hf_contbatch_tuning", False)
    if tuning is False:
        tuning = None
        if module.__dict__.get("attn_temperature_tuning") and not module.__dict__.get("use_rope", True):
            tuning = (module.floor_scale, module.attn_scale)
        if not torch.compiler.is_compiling():
            module.__dict__["_hf_contbatch_tuning"] = tuning
    return tuning


def _tuned_scale(positions: torch.Tensor, floor_scale, attn_scale) -> torch.Tensor:
    # Llama4TextAttention's formula, term for term (so a scale of 1 stays exactly 1).
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _retuned_query(query: torch.Tensor, meta, floor_scale, attn_scale) -> torch.Tensor:
    """``query`` ``[1, H, T, D]`` as Llama 4's attention temperature tuning scales it at the rows'
    true positions. The model scales by positions ``past + arange(T)`` with ``past`` the cache's
    ``get_seq_length()``, 0 for a step's cache view, so over a flattened batch it used each row's
    index in the step: undo that scale and apply the true one. Exact (the scale the model applied
    is exactly 1) while the step has under ``floor_scale - 1`` rows (8191 by default); beyond,
    the undoing rounds once."""
    num_rows = query.shape[2]
    applied = _tuned_scale(torch.arange(num_rows, device=query.device), floor_scale, attn_scale)
    wanted = _tuned_scale(meta.query_positions(), floor_scale, attn_scale)
    return (query * (wanted / applied).view(1, 1, num_rows, 1)).to(query.dtype)


def _head_maps(stored_key, stored_value, key, value) -> Optional[tuple]:
    """``(key_heads, value_heads)``: for each head of ``key``/``value`` ``[1, n, T, D]``, the one
    head of the stored ``[1, KVH, T, D]`` it equals (``torch.equal`` on this step's rows), or None
    where some head equals none of them, or more than one (then which pool head holds its past is
    not known). A model that picks heads from what it stored after ``cache.update`` (DiffLlama
    tiles each half of V; JetMoE repeats K and V per expert) is served by reading those heads of
    the pool; any other change of K/V is refused."""
    if key.shape[1] != value.shape[1]:
        return None
    maps = []
    for given, stored in ((key, stored_key), (value, stored_value)):
        if given is stored:
            maps.append(tuple(range(stored.shape[1])))
            continue
        if given.shape[0] != stored.shape[0] or given.shape[2:] != stored.shape[2:]:
            return None
        heads = []
        for j in range(given.shape[1]):
            found = [i for i in range(stored.shape[1]) if torch.equal(given[:, j], stored[:, i])]
            if len(found) != 1:
                return None
            heads.append(found[0])
        maps.append(tuple(heads))
    return maps[0], maps[1]


def paged_cache_is_latent(module) -> bool:
    """Whether ``module`` is a multi-head latent attention module (transformers' MLA families cache
    its latents: ``KVLayerShape.latent``)."""
    rank = getattr(module, "kv_lora_rank", None)
    return isinstance(rank, int) and rank > 0


def _one_request_sinks(sinks, paged_cache) -> bool:
    """Whether ``sinks`` (a model's ``sinks`` keyword) are one sink logit per query row and head of
    the step's one request, ``[1, H, T, 1]`` (Inkling 2), the only per-row sinks the torch path takes."""
    rows = paged_cache.one_request_rows()
    return (
        isinstance(sinks, torch.Tensor)
        and rows is not None
        and sinks.dim() == 4
        and sinks.shape[0] == 1
        and tuple(sinks.shape[2:]) == (rows[0], 1)
    )


def _check_served_call(module, key, value, attention_mask, stored, kwargs, paged_cache, compiled: bool):
    """The layer whose pool the call reads and the head maps it reads them through (None: the
    stored heads as they are), from the K/V the step's last ``update`` stored (``stored``):
    usually ``module.layer_idx``; the layer they were stored as where a module attends over K/V
    stored under another index (HRM's recurrent cycles: one module, one cache layer per cycle;
    Zamba 2's shared block, ``layer_idx`` -1, called as each of several layers).

    Raises ``ValueError`` where the model asks attention for something the paged kernels would
    silently not do (they read the step's context from the pool and mask causally, with the
    ``sliding_window``/``softcap``/``s_aux``/``position_bias`` arguments): a mask of its own (an
    ALiBi or learned bias: an engine step builds none; the masks served are the step's own causal
    mask over its contexts, ``PagedCacheStep.index_mask``, which a model with a sparse-attention
    indexer passes on beside the indexer's top-k, and the stand-in ``PagedCacheStep.store_key_bias``
    returns for a per-key bias the layer stored in its pool), attention sinks or position-scaled
    queries under a compiled forward (its op has neither), a position bias or per-query sinks
    (``sinks``) under a compiled forward or not over a single request's rows and whole context
    (``PagedCacheStep.serves_position_bias``, ``one_request_rows``), a latent layer under a compiled
    forward (whose op stores and attends without returning the contexts), K/V changed after
    ``cache.update`` other than by picking stored heads (:func:`_head_maps`; a latent layer's model
    expands the contexts its ``update`` returned, new tensors by design), or a layer attending over
    K/V it did not store (but for a layer sharing another's K/V: Gemma 4)."""
    layer, head_maps, what = getattr(module, "layer_idx", None), None, None
    error = ValueError
    if attention_mask is not None and not (
        not compiled
        and (
            paged_cache.is_index_mask(attention_mask)
            or paged_cache.key_bias_call(stored[1] if stored is not None else layer, attention_mask) is not None
        )
    ):
        what = "adds its own attention mask or bias"
    elif compiled and kwargs.get("s_aux") is not None:
        what = "passes attention sinks (s_aux), which a compiled forward does not serve"
    elif compiled and kwargs.get("sinks") is not None:
        what = "passes per-query attention sinks (sinks), which a compiled forward does not serve"
    elif kwargs.get("sinks") is not None and not _one_request_sinks(kwargs["sinks"], paged_cache):
        what = "passes attention sinks (sinks) that are not one request's per query row and head"
    elif compiled and kwargs.get("position_bias") is not None:
        what = "adds a position bias (position_bias), which a compiled forward does not serve"
    elif kwargs.get("position_bias") is not None and not paged_cache.serves_position_bias(kwargs["position_bias"]):
        # Inkling's relative position bias: a dense [B, H, T, S] tensor the model computes from the
        # cache's query offset and mask sizes, which mean one request's context (the recurrent
        # runner's one-request forwards); over a flattened batch it would align with no request.
        what = "adds a position bias (position_bias) that is not over one request's whole context"
    elif compiled and _temperature_tuning(module) is not None:
        what = "scales its queries by position (attention temperature tuning), which a compiled forward does not serve"
        error = CompiledAttentionUnserved  # served eagerly: ``CompiledForward`` falls back
    elif compiled and paged_cache_is_latent(module):
        what = "caches multi-head latent attention's latents, which a compiled forward does not serve"
    elif not compiled and paged_cache.shares_kv(layer):
        pass  # Gemma 4's KV sharing: it reads its source layer's pools and stores nothing
    elif stored is None:
        if not compiled:
            # The kernels read the layer's pool: without this step's K/V stored there they would
            # read stale or empty slots (a wrong token, never an error), so refuse instead.
            what = "attends without storing its K/V through cache.update right before"
    elif stored[0].is_latent(stored[1]):
        layer = stored[1]  # its model expanded the contexts update returned: K/V are new tensors
    else:
        stored_key, stored_value = stored[2], stored[3]
        if stored_key is not key or stored_value is not value:
            head_maps = _head_maps(stored_key, stored_value, key, value)
            if head_maps is None:
                what = (
                    "changes K/V between cache.update and attention"
                    if stored[1] == layer
                    else f"attends as layer {layer} without storing its K/V through cache.update right before "
                    f"(the last K/V stored were layer {stored[1]}'s)"
                )
        layer = stored[1]
    if what is not None:
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        raise error(f"{type(module).__name__} (model type {model_type!r}) {what}: not served by hf_contbatch")
    return layer, head_maps


# --- the compiled forward's op ---------------------------------------------------------------------
class CompiledAttentionUnserved(ValueError):
    """Raised by the compiled forward's attention op for a model whose attention it cannot serve
    (it cannot see what the model did to the K/V it stored): ``CompiledForward`` then runs the
    model eagerly, where the attention function reads what was stored."""


try:  # opaque objects as custom-op arguments (recent torch); older torch serves compile_model eagerly
    from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # pragma: no cover - a torch without opaque objects
    OpaqueBase = object
    register_opaque_type = None


class CompiledStep(OpaqueBase):
    """One step's cache view (``PagedKVCache.for_step``) as the compiled forward passes it to the
    attention op: an opaque reference object, so torch.compile makes it a graph input without
    tracing into it or guarding on it (a new one each step compiles nothing new).

    Attributes:
        step: the step's ``PagedCacheStep`` (its ``update`` stores K/V, ``attend`` reads the pool).
    """

    def __init__(self, step) -> None:
        self.step = step


COMPILED_STEP_SUPPORTED = False
"""Whether this torch passes :class:`CompiledStep` to a custom op (opaque reference objects); where
not, ``compile_model`` runs the model eagerly with one warning (``kernels.compiled_forward``)."""
if register_opaque_type is not None:
    try:
        register_opaque_type(CompiledStep, typ="reference")
        COMPILED_STEP_SUPPORTED = True
    except TypeError:  # pragma: no cover - an opaque-object API without reference types
        pass


# A plain ``torch.library.Library`` kernel, not ``torch.library.custom_op``: the latter adds Python
# autograd and alias-check layers to every call (see ``hf_contbatch.kernels.linears.linear_op``).
# Inference only: no autograd formula.
_OPS = torch.library.Library("hf_contbatch", "FRAGMENT")


def _paged_attention_op(
    query, key, value, compiled_step, layer_idx: int, scale: float, sliding_window: int, softcap, chunk_size: int
):
    """Store ``key``/``value`` ``[1, KVH, T, D]`` into the pool of ``compiled_step``'s view and
    attend: ``query`` ``[1, H, T, D]`` -> ``[1, T, H, D]``. ``sliding_window`` -1, ``softcap``
    0.0 and ``chunk_size`` 0 mean none. The pool is written although it is not a tensor argument: nothing else in the
    compiled graph reads it, and declaring it would make the compiler copy it (functionalization)."""
    step = compiled_step.step
    # What the eager path serves by reading the K/V the model stored (``_check_served_call``) the
    # op cannot tell apart: a module storing twice in a step (DiffLlama's two calls over halves of
    # V, HRM's recurrent cycles) or more K/V heads than the pool holds (JetMoE's per-expert repeat).
    kv_heads = step.cache.key_cache[layer_idx].shape[2]
    what = None
    if layer_idx in step.layers_stored:
        what = f"stores K/V for layer {layer_idx} more than once in a step"
    elif key.shape[1] != kv_heads or value.shape[1] != kv_heads:
        what = f"attends over {key.shape[1]} K/V heads, the KV pool holds {kv_heads}"
    if what is not None:
        raise CompiledAttentionUnserved(f"the model {what}: not served by a compiled forward")
    step.layers_stored.add(layer_idx)
    step.update(key, value, layer_idx)
    take_stored()  # this op attends to what it just stored
    out = step.attend(
        layer_idx,
        query,
        key,
        value,
        scale,
        None if sliding_window < 0 else sliding_window,
        None if softcap == 0.0 else softcap,
        chunk_size=chunk_size or None,
    )
    # The compiler reads the output with the fake's (contiguous) strides; the torch path's output
    # follows the query's memory layout, which a compiled graph may have permuted.
    return out.contiguous()


def _paged_attention_fake(query, key, value, compiled_step, layer_idx, scale, sliding_window, softcap, chunk_size):
    return query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))


if COMPILED_STEP_SUPPORTED:
    _OPS.define(
        f"paged_attention(Tensor query, Tensor key, Tensor value, {get_opaque_type_name(CompiledStep)} compiled_step, "
        "int layer_idx, float scale, int sliding_window, float softcap, int chunk_size) -> Tensor"
    )
    _OPS.impl("paged_attention", _paged_attention_op, "CompositeExplicitAutograd")
    torch.library.register_fake("hf_contbatch::paged_attention", _paged_attention_fake, lib=_OPS)


def register_attention(previous: Optional[str] = None) -> str:
    """Register the paged attention for models whose own implementation is ``previous``
    (idempotent) and return its name (:func:`paged_attention_name`).

    Registered twice in transformers' registries under that name: the attention function (which
    runs ``previous`` outside an engine step) and, where ``previous`` has one, ``previous``'s mask
    builder, so the user's own calls get their causal, padding and sliding-window masks. An
    engine step builds no mask all the same: its cache view is a ``PagedAttentionCache`` to
    transformers' mask code, which then returns None at once (no dense ``[T, T]`` mask over the
    flattened batch).
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = paged_attention_name(previous)
    AttentionInterface.register(name, functools.partial(paged_attention_forward, previous_implementation=previous))
    mask_of = previous or "eager"
    if mask_of in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_of])
    return name
