"""Which models the engine serves, and the widths of their vocabulary (checked before anything is built).

A model is served when two things hold, both read from its classes and config alone (no weight is
touched, so a refusal comes before any packing or pool is built):

- its attention goes through transformers' ``AttentionInterface`` (the class flag transformers
  itself reads, ``_supports_attention_backend``, that ``PreTrainedModel.is_backend_compatible``
  returns): our paged attention is plugged in there; or, for the families whose attention modules
  compute attention in their own code (Bloom, Falcon, GPT-Neo, GPT-NeoX-Japanese, MPT, TrOCR,
  XGLM in transformers 5.24), it stores K/V through ``cache.update`` and attends over what that
  returns (:func:`cache_update_refusal` finds none of what would keep it from it): those are served
  through the cache object alone, their masks, windows and ALiBi their own
  (``engine.dense_runner``, :func:`attends_through_cache_update`);
- every layer's kind is one the paged KV cache serves: full attention, sliding-window attention
  (the window reaches the kernels as the ``sliding_window`` attention argument), chunked local
  attention (Llama 4's ``"chunked_attention"`` layers: the attention function reads the chunk from
  the config, the torch path masks it), layers without attention (an MLP or MoE block listed in
  ``layer_types``), and recurrent layers
  (``RECURRENT_LAYER_KINDS``: Mamba mixers, gated delta-net and other linear attention, short
  convolutions, Zamba 2's and Inkling's hybrid layers), whose per-request state lives in a slot of
  ``kernels.recurrent_state`` (served by ``engine.recurrent_runner``: whole prefills, no prefix
  caching, no prompt-lookup drafts, preemption by recompute), and layer kinds whose cache layer
  class the model's own modeling module defines (DeepSeek V4's compressed attention, which pools
  every few tokens into one K=V entry and, in its sparse kind, picks its top-k of those per query):
  each request keeps transformers' own cache and runs alone (``engine.own_cache_runner``, the
  recurrent rules again; attention by the model's own function). A model of recurrent layers only
  (Mamba) has no attention to check. Each attention layer's K/V shape is its own
  (``engine.kv_groups.layer_kv_shapes``: per-layer head sizes and KV heads, V heads narrower than K
  heads, multi-head latent attention's cached latents). Kinds it cannot serve yet are named in the
  refusal: recurrent layers whose state is not in transformers' ``Cache`` (RWKV, xLSTM,
  RecurrentGemma), ALiBi biases passed to the interface as a mask, a dynamic mask whose per-key bias
  the pool cannot size, and attention outside the interface without a KV cache served through
  ``cache.update`` (OpenAI GPT, XLNet, XLM, CPM-Ant: :func:`cache_update_refusal` says why). Indexed
  (sparse) attention is served: its indexer's keys in a pool per layer, its top-k read by the torch
  attention path; so is Doge's dynamic mask attention: the bias it computes per key from the key's
  value in a pool per layer, applied with its top-k by the torch attention path
  (``engine.dynamic_mask``). Attention sinks (gpt-oss's ``s_aux``; Inkling 2's per query row,
  ``sinks``), K/V heads of different sizes and a model's own position bias over one request's
  context (Inkling's relative position bias, ``position_bias``: its decodes run one request per
  forward, ``engine.recurrent_runner``) are served by the torch attention path; the C and Triton
  kernels step aside to it for such layers.
"""

from __future__ import annotations

import inspect
import sys

from .dynamic_mask import dynamic_mask_modules, key_bias_heads
from .kv_groups import RECURRENT_LAYER_KINDS, own_cache_kinds
from .kv_groups import STATE_ONLY_LAYER_KINDS as _STATE_ONLY_KINDS
from .pool_sizing import KVGeometry, text_config

# ``config.layer_types`` entries the paged KV cache serves: attention layers whose masking the
# kernels do themselves (causal, plus a window passed as ``sliding_window`` or a chunk read from the
# config), stateless blocks, and multi-head latent attention with a sparse-attention indexer
# ("indexed_attention": DeepSeek V3.2, GLM-MoE-DSA, A.X K2, HY V4), whose indexer keys get a pool of
# their own and whose top-k is picked under the step's causal mask over its contexts.
SERVED_LAYER_KINDS = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe", "indexed_attention"}
)


# What an unserved ``layer_types`` kind needs that the paged KV cache lacks, where the kind's name
# alone does not say (the refusal names both).
_KIND_NEEDS: dict[str, str] = {}


def _layer_kinds(cfg) -> list[str]:
    kinds = getattr(cfg, "layer_types", None)
    return [str(k) for k in kinds] if isinstance(kinds, (list, tuple)) else []


