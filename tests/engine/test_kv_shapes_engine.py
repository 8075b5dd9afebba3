"""Models whose KV shape is not one (KV heads, head size) for K and V in every layer, end to end:
multi-head latent attention (DeepSeek V3: the cache holds transformers' latents), per-layer head
sizes and KV heads (Gemma 4's global layers), sliding layers with more KV heads and V heads of their
own size (MiMo-V2-Flash), layers that attend over an earlier layer's K/V (Gemma 4's KV sharing),
latent layers with a sparse-attention indexer caching keys of its own (DeepSeek V3.2, GLM-MoE-DSA).
Greedy tokens equal transformers' ``generate`` under swap preemption and
chunked prefill, and with an int8 KV cache equal ``generate`` over a cache that quantizes what it
stores by the scheme's definition (plain torch here); the pools' shapes are read off the configs
by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

from conftest import load_family_sweep, reference_greedy

family_sweep = load_family_sweep()

NEW = 16


def _serve(model, prompts, cfg):
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        outs = [h.result(timeout=300).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        eng.block_manager.check_invariants()
        eng.host_block_manager.check_invariants()
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
        return outs, stats
    finally:
        eng.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma4_text", "mimo_v2_flash", "glm_moe_dsa"])
def test_greedy_equals_generate_under_swap_preemption_and_chunked_prefill(model_type):
    model = family_sweep.build_tiny(model_type)
    prompts = family_sweep.prompts() * 2
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    # 14 blocks of 4 tokens for 4 requests of 21-39 tokens: preemption; a 12-token budget: chunks.
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=14, swap_space_gib=0.01),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, preemption_mode="swap"),
    )
    outs, stats = _serve(model, prompts, cfg)
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., D]`` quantized to int8 per row (scale = absmax / 127) and back, in plain torch."""
    x32 = x.float()
    s = x32.abs().amax(-1, keepdim=True) / 127
    return (torch.round(x32 / torch.where(s > 0, s, torch.ones_like(s))).clamp(-127, 127) * s).to(x.dtype)


class _QuantizingCache(DynamicCache):
    """transformers' cache storing every token-head row quantized and dequantized: what an int8 KV
    cache holds (for the MLA families, their latents; for the others, K and V)."""

    updates = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.updates += 1
        return super().update(_fake_quant(key_states), _fake_quant(value_states), layer_idx, *args, **kwargs)


def _quantized_reference(model, prompt):
    cache = _QuantizingCache(config=model.config)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            cache=cache,
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert cache.updates >= NEW, "generate was meant to store through the quantizing cache"
    return out[0, len(prompt) :].tolist()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", ["deepseek_v3", "mimo_v2_flash", "deepseek_v32"])
def test_int8_kv_cache_equals_generate_over_a_quantizing_cache(model_type):
    model = family_sweep.build_tiny(model_type)
    prompts = family_sweep.prompts()
    refs = [_quantized_reference(model, p) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=12, dtype="int8", swap_space_gib=0.01),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, preemption_mode="swap"),
    )
    outs, stats = _serve(model, prompts, cfg)
    assert stats.kv_cache_dtype == "int8"
    assert outs == refs


def _pool_shapes(model):
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=3)))
    try:
        cache = eng.cache
        return [tuple(k.shape) for k in cache.key_cache], [tuple(v.shape) for v in cache.value_cache]
    finally:
        eng.close()


@pytest.mark.timeout(300)
def test_each_layer_gets_the_pool_its_config_gives_it():
    # DeepSeek V3: one latent "head" per layer, K = the kv_lora_rank latent, V = the rotary key.
    model = family_sweep.build_tiny("deepseek_v3")
    cfg = model.config
    keys, values = _pool_shapes(model)
    assert keys == [(3, 4, 1, cfg.kv_lora_rank)] * cfg.num_hidden_layers
    assert values == [(3, 4, 1, cfg.qk_rope_head_dim)] * cfg.num_hidden_layers
    # Gemma 4: each layer's head_dim and KV heads from its per-layer config.
    model = family_sweep.build_tiny("gemma4_text")
    cfg = model.config
    per_layer = [cfg.per_layer_config[i] for i in range(cfg.num_hidden_layers)]
    want = [(3, 4, c.num_key_value_heads, c.head_dim) for c in per_layer]
    keys, values = _pool_shapes(model)
    assert keys == want and values == want
    assert len({k[3] for k in keys}) > 1, "the tiny config was meant to mix head sizes"
    # MiMo-V2-Flash: sliding layers twice the KV heads; V heads of v_head_dim channels.
    model = family_sweep.build_tiny("mimo_v2_flash")
    cfg = model.config
    heads = [cfg.num_key_value_heads * (2 if t == "sliding_attention" else 1) for t in cfg.layer_types]
    keys, values = _pool_shapes(model)
    assert keys == [(3, 4, h, cfg.head_dim) for h in heads]
    assert values == [(3, 4, h, cfg.v_head_dim) for h in heads]


