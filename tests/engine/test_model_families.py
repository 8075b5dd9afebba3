"""Families transformers ships, served exactly or refused in one line.

Greedy tokens equal transformers' own ``generate`` (float32, CPU) for a curated set of decoder-only
families, each a tiny random model built from its type's own config class by
``scripts/family_sweep.py`` (which walks the whole ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``): one per
way of building attention the engine must get right (Conv1D linears, MQA, parallel blocks, learned
positions, partial rotary, QK norms, soft-capping, sliding windows mixed with global layers, MoE
routers, attention sinks, decoder layers that drop the forward's kwargs, windows applied through
the mask alone, multi-head latent attention, per-layer K/V shapes, heads picked from the stored
K/V after ``cache.update``, one module attending as several cache layers, chunked local attention,
sparse attention's indexer selecting keys).
Models the engine cannot serve get a one-line ``ValueError`` naming the layer kind, raised before
any weight is touched (the refusal tests build their models on the meta device, where touching a
weight would fail); an attention call asking for something the paged kernels do not do fails at
the first step instead of giving a wrong token (``tests/kernels/test_served_call.py``).
"""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

from conftest import load_family_sweep, reference_greedy, serve_greedy

family_sweep = load_family_sweep()

FAMILIES = [
    "gpt2",  # Conv1D linears (transposed weights), learned absolute positions
    "gpt_bigcode",  # multi-query attention (config.multi_query), Conv1D-free fused c_attn
    "gpt_neox",  # parallel attention/MLP, partial rotary
    "gptj",  # parallel block, interleaved partial rotary
    "phi",  # parallel block, partial rotary, dense LayerNorm
    "opt",  # learned positions with an offset
    "starcoder2",  # sliding window, biases
    "stablelm",  # partial rotary, serves without the _supports_attention_backend flag
    "cohere",  # parallel block, QK LayerNorm, logit scale
    "cohere2",  # sliding and global layers mixed (layer_types)
    "gemma3_text",  # sliding/global layers, QK RMSNorm, soft-capping off
    "olmo",  # non-parametric LayerNorm, QKV clipping
    "olmo3",  # sliding/global layers, QK norms
    "exaone",  # a Llama clone under its own model type
    "internlm3",  # a Llama clone under its own model type
    "granitemoe",  # MoE with multipliers
    "nemotron",  # decoder layers that drop the forward's kwargs (attention finds the step anyway)
    "phimoe",  # sparsemixer router; sliding window applied through the mask alone
    "glm4",  # sandwich norms, partial rotary
    "ernie4_5_moe",  # MoE with shared experts
    "hunyuan_v1_moe",  # MoE, QK norms
    "dots1",  # MoE with grouped top-k routing
    "biogpt",  # BART-style attention through the interface, learned positions
    "vaultgemma",  # Gemma-style soft-capping
    "gpt_oss",  # attention sinks (s_aux), sliding and full layers, MoE
    "granitemoe_swa",  # attention sinks with sliding windows
    # Recurrent layers (a state slot per request; tests/engine/test_recurrent_state.py has more):
    "falcon_mamba",  # Mamba mixers only, no attention layer at all
    "qwen3_5_moe_text",  # gated delta-net linear attention, full attention, MoE
    "olmo_hybrid",  # gated delta-net layers whose projections are not K/V of the pool
    "minimax",  # lightning attention through a cache class of its own (MiniMaxCache)
    "mamba2",  # Mamba 2's chunked scan (family_sweep.HAND_TINY builds these four)
    "jamba",  # Mamba and attention layers, MoE every other layer
    "nemotron_h",  # Mamba 2, attention and MLP layers
    "falcon_h1",  # 'hybrid' layers: Mamba 2 and attention side by side in one layer
    "inkling_text",  # short convolutions over K/V (conv states), a relative position bias (position_bias)
    "inkling2_text",  # per-query attention sinks (sinks), dynamic convolutions, K/V projections of its own
    "inkling2_loop_text",  # a layer run in two passes, the second with cache layers of its own
    "deepseek_v2",  # multi-head latent attention: the pool holds transformers' latents (K and V of other sizes)
    "deepseek_v3",  # MLA, interleaved rotary, MoE with grouped routing
    "glm4_moe_lite",  # MLA
    "minicpm3",  # MLA with standard rotary
    "sarvam_mla",  # MLA
    "youtu",  # MLA
    "axk1",  # MLA
    "gemma4_text",  # per-layer head sizes and KV heads (global layers of 512-channel heads)
    "gemma4_unified_text",  # per-layer head sizes and KV heads
    "mimo_v2_flash",  # sliding layers with twice the KV heads and sinks; V heads of their own size
    "diffllama",  # two attention calls over the halves of V, tiled after cache.update (head maps)
    "jetmoe",  # K/V repeated per attention expert after cache.update (head maps)
    "hrm_text",  # one module attends as several cache layers (recurrent cycles)
    "llama4_text",  # chunked and NoPE layers at the default chunk (the chunk itself: below)
    # Sparse attention (an indexer's top-k of index_topk=4 keys, fewer than either prompt):
    "deepseek_v32",  # MLA with an indexer caching keys of its own
    "glm_moe_dsa",  # a second layer reusing the first's top-k (indexer_types "shared")
    "axk2",  # DSA indexer, MoE
    "hy_v4",  # DSA indexer, a shared-top-k layer
    # Layers keeping state in a cache class of their own (engine.own_cache_runner):
    "deepseek_v4",  # compressed K=V entries (rates 4 and 8), an indexer's top-k of them, sliding window
]
NEW = 16


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_greedy_equals_generate(model_type):
    model = family_sweep.build_tiny(model_type)
    prompts = family_sweep.prompts()  # 5 and 23 tokens: the 23-token one spans two blocks of 16
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, stats = serve_greedy(model, prompts, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32)), NEW)
    assert outs == refs
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "model_type",
    [
        "gpt2",
        "gpt_bigcode",
        "cohere2",
        "phimoe",
        "gpt_oss",
        "deepseek_v3",
        "gemma4_text",
        "mimo_v2_flash",
        "deepseek_v32",
    ],
)
def test_family_greedy_equals_generate_under_preemption_and_chunked_prefill(model_type):
    model = family_sweep.build_tiny(model_type)
    prompts = family_sweep.prompts() * 2
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    # 14 blocks of 4 tokens = 56 tokens for 4 requests of 21-39 tokens; a 12-token budget forces chunks.
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=14),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12),
    )
    outs, stats = serve_greedy(model, prompts, cfg, NEW)
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_type", ["gemma3_text", "exaone4", "olmo3"])
def test_qk_norm_families_one_request_at_a_time(model_type):
    """One row per decode step: a QK norm then runs on a ``[1, H, 1, D]`` view (the fused RMSNorm
    once crashed on it: the size-1 dim's stride)."""
    model = family_sweep.build_tiny(model_type)
    prompts = family_sweep.prompts()
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=1))
    outs, _ = serve_greedy(model, prompts, cfg, NEW)
    assert outs == refs


