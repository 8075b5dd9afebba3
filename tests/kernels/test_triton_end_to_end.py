"""The engine with the Triton kernels forced (interpreted on CPU) still equals transformers' greedy
generate token for token, with a chunked prefill in the run (16-token budget, 21-token prompt)."""

from __future__ import annotations

import pytest

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.kernels.attention.triton_kernels import TRITON_AVAILABLE

from conftest import build_model, load_family_sweep, random_prompts, reference_greedy

pytestmark = pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed on this platform")


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_triton_backend_greedy_equals_generate(family):
    model = build_model(family)
    prompts = random_prompts([3, 13, 21], seed=11)
    refs = [reference_greedy(model, p, 6) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=7),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3),
        attention_backend="triton",
    )
    eng = LLMEngine(model, cfg)
    try:
        assert eng.backend.name == "triton"
        outs = [
            h.result(1200).output_token_ids for h in [eng.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
        ]
        assert eng.wait_idle(10)
        assert eng.stats().num_free_blocks == 7
    finally:
        eng.close()
    assert outs == refs


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("model_type", ["llama4_text", "jetmoe"])
def test_triton_engine_steps_aside_for_chunks_and_head_maps(model_type):
    """A Triton engine serves the layers its kernels have no mask or head map for through the torch
    path (plain torch on the kernels' device): Llama 4's chunked layers (a chunk of 8 tokens here)
    and JetMoE's K/V repeated per expert, greedy equal to generate."""

    import torch
    from transformers import AutoModelForCausalLM

    family_sweep = load_family_sweep()
    cfg = family_sweep.tiny_config(model_type)
    if model_type == "llama4_text":
        cfg.attention_chunk_size = 8
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    prompts = random_prompts([3, 13, 21], seed=11, vocab=family_sweep.VOCAB)
    refs = [reference_greedy(model, p, 6) for p in prompts]
    eng = LLMEngine(
        model,
        EngineConfig(
            cache=CacheConfig(block_size=8, num_blocks=12),
            scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3),
            attention_backend="triton",
        ),
    )
    try:
        assert eng.backend.name == "triton"
        handles = [eng.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
        outs = [h.result(1200).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        assert eng.stats().num_free_blocks == 12
    finally:
        eng.close()
    assert outs == refs
