"""Which KV cache group each decoder layer belongs to, read from the model's config the way
transformers decides each layer's attention.

The window that counts is the one transformers passes to the attention function as its
``sliding_window`` keyword (a query at position ``q`` then sees keys ``q - W + 1 .. q``; the kernels
mask the same way). Families differ in where it comes from:

- Mistral, Mixtral, Phi-3 and Qwen3-MoE pass ``config.sliding_window`` in every layer (Mistral
  ignores ``layer_types`` with a warning).
- Qwen2, Qwen2-MoE, Qwen3, Gemma-2, Gemma-3 and SmolLM3 pass it in the layers whose
  ``config.layer_types[i]`` is ``"sliding_attention"`` (their configs build ``layer_types`` from
  ``use_sliding_window``/``max_window_layers`` or a sliding pattern; Qwen2's and Qwen3's null
  ``sliding_window`` unless ``use_sliding_window``, Qwen2-MoE's set it to 0, SmolLM3 also checks
  ``use_sliding_window`` in the layer).
- The other families pass none.

``tests/engine/test_sliding_window.py`` checks these rules against the windows each family's forward
really passes.

Each layer's K/V shape (:func:`layer_kv_shapes`) is read from its attention module, which is where
transformers decides it: Gemma 4's global layers have their own head size and KV heads,
MiMo-V2-Flash's sliding layers twice the KV heads and V heads of ``v_head_dim`` channels, and the
multi-head latent attention families cache their latents (``KVLayerShape.latent``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..kernels.kv_spec import KVCacheGroup, KVCacheSpec, KVLayerShape
from .dynamic_mask import key_bias_heads

__all__ = [
    "cache_layer_sources",
    "kv_cache_groups",
    "layer_kv_shapes",
    "layer_query_heads",
    "layer_windows",
    "own_cache_kinds",
]

_EVERY_LAYER = frozenset({"mistral", "mixtral", "phi3", "qwen3_moe"})
_BY_LAYER_TYPE = frozenset({"qwen2", "qwen2_moe", "qwen3", "gemma2", "gemma3", "gemma3_text", "smollm3"})


def layer_windows(config) -> list[Optional[int]]:
    """The sliding window each decoder layer of a model with text config ``config`` attends over
    (tokens, the query's own included), None for a full-attention layer; one entry per layer."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE's "no window" is 0
    model_type = getattr(config, "model_type", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    if model_type in _EVERY_LAYER:
        return [int(window)] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if model_type in _BY_LAYER_TYPE and layer_types is not None:
        return [int(window) if t == "sliding_attention" else None for t in layer_types[:num_layers]]
    return [None] * num_layers


def cache_layer_sources(config) -> list[int]:
    """For each cache layer a model of text config ``config`` stores K/V and recurrent state in, the
    decoder layer that computes it: ``range(num_hidden_layers)``, then, for a model that runs a span
    of its layers several times (Inkling 2 Loop: ``loop_num_passes`` passes over layers
    ``loop_layer_index_start .. loop_layer_index_end - 1``, each pass after the first with cache
    layers of its own appended after the decoder layers', reached through its ``cache_offset``),
    that span again for each later pass."""
    num_layers = config.num_hidden_layers
    sources = list(range(num_layers))
    passes = getattr(config, "loop_num_passes", None)
    start, end = getattr(config, "loop_layer_index_start", None), getattr(config, "loop_layer_index_end", None)
    if all(isinstance(x, int) for x in (passes, start, end)) and passes > 1 and 0 <= start < end <= num_layers:
        sources += list(range(start, end)) * (passes - 1)
    return sources


def kv_cache_groups(spec: KVCacheSpec, windows: Sequence[Optional[int]]) -> list[KVCacheGroup]:
    """The KV cache groups of a model whose layer ``i`` attends over ``windows[i]`` (None: full),
    each layer laid out as ``spec`` (whose ``num_layers`` must be ``len(windows)``).

    One group either way: sliding window W when every layer slides over the same W, else full
    attention. A mixed model (some full, some sliding layers) stores the whole context in every
    layer, as a full-attention model does: correct, not smaller; a group per kind with its own
    block tables is the next step (see ``kernels.kv_spec``). Layers of different K/V shapes
    (``spec.layer_shapes``) stay in the one group: one block-id space indexes every layer's pool,
    each pool shaped by its layer, so one block manager, one budget and one block table per request
    serve them all, and pool sizing counts each layer's own bytes per block.

    Raises:
        ValueError: ``len(windows)`` differs from ``spec.num_layers``.
    """
    if len(windows) != spec.num_layers:
        raise ValueError(f"{len(windows)} layer windows for a spec of {spec.num_layers} layers")
    kinds = set(windows)
    window = kinds.pop() if len(kinds) == 1 else None
    group_spec = dataclasses.replace(spec, sliding_window=window)
    return [KVCacheGroup(group_id=0, layers=tuple(range(spec.num_layers)), spec=group_spec)]


# ``config.layer_types`` entries of recurrent layers: a fixed-size state per request (conv state and
# SSM / linear-attention state) that transformers' layers read and write through the cache object
# (``get_conv_state``, ``update_recurrent_state``...), served by ``kernels.recurrent_state`` and the
# ``engine.recurrent_runner`` (whole prefills, no prefix caching, no drafts, preemption recomputes).
# "hybrid" (Zamba 2): a Mamba layer that also runs a shared attention block (it keeps both a state
# and K/V). Inkling names its layers "hybrid" (full attention) and "hybrid_sliding" (sliding-window
# attention): attention whose K and V, output and MLP output pass through short causal convolutions
# (four conv states per layer, transformers' ``update_conv_state``), so they keep both too.
RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding"})
STATE_ONLY_LAYER_KINDS = frozenset({"linear_attention", "conv", "mamba"})
"""The recurrent kinds without attention in the layer: they store no K/V (their pools keep one
channel of one head, see :func:`layer_kv_shapes`)."""


def own_cache_kinds(model) -> list[str]:
    """The ``config.layer_types`` kinds of ``model`` whose cache layer class its own modeling module
    defines (registered in transformers' ``DYNAMIC_LAYER_TYPE_MAPPING`` through ``_layer_type``),
    in order of first appearance; empty for most models.

    Such a kind keeps state that only that class knows how to hold: DeepSeek V4's compressed
    attention keeps, besides a sliding window of raw K=V rows, a compressor state (a partial window
    of projections, the previous window's overlap half, the growing list of compressed entries that
    attention appends to the keys after ``cache.update``, and for the sparse kind its indexer's
    compressed keys), read and written through methods of its own on ``cache.layers[i]``. Served by
    ``engine.own_cache_runner``: each request keeps transformers' own cache, its forwards run one
    request at a time, attention by the model's own function over what that cache returns.
    """
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    kinds = getattr(cfg, "layer_types", None)
    if not isinstance(kinds, (list, tuple)):
        return []
    home = type(model).__module__
    return [
        k
        for k in dict.fromkeys(str(k) for k in kinds)
        if getattr(DYNAMIC_LAYER_TYPE_MAPPING.get(k), "__module__", None) == home
    ]


def _attention_modules(model, num_layers: int) -> dict:
    """Layer index -> the attention module of that decoder layer (the first module whose class
    name ends in "Attention" and that carries the index as ``layer_idx``)."""
    found: dict = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < num_layers and idx not in found:
            if type(module).__name__.endswith("Attention"):
                found[idx] = module
    return found


def layer_query_heads(model, num_layers: int, layer: int) -> Optional[int]:
    """The query heads of decoder layer ``layer``'s attention module as it states them
    (``num_heads``), or None where it states none (most families: the config's count then)."""
    heads = getattr(_attention_modules(model, num_layers).get(layer), "num_heads", None)
    return heads if isinstance(heads, int) and heads > 0 else None


def _out_features(module, name: str) -> Optional[int]:
    out = getattr(getattr(module, name, None), "out_features", None)
    return out if isinstance(out, int) else None


def _kv_source(model, modules: dict, layer: int) -> int:
    """The layer whose K/V a KV-sharing layer (Gemma 4's ``is_kv_shared_layer``) attends over: the
    last earlier layer of its kind (``config.layer_types``) that stores its own, as transformers'
    ``kv_sharing_modes`` picks it.

    Raises:
        ValueError: no such layer.
    """
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    kinds = getattr(cfg, "layer_types", None) or [None] * (layer + 1)
    for j in range(layer - 1, -1, -1):
        if kinds[j] == kinds[layer] and getattr(modules.get(j), "is_kv_shared_layer", False) is not True:
            return j
    raise ValueError(f"layer {layer} shares K/V but no earlier layer of its kind stores any")


def layer_kv_shapes(model, num_layers: int, num_kv_heads: int, head_dim: Optional[int]) -> list[KVLayerShape]:
    """The K/V shape each decoder layer of ``model`` stores, one entry per layer.

    Read from each layer's attention module, as transformers builds it:

    - multi-head latent attention (a module with ``kv_lora_rank``): one latent head, K of
      ``kv_lora_rank`` channels (the normalized KV latent), V of ``qk_rope_head_dim`` (the shared
      rotary key), ``latent=True``: what its ``cache.update`` receives; with a sparse-attention
      indexer (``module.indexer``, DeepSeek V3.2's DSA), ``indexer_head_size`` its ``head_dim``: the
      one key per token its ``cache.update_indexer`` receives (a layer reusing an earlier layer's
      top-k has ``indexer`` None and caches none).
    - a module with ``k_proj`` (a linear with ``out_features``): head size ``module.head_dim`` (else
      ``head_dim``), KV heads ``k_proj.out_features // head size``, V head size
      ``v_proj.out_features // KV heads`` (no ``v_proj``: Gemma 4's ``attention_k_eq_v`` layers,
      whose V is computed from the K projection: the K head size).
    - anything else (fused QKV projections, a K projection without ``out_features``, no module
      found): the module's own KV head count where it keeps one (``num_key_value_heads``: Inkling 2;
      ``num_kv_heads``: Falcon's), else ``num_kv_heads``, heads of ``head_dim`` (the module's where
      it has one).
    - a recurrent layer (``STATE_ONLY_LAYER_KINDS`` in ``config.layer_types``): one head of one
      channel for K and V (it stores none).
    - every layer of a model with a kind of its own cache (:func:`own_cache_kinds`): one
      head of one channel (its K/V live in that cache, per request; the blocks only count tokens).
    - a module with dynamic mask attention (a ``prepare_dynamic_mask`` method: Doge): also
      ``key_bias_heads``, its ``dt_proj``'s outputs (``engine.dynamic_mask``).
    - a KV-sharing layer (``is_kv_shared_layer``: Gemma 4's last layers): its source's shape with
      ``shared_from`` set (see :func:`_kv_source`); it stores nothing and reads its source's pools.

    Raises:
        ValueError: a layer whose projections do not split into whole heads, or no head size at
            all (one line naming the layer).
    """
    modules = _attention_modules(model, num_layers)
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    kinds = getattr(cfg, "layer_types", None)
    kinds = list(kinds) if isinstance(kinds, (list, tuple)) else []
    if own_cache_kinds(model):
        return [KVLayerShape(1, 1, 1)] * num_layers
    shapes: list[KVLayerShape] = []
    for i in range(num_layers):
        module = modules.get(i)
        if i < len(kinds) and kinds[i] in STATE_ONLY_LAYER_KINDS:
            # A recurrent layer stores no K/V (its state lives in ``kernels.recurrent_state``; a
            # linear attention named like an attention, Kimi's or MiniMax's, has projections that
            # are not K/V heads): one channel of one head, so the pool costs next to nothing.
            shapes.append(KVLayerShape(1, 1, 1))
            continue
        if getattr(module, "is_kv_shared_layer", False) is True:
            src = _kv_source(model, modules, i)
            shapes.append(dataclasses.replace(shapes[src], shared_from=src))
            continue
        rank = getattr(module, "kv_lora_rank", None)
        if isinstance(rank, int) and rank > 0:
            indexer = getattr(module, "indexer", None)
            indexer_size = int(getattr(indexer, "head_dim", 0) or 0) if indexer is not None else 0
            shapes.append(
                KVLayerShape(1, rank, int(module.qk_rope_head_dim), latent=True, indexer_head_size=indexer_size)
            )
            continue
        k_out = _out_features(module, "k_proj")
        size = getattr(module, "head_dim", None) if module is not None else None
        size = size if isinstance(size, int) and size > 0 else head_dim
        if size is None:
            raise ValueError(f"layer {i}: no head size in its attention module or the config")
        if k_out is None:
            # Fused QKV projections or a K projection of the model's own: the module's own KV head
            # count where it keeps one (Inkling 2's conv-and-norm K projection: ``num_key_value_heads``;
            # Falcon's ``num_kv_heads`` follows new_decoder_architecture, which the config's
            # multi_query does not), else the config's.
            heads = None
            for name in ("num_key_value_heads", "num_kv_heads"):
                own = getattr(module, name, None) if module is not None else None
                if isinstance(own, int) and own > 0:
                    heads = own
                    break
            shapes.append(KVLayerShape(heads or num_kv_heads, size, size))
            continue
        v_out = _out_features(module, "v_proj") or k_out
        heads = k_out // size
        if heads < 1 or heads * size != k_out or v_out % heads:
            raise ValueError(
                f"layer {i}'s K/V projections ({k_out} and {v_out} channels) do not split into heads of {size} channels"
            )
        # Dynamic mask attention (Doge): the bias it computes per key is cached beside the key.
        bias = key_bias_heads(module) if callable(getattr(type(module), "prepare_dynamic_mask", None)) else 0
        shapes.append(KVLayerShape(heads, size, v_out // heads, key_bias_heads=bias))
    return shapes
