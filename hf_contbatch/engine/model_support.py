"""Which models the engine serves, and the widths of their vocabulary (checked before anything is built)."""

from __future__ import annotations

from .pool_sizing import text_config

# Families whose attention goes through transformers' AttentionInterface and whose layers call
# ``cache.update(...)`` right before attention (tests/engine/test_engine_equivalence.py checks greedy equality).
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "phi3",
    "granite",
    "olmo2",
    "smollm3",
)


def check_supported_model(model) -> None:
    """Raise ``ValueError`` naming the supported families unless ``model`` is one of them and its
    attention goes through transformers' ``AttentionInterface``."""
    model_type = getattr(text_config(model), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not getattr(model, "_supports_attention_backend", True):
        raise ValueError(
            f"model type {model_type!r} is not supported by hf_contbatch; supported families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def vocab_widths(model) -> tuple[int, int]:
    """(input embedding rows: every prompt id must index them; logits width: the LM head's rows, which
    may exceed the tokenizer's vocabulary and are what a grammar's bitmask must cover)."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return vocab_size, head.weight.shape[0] if getattr(head, "weight", None) is not None else vocab_size
