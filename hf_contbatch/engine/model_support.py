"""Which models the engine serves, and the widths of their vocabulary (checked before anything is built).

A model is served when two things hold, both read from its classes and config alone (no weight is
touched, so a refusal comes before any packing or pool is built):

- its attention goes through transformers' ``AttentionInterface`` (the class flag transformers
  itself reads, ``_supports_attention_backend``, that ``PreTrainedModel.is_backend_compatible``
  returns): our paged attention is plugged in there;
- every layer's kind is one the paged KV cache serves: full attention, sliding-window attention
  (the window reaches the kernels as the ``sliding_window`` attention argument), chunked local
  attention (Llama 4's ``"chunked_attention"`` layers: the attention function reads the chunk from
  the config, the torch path masks it), and layers without attention (an MLP or MoE block listed
  in ``layer_types``). Kinds it cannot serve yet are named in the refusal: recurrent and
  linear-attention layers (a per-request state), latent attention whose K and V heads differ in
  size, ALiBi biases. Attention sinks
  (gpt-oss's ``s_aux``) are served by the torch attention path; a Triton engine refuses them at
  the first step, in one line.
"""

from __future__ import annotations

import inspect

from .pool_sizing import KVGeometry, text_config

# ``config.layer_types`` entries the paged KV cache serves: attention layers whose masking the
# kernels do themselves (causal, plus a window passed as ``sliding_window`` or a chunk read from the
# config), and stateless blocks.
SERVED_LAYER_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe"})


# What an unserved ``layer_types`` kind needs that the paged KV cache lacks, where the kind's name
# alone does not say (the refusal names both).
_KIND_NEEDS = {
    # Inkling: K and V pass through short causal convolutions whose state is per request, and
    # attention adds a learned relative-position bias (``position_bias``) the kernels do not take.
    "hybrid": "short convolutions over K/V (a per-request state) and a relative position bias",
    "hybrid_sliding": "short convolutions over K/V (a per-request state) and a relative position bias",
}


def _layer_kinds(cfg) -> list[str]:
    kinds = getattr(cfg, "layer_types", None)
    return [str(k) for k in kinds] if isinstance(kinds, (list, tuple)) else []


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
    attention = {type(m) for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")}
    return bool(attention) and all(_dispatches_through_interface(cls) for cls in attention)


def unserved_layer_kind(model):
    """The first thing about ``model`` the engine cannot serve yet, as a short phrase naming the
    layer kind ("layer kinds 'linear_attention'", "multi-head latent attention ...", ...), or None when every layer is served. Reads classes, the config and module attributes only."""
    cfg = text_config(model)
    unserved = [k for k in dict.fromkeys(_layer_kinds(cfg)) if k not in SERVED_LAYER_KINDS]
    if unserved:
        needs = list(dict.fromkeys(_KIND_NEEDS[k] for k in unserved if k in _KIND_NEEDS))
        return f"layer kinds {', '.join(repr(k) for k in unserved)}" + (f" ({'; '.join(needs)})" if needs else "")
    if not _attention_through_interface(model):
        # Bloom, Falcon, GPT-Neo, MPT, XGLM, XLNet, RWKV... (transformers 5.24): their attention
        # modules compute attention in their own code, so there is nothing to plug the paged one into.
        names = sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__})
        why = f"{names[0]} computes its own" if names else "legacy or recurrent layers"
        return f"attention outside transformers' AttentionInterface ({why})"
    if getattr(cfg, "alibi", False):
        return "ALiBi position biases (passed in the attention mask)"
    if any(callable(getattr(type(m), "prepare_dynamic_mask", None)) for m in model.modules()):
        # Doge's dynamic mask attention: a bias per key computed from the cached values, and a top-k
        # over the keys past ``keep_window_size``: the pool stores K/V, not that bias.
        return "a dynamic attention mask computed from the cached values (a per-key bias the KV cache does not store)"
    if getattr(cfg, "kv_lora_rank", None):
        k_dim = (getattr(cfg, "qk_nope_head_dim", 0) or 0) + (getattr(cfg, "qk_rope_head_dim", 0) or 0)
        return (
            f"multi-head latent attention (K heads of {k_dim} channels, V heads of {getattr(cfg, 'v_head_dim', '?')})"
        )
    try:
        g = KVGeometry.of(model)
    except (AttributeError, RuntimeError, TypeError) as exc:  # Gemma 4: head_dim is a per-layer attribute
        return f"attention shapes that vary per layer ({str(exc).splitlines()[0][:100]})"
    # One pool shape for every layer: each layer's K and V projections must give KVH x D channels
    # (MiMo-V2-Flash's sliding layers have more KV heads; K and V heads may differ in size).
    width = g.num_kv_heads * g.head_dim
    for module in model.modules():
        for proj in ("k_proj", "v_proj"):
            out = getattr(getattr(module, proj, None), "out_features", None)
            if hasattr(module, "layer_idx") and out is not None and out != width:
                return (
                    f"layers whose K/V shapes differ from the config's (layer {module.layer_idx}'s {proj} "
                    f"gives {out} channels, the KV pool holds {g.num_kv_heads} x {g.head_dim})"
                )
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
