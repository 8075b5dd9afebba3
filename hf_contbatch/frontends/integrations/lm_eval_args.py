"""The lm-eval model type's name and its engine settings (the extra ``model_args``), in a module
that imports neither lm-eval nor torch, so that ``hf-contbatch eval --help`` can list them quickly.
``lm_eval.ContinuousBatchingLM`` reads the settings from here."""

from __future__ import annotations

from ...config import CacheConfig  # light: no torch

MODEL_TYPE = "hf-contbatch"

# name -> (default, what it sets); the names are ``model_args`` keys. The cache settings default as the
# engine's do; lm-eval's batches are larger than a notebook's, hence its own scheduler defaults.
ENGINE_ARGS: dict[str, tuple[object, str]] = {
    "block_size": (CacheConfig.block_size, "tokens per KV block (CacheConfig.block_size)"),
    "num_blocks": (None, "KV blocks in the pool; None sizes it from cache_gib or the free memory"),
    "cache_gib": (None, "KV pool size in GiB when num_blocks is not given (CacheConfig.cpu_cache_gib on CPU)"),
    "max_num_seqs": (256, "most requests running at once (SchedulerConfig.max_num_seqs)"),
    "max_num_batched_tokens": (2048, "token budget of one step (SchedulerConfig.max_num_batched_tokens)"),
    "enable_prefix_caching": (
        CacheConfig.enable_prefix_caching,
        "share the KV of common prompt prefixes (CacheConfig.enable_prefix_caching)",
    ),
    "attention_backend": ("auto", "auto, torch or triton (EngineConfig.attention_backend)"),
    "engine_seed": (None, "the engine's sampling seed (EngineConfig.seed)"),
    "quantization": (
        None,
        "None, int8 (weight-only int8 linears) or w8a8 (int8 weights and activations): EngineConfig.quantization",
    ),
}


def describe_engine_args() -> str:
    """One line per engine setting, ``name=default: what it sets`` (for help texts)."""
    return "\n".join(f"  {name}={default}: {what}" for name, (default, what) in ENGINE_ARGS.items())