@pytest.mark.timeout(300)
def test_indexer_layers_get_an_indexer_key_pool():
    # GLM-MoE-DSA (the sweep's tiny config: indexer_types ["full", "shared"]): layer 0's indexer
    # caches one index_head_dim key per token; layer 1 reuses layer 0's top-k and caches none.
    model = family_sweep.build_tiny("glm_moe_dsa")
    cfg = model.config
    assert list(cfg.indexer_types) == ["full", "shared"]
    indexer = model.model.layers[0].self_attn.indexer
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=3)))
    try:
        pools = eng.cache.indexer_keys
        assert [None if p is None else tuple(p.shape) for p in pools] == [(3, 4, cfg.index_head_dim), None]
        assert pools[0].dtype == torch.float32
        assert "forward" in indexer.__dict__  # its top-k picked per request (engine.sparse_indexer)
    finally:
        eng.close()
    assert "forward" not in indexer.__dict__, "closing the engine gives the indexer its own forward back"


@pytest.mark.timeout(300)
def test_compile_model_serves_latent_attention_eagerly_with_one_warning():
    """The compiled attention op stores and attends without returning the stored contexts a latent
    layer's model expands: such a model runs eagerly (one warning), its tokens unchanged."""
    model = family_sweep.build_tiny("deepseek_v3")
    prompts = family_sweep.prompts()
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    with pytest.warns(RuntimeWarning, match="multi-head latent attention"):
        eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=16), compile_model=True))
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        assert [h.result(timeout=300).output_token_ids for h in handles] == refs
    finally:
        eng.close()


def _gemma4_sharing_kv():
    """A tiny Gemma 4 whose last two layers reuse the K/V of the last earlier layer of their kind
    (``num_kv_shared_layers``), with global layers of their own head size."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=256,
        sliding_window=8,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.timeout(600)
def test_layers_sharing_kv_read_their_source_layers_pools():
    model = _gemma4_sharing_kv()
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    prompts = family_sweep.prompts() * 2
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=14, swap_space_gib=0.01),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, preemption_mode="swap"),
    )
    outs, stats = _serve(model, prompts, cfg)
    assert outs == refs
    assert stats.num_preemptions > 0
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=3)))
    try:
        cache = eng.cache
        # Layers 2 and 3 read the pools of layers 0 (sliding) and 1 (full): no bytes of their own.
        assert cache.key_cache[2] is cache.key_cache[0] and cache.value_cache[3] is cache.value_cache[1]
        assert [tuple(k.shape) for k in cache.key_cache] == [(3, 4, 2, 16), (3, 4, 2, 32)] * 2
        spec = cache.spec
        assert spec.bytes_per_block == spec.layer_block_bytes(0) + spec.layer_block_bytes(1)
        assert spec.layer_block_bytes(0) == 4 * 2 * (16 + 16) * 4
    finally:
        eng.close()


@pytest.mark.timeout(300)
def test_a_layer_attending_without_storing_fails_at_the_first_step():
    """A layer whose attention runs with no K/V stored right before would read stale slots of its
    pool: the step fails in one line instead of serving a wrong token. (Which of the two messages
    depends on layer 0: through its own forward it leaves a record of the K/V it stored, which the
    message then names; the fused decoder-layer step stores without one.)"""
    from hf_contbatch.engine.llm_engine import EngineError

    model = family_sweep.build_tiny("llama")
    layer = model.model.layers[1].self_attn
    forward = layer.forward

    def forward_without_cache(*args, **kwargs):
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        return forward(*args, **kwargs)

    layer.forward = forward_without_cache
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    try:
        handle = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
        with pytest.raises(EngineError, match="without storing its K/V") as err:
            handle.result(timeout=60)
        assert isinstance(err.value.__cause__, ValueError) and "\n" not in str(err.value.__cause__)
    finally:
        eng.close()