def keeps_own_cache(model) -> bool:
    """Whether ``model`` has a ``config.layer_types`` kind whose cache layer class its own modeling
    module defines (``engine.kv_groups.own_cache_kinds``: DeepSeek V4's compressed attention), so
    that each request keeps transformers' own cache (``engine.own_cache_runner``)."""
    return bool(own_cache_kinds(model))


def has_recurrent_layers(model) -> bool:
    """Whether ``model``'s ``config.layer_types`` lists a recurrent layer kind (``RECURRENT_LAYER_KINDS``)."""
    return any(k in RECURRENT_LAYER_KINDS for k in _layer_kinds(text_config(model)))


def _only_recurrent_layers(cfg) -> bool:
    """Whether every layer of ``cfg`` is recurrent or stateless (no attention layer: Mamba)."""
    kinds = _layer_kinds(cfg)
    return bool(kinds) and all(k in _STATE_ONLY_KINDS or k in ("mlp", "moe") for k in kinds)


def _in_recurrent_layer(module, kinds: list[str]) -> bool:
    """Whether ``module`` belongs to a recurrent layer (a linear attention such as Kimi's
    ``KimiLinearDeltaAttention`` is named like an attention but keeps a state, not K/V)."""
    idx = getattr(module, "layer_idx", None)
    return isinstance(idx, int) and 0 <= idx < len(kinds) and kinds[idx] in _STATE_ONLY_KINDS


# The Cache methods through which a recurrent layer hands its state to the cache it is given (the
# view of a step maps them to the request's slot; MiniMax's lightning attention names its own).
_STATE_WRITES = ("update_conv_state", "update_recurrent_state", "set_linear_cache")