def _tiny_llama4_text():
    """Llama 4's text model with a chunk of 8 tokens (the prompts and their 16 new tokens span up to
    5 chunks) in its RoPE layer 0, and a NoPE full-attention layer 1 whose attention temperature
    tuning starts at position 1 (``floor_scale`` 2; the default 8192 never changes a tiny run)."""
    from transformers import AutoModelForCausalLM

    cfg = family_sweep.tiny_config("llama4_text")
    cfg.attention_chunk_size, cfg.no_rope_layers, cfg.floor_scale, cfg.attn_scale = 8, [1, 0], 2, 4.0
    assert cfg.layer_types == ["chunked_attention", "full_attention"]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "cfg",
    [
        EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32)),
        EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=1)),
        # 14 blocks of 4 tokens for 4 requests of 21-39 tokens and a 12-token budget: preemption, chunks.
        EngineConfig(
            cache=CacheConfig(block_size=4, num_blocks=14),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12),
        ),
    ],
    ids=["batched", "one-row-steps", "preempted-chunked"],
)
def test_chunked_local_attention_llama4_text_equals_generate(cfg):
    model = _tiny_llama4_text()
    prompts = family_sweep.prompts() * (2 if cfg.scheduler.max_num_batched_tokens == 12 else 1)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, stats = serve_greedy(model, prompts, cfg, NEW)
    assert outs == refs
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    if cfg.scheduler.max_num_batched_tokens == 12:
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"


def _meta_model(model_type):
    """A tiny model of ``model_type`` whose weights live on the meta device: reading one fails."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family_sweep.tiny_config(model_type)).eval()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "model_type, kind",
    [
        ("rwkv", "AttentionInterface"),  # recurrent layers with a state outside transformers' Cache
        ("xlnet", "AttentionInterface"),  # legacy attention over a memory of its own (mems), no KV cache
    ],
)
def test_unserved_layer_kind_is_refused_in_one_line_before_any_weight_is_touched(model_type, kind):
    model = _meta_model(model_type)
    with pytest.raises(ValueError) as err:
        LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    message = str(err.value)
    assert "\n" not in message
    assert f"model type {model_type!r}" in message and kind in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "model_type, targets",
    [
        ("gpt2", ["c_attn", "c_proj"]),
        ("gpt_neox", ["query_key_value", "dense"]),
        ("phi", ["q_proj", "v_proj", "fc1"]),
        # Recurrent layers: decodes reach the adapters as a [B, 1] batch (engine.recurrent_runner).
        ("qwen3_next", ["q_proj", "in_proj_qkvz", "out_proj"]),
        ("mamba", ["in_proj", "x_proj"]),
    ],
)
def test_lora_adapter_over_a_family_equals_peft(model_type, targets):
    """Per-request LoRA serves each family's own linears, GPT-2's Conv1D ones included (PEFT's
    ``fan_in_fan_out``): greedy tokens equal the PEFT model's own ``generate`` with the adapter on."""
    peft = pytest.importorskip("peft")
    base = family_sweep.build_tiny(model_type)
    torch.manual_seed(3)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, fan_in_fan_out=model_type == "gpt2"
    )
    model = peft.get_peft_model(base, lora, adapter_name="a").eval()
    prompts = family_sweep.prompts()
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32)))
    try:
        handles = [
            eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True, adapter_name="a")) for p in prompts
        ]
        assert [h.result(timeout=60).output_token_ids for h in handles] == refs
    finally:
        eng.close()
