"""The engine with an int8 KV cache (``CacheConfig(dtype="int8")``), end to end.

References: transformers' ``generate`` with an attention function that quantizes and dequantizes
K/V by the scheme's definition (symmetric, absmax / 127 per token and KV head, written here in
plain torch) - the int8 cache's semantics without any of its code - and plain ``generate`` for the
agreement the int8 cache costs; the engine against itself (int8) with and without preemption
(swap, recompute), chunked prefill, prefix caching and forks (copy-on-write); perplexity of a
held-out text from the engine's prompt log-probs, int8 vs float cache.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

from conftest import build_model, random_prompts, reference_greedy

LENGTHS = [1, 5, 17, 33, 64, 40, 9]
NEW = 16
TEXT = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tasks" / "pydoc_text.jsonl"


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` quantized to int8 per row (scale = absmax / 127) and back."""
    x32 = x.float()
    s = x32.abs().amax(-1, keepdim=True) / 127
    return (torch.round(x32 / torch.where(s > 0, s, torch.ones_like(s))).clamp(-127, 127) * s).to(x.dtype)


def _int8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    # key/value [B, KVH, S, D]: every cached token-head row quantized on its own, as the cache stores it.
    return sdpa_attention_forward(module, query, _fake_quant(key), _fake_quant(value), attention_mask, **kwargs)


AttentionInterface.register("test_int8_kv_sdpa", _int8_kv_sdpa)
AttentionMaskInterface.register("test_int8_kv_sdpa", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks (windows too)


def int8_reference_greedy(model, prompt, new):
    """``generate`` with K/V quantized and dequantized on every read (greedy, EOS ignored)."""
    before = model.config._attn_implementation
    model.set_attn_implementation("test_int8_kv_sdpa")
    try:
        return reference_greedy(model, prompt, new)
    finally:
        model.set_attn_implementation(before)


def _cfg(num_blocks=256, block_size=4, mode="recompute", swap_gib=None, budget=2048, max_seqs=8, prefix=True):
    return EngineConfig(
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            dtype="int8",
            swap_space_gib=swap_gib,
            enable_prefix_caching=prefix,
        ),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, preemption_mode=mode),
    )


def _run(model, prompts, cfg, new=NEW, **submit):
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=new), **submit) for p in prompts]
        outs = [[h.result(600).output_token_ids for h in (hs if isinstance(hs, list) else [hs])] for hs in handles]
        assert eng.wait_idle(10)
        eng.block_manager.check_invariants()
        eng.host_block_manager.check_invariants()
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks  # no leak
        return outs, stats
    finally:
        eng.close()


def _agreement(outs, refs) -> float:
    pairs = [(a, b) for o, r in zip(outs, refs) for a, b in zip(o, r)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_int8_greedy_equals_generate_over_quantized_kv_and_stays_close_to_float(family):
    model = build_model(family)
    prompts = random_prompts(LENGTHS, seed=3)
    outs, stats = _run(model, prompts, _cfg())
    outs = [o[0] for o in outs]
    assert stats.kv_cache_dtype == "int8"
    # The int8 cache computes what generate computes over K/V quantized the same way.
    assert outs == [int8_reference_greedy(model, p, NEW) for p in prompts]
    # Against the float model it may flip an argmax late on these flat-logit random models.
    plain = [reference_greedy(model, p, NEW) for p in prompts]
    assert _agreement(outs, plain) >= 0.8


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode,swap_gib", [("swap", 0.01), ("recompute", 0)])
def test_preemption_and_chunked_prefill_do_not_change_int8_outputs(mode, swap_gib):
    model = build_model("llama")
    prompts = random_prompts(LENGTHS, seed=3)
    roomy, _ = _run(model, prompts, _cfg())
    # 22 blocks of 4 = 88 tokens for 7 requests of up to 80; a 24-token budget chunks the long prompts.
    tight, stats = _run(model, prompts, _cfg(num_blocks=22, mode=mode, swap_gib=swap_gib, budget=24, max_seqs=4))
    assert tight == roomy
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in == stats.num_blocks_swapped_out


@pytest.mark.timeout(1500)
def test_prefix_hits_and_forks_with_copy_on_write_keep_int8_outputs():
    model = build_model("llama")
    system = random_prompts([21], seed=7)[0]  # 5 full blocks of 4 shared, a partial one copied on fork
    prompts = [system + p for p in random_prompts([3, 6, 1], seed=8)]
    alone = [_run(model, [p], _cfg(prefix=False))[0][0][0] for p in prompts]
    shared, stats = _run(model, prompts, _cfg(), num_return_sequences=3)
    assert shared == [[a] * 3 for a in alone]
    assert stats.prefix_cache_hit_tokens > 0 and stats.num_forks > 0


def _prompt_nll(engine, ids):
    """Sum of -log p(token | before) over ``ids[1:]`` and the count, from the engine's prompt log-probs."""
    sp = SamplingParams(max_new_tokens=1, prompt_logprobs=1, score_token_id=ids[-1])
    h = engine.submit(ids[:-1], sp)
    h.result(600)
    scored = h.request.prompt_logprobs[1:]
    assert len(scored) == len(ids) - 1 and all(x is not None for x in scored)
    return -sum(lp for lp, _ in scored), len(scored)


@pytest.mark.timeout(1500)
def test_int8_cache_perplexity_of_held_out_text_within_two_percent_of_the_float_cache():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_contbatch.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    text = " ".join(json.loads(line)["text"] for line in TEXT.read_text().splitlines())
    ids = tok(text)["input_ids"][:512]
    ppl = {}
    for dtype in (None, "int8"):
        eng = LLMEngine(model, EngineConfig(cache=CacheConfig(dtype=dtype, num_blocks=64)))
        try:
            nll, n = _prompt_nll(eng, ids)
        finally:
            eng.close()
        ppl[dtype] = math.exp(nll / n)
    assert abs(ppl["int8"] / ppl[None] - 1) < 0.02, ppl