def _state_through_cache(model) -> bool:
    """Whether ``model``'s modeling module writes recurrent state through the cache (RecurrentGemma
    keeps it on its modules instead: a state the engine never sees, shared by every request)."""
    module = sys.modules.get(type(model).__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return any(name in source for name in _STATE_WRITES)


def _dispatches_through_interface(cls) -> bool:
    """Whether ``cls.forward``'s source looks its attention function up in transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (transformers decides ``_can_set_attn_implementation`` by reading
    module source the same way)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _attention_through_interface(model) -> bool:
    """True when transformers flags the model class as dispatching attention through the interface
    (``is_backend_compatible``, the flag its custom-kernel loading reads), or, for the classes that
    do so without setting the flag (StableLM, BioGPT), when every attention module with a
    ``layer_idx`` looks its function up in ``ALL_ATTENTION_FUNCTIONS``."""
    compatible = getattr(type(model), "is_backend_compatible", None)
    if compatible() if callable(compatible) else getattr(model, "_supports_attention_backend", False):
        return True
    kinds = _layer_kinds(text_config(model))
    attention = {
        type(m)
        for m in model.modules()
        if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention") and not _in_recurrent_layer(m, kinds)
    }
    return bool(attention) and all(_dispatches_through_interface(cls) for cls in attention)


def _forward_params(model) -> set:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def cache_update_refusal(model):
    """Why ``model``, whose attention is outside the interface, cannot be served through the cache
    object it calls either (a phrase that follows "attention outside transformers'
    AttentionInterface (...)"), or None when it can: its forward takes a cache, an attention module
    of its stores K/V through ``cache.update`` (and attends, in its own code, over what that returns:
    ``kernels.dense_context``), and its modeling code neither reads the cache's per-layer tensors
    behind ``update``'s back nor stores K/V for tokens it was not given. Reads classes, source and
    the config only.

    What it refuses (transformers 5.24): OpenAI GPT (no cache: every step recomputes the whole
    sequence), RWKV (a recurrent state of its own), XLNet (its own memory of past hidden states),
    XLM (reads the cache's ``key_cache`` lists, and recomputes from the whole sequence), CPM-Ant
    (learned prompt tokens prepended to every sequence: K/V at positions no block was allocated
    for). A model that passes this check but stores no K/V at run time, or K/V of another shape than
    the pool's, is refused at its first step (``DenseContextStep``)."""
    params = _forward_params(model)
    if "state" in params:
        return "with a recurrent state of its own, not a KV cache"
    if "mems" in params:
        return "with a memory of past hidden states (mems), not a KV cache"
    if not params & {"cache", "past_key_values"}:
        return "with no KV cache (every step recomputes the whole sequence)"
    classes = {type(m) for m in model.modules() if "Attention" in type(m).__name__}
    if not any(".update(" in _source(cls.forward) for cls in classes):
        return "storing no K/V through cache.update"
    module = sys.modules.get(type(model).__module__)
    text = _source(module) if module is not None else ""
    if ".key_cache[" in text or ".value_cache[" in text:
        return "reading the cache's key_cache lists"
    if getattr(text_config(model), "prompt_length", 0):
        return "over prompt tokens it prepends to every sequence"
    return None


def attends_through_cache_update(model) -> bool:
    """Whether the engine serves ``model`` (which ``check_supported_model`` accepted) through the cache
    object alone: its attention is outside the interface, computed over what ``cache.update``
    returns (``engine.dense_runner``), rather than by the registered paged attention."""
    return not _only_recurrent_layers(text_config(model)) and not _attention_through_interface(model)


def unserved_layer_kind(model):
    """The first thing about ``model`` the engine cannot serve yet, as a short phrase naming the
    layer kind ("layer kinds 'hybrid_sliding'", "ALiBi position biases ...", ...), or None when every layer is served. Reads classes, the config and module attributes only."""
    cfg = text_config(model)
    # Kinds whose cache layer class the model's own modeling module defines (DeepSeek V4's
    # compressed attention) run on that class, per request (``engine.own_cache_runner``).
    served = SERVED_LAYER_KINDS | RECURRENT_LAYER_KINDS | set(own_cache_kinds(model))
    unserved = [k for k in dict.fromkeys(_layer_kinds(cfg)) if k not in served]
    if unserved:
        needs = list(dict.fromkeys(_KIND_NEEDS[k] for k in unserved if k in _KIND_NEEDS))
        return f"layer kinds {', '.join(repr(k) for k in unserved)}" + (f" ({'; '.join(needs)})" if needs else "")
    if any(k in RECURRENT_LAYER_KINDS for k in _layer_kinds(cfg)) and not _state_through_cache(model):
        return "recurrent layers that keep their state on the modules, not in transformers' Cache"
    if _only_recurrent_layers(cfg):
        return None  # no attention: nothing of the KV pool's shape to check
    if not _attention_through_interface(model):
        # Bloom, Falcon, GPT-Neo, MPT, XGLM... (transformers 5.24) compute attention in their own
        # code, so there is nothing to plug the paged one into; those that attend over what
        # ``cache.update`` returns are served through the cache (``engine.dense_runner``).
        names = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
        why = f"{names[0]} computes its own" if names else "legacy or recurrent layers"
        missing = cache_update_refusal(model)
        if missing is not None:
            return f"attention outside transformers' AttentionInterface ({why}) {missing}"
        try:
            KVGeometry.of(model)
        except (ValueError, AttributeError, RuntimeError, TypeError) as exc:
            return f"attention shapes the KV pool cannot hold ({str(exc).splitlines()[0][:120]})"
        return None  # its ALiBi, windows and masks are the model's own, computed over the returned K/V
    if getattr(cfg, "alibi", False):
        return "ALiBi position biases (passed in the attention mask)"
    if any(not key_bias_heads(m) for m in dynamic_mask_modules(model)):
        # Doge's dynamic mask attention is served by caching its per-key bias beside the keys, one
        # channel per output of its ``dt_proj``; without that projection the pool cannot be sized.
        return "a dynamic attention mask whose per-key bias has no dt_proj to size its pool"
    try:
        # Each layer's K/V shape from its attention module: per-layer head sizes and KV heads (Gemma 4,
        # MiMo-V2-Flash), V heads of their own size, and the latents of multi-head latent attention
        # are all served; what is refused is a layer whose projections do not split into heads.
        KVGeometry.of(model)
    except (ValueError, AttributeError, RuntimeError, TypeError) as exc:
        return f"attention shapes the KV pool cannot hold ({str(exc).splitlines()[0][:120]})"
    return None


def check_supported_model(model) -> None:
    """Raise ``ValueError`` (one line naming the model type and the layer kind) unless the engine
    serves ``model`` (see the module docstring). Runs before any weight is read or changed."""
    kind = unserved_layer_kind(model)
    if kind is not None:
        model_type = getattr(text_config(model), "model_type", None)
        raise ValueError(f"model type {model_type!r} is not served by hf_contbatch: {kind}")


def vocab_widths(model) -> tuple[int, int]:
    """(input embedding rows: every prompt id must index them; logits width: the LM head's rows, which
    may exceed the tokenizer's vocabulary and are what a grammar's bitmask must cover)."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return vocab_size, head.weight.shape[0] if getattr(head, "weight", None) is not None else vocab_size
