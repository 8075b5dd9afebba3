"""Weights a quantization leaves float are said loudly and counted: a Mixtral (4 experts, top-2)
under ``quantization="int8"`` keeps its 3-D expert weights and its router in float (the int8
kernels serve ``nn.Linear`` only); the engine warns naming them, and the stats and the quality
report carry their bytes and share. Expected figures: arithmetic over the config's shapes (float32:
4 bytes a value); expected tokens: transformers' ``generate`` on a plain-torch copy whose linears
hold ``Wq * s`` and whose experts stay as they are."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from test_quality_report import _Tok
from test_quantized_models import dequantized_copy

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, quality_report
from hf_contbatch.kernels.linears.unquantized import FloatWeightsWarning

from conftest import build_model, random_prompts, reference_greedy

pytestmark = pytest.mark.timeout(300)
H, I, E, LAYERS, VOCAB = 64, 96, 4, 2, 512
CFG = EngineConfig(quantization="int8", cache=CacheConfig(num_blocks=64, block_size=4))


def _mixtral():
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=E,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=None,
    )
    return tf.MixtralForCausalLM(cfg).eval()


# By arithmetic: per layer, the experts' gate_up [E, 2I, H] and down [E, H, I], and the router [E, H].
EXPERT_BYTES = LAYERS * (E * 2 * I * H + E * H * I) * 4
ROUTER_BYTES = LAYERS * E * H * 4
HEAD_DIM = H // 4
ATTENTION = H * 4 * HEAD_DIM + 2 * H * 2 * HEAD_DIM + 4 * HEAD_DIM * H  # q, k, v, o
MODEL_BYTES = 4 * (2 * VOCAB * H + LAYERS * (ATTENTION + 2 * H + E * H + E * 3 * I * H) + H)  # untied head


def test_int8_on_a_mixtral_warns_and_counts_the_float_experts():
    model = _mixtral()
    assert sum(p.numel() * 4 for p in model.parameters()) == MODEL_BYTES  # the arithmetic above
    prompt = random_prompts([9], seed=2)[0]
    want = reference_greedy(dequantized_copy(model), prompt, 6)  # experts float, linears Wq * s
    with pytest.warns(FloatWeightsWarning) as caught:
        eng = LLMEngine(model, CFG)
    try:
        message = str(caught[0].message)
        assert "quantization='int8' leaves 6 weight tensors in float" in message
        assert "model.layers.0.mlp.experts.gate_up_proj" in message and "mixture of experts" in message
        fraction = (EXPERT_BYTES + ROUTER_BYTES) / MODEL_BYTES
        assert f"{100 * fraction:.1f}% of the model's" in message
        stats = eng.stats()
        assert stats.weight_format == "int8"
        assert stats.unquantized_weight_bytes == EXPERT_BYTES + ROUTER_BYTES
        assert stats.unquantized_weight_fraction == pytest.approx(fraction)
        assert set(stats.unquantized_weights) == {
            f"model.layers.{i}.mlp.{name}"
            for i in range(LAYERS)
            for name in ("experts.gate_up_proj", "experts.down_proj", "gate.weight")
        }
        out = eng.submit(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True)).result(120)
        assert out.output_token_ids == want
    finally:
        eng.close()


def test_a_dense_model_under_int8_leaves_no_weight_float_and_a_float_engine_counts_nothing():
    model = build_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FloatWeightsWarning)
        for cfg in (CFG, EngineConfig(cache=CacheConfig(num_blocks=64, block_size=4))):
            eng = LLMEngine(model, cfg)
            try:
                stats = eng.stats()
                assert (stats.unquantized_weights, stats.unquantized_weight_bytes) == ((), 0)
                assert stats.weight_format == (cfg.quantization or "float32")
            finally:
                eng.close()


def test_the_quality_report_counts_the_float_experts():
    model = _mixtral()
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    text = " ".join(map(str, ids[0].tolist()))
    report = quality_report(model, _Tok(), text=text, prompt_tokens=8, greedy_tokens=4, kv_cache_dtype=None)
    assert report.unquantized_weight_bytes == EXPERT_BYTES + ROUTER_BYTES
    assert report.unquantized_weight_fraction == pytest.approx((EXPERT_BYTES + ROUTER_BYTES) / MODEL_BYTES)
    assert len(report.unquantized_weights) == 3 * LAYERS
    line = report.lines()[1]
    assert line.startswith("weights left float by int8 (in both figures): 6 tensors") and "experts" in line


def test_a_second_int8_engine_on_the_model_reports_the_first_ones_figures():
    # The second engine runs the int8 linears the first installed: they are not float for it.
    model = _mixtral()
    with pytest.warns(FloatWeightsWarning):
        first = LLMEngine(model, CFG)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = LLMEngine(model, CFG)
        try:
            said = [str(w.message) for w in caught if w.category is FloatWeightsWarning]
            assert len(said) == 1 and "leaves 6 weight tensors in float" in said[0], said
            assert second.stats().unquantized_weight_bytes == EXPERT_BYTES + ROUTER_BYTES
        finally:
            second.close()
    finally:
        first.close()
