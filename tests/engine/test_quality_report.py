"""The quality report's arithmetic against a plain-torch computation on the same model."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch

from hf_contbatch import quality_report

from conftest import build_model


class _Tok:
    """A tokenizer of space-separated integers (ids of the tiny models)."""

    def __call__(self, text, return_tensors=None, truncation=False, max_length=None):
        ids = [int(t) for t in text.split()][: max_length if truncation else None]

        class Out:
            input_ids = torch.tensor([ids])

        return Out()


def _plain_int8(model):
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                w = m.weight.detach()
                s = w.abs().amax(1, keepdim=True) / 127
                m.weight = torch.nn.Parameter(torch.where(s > 0, w / s, 0.0).round().clamp(-127, 127) * s)
    return ref


def _ppl(model, ids):
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    logp = torch.log_softmax(logits.double(), -1)
    nll = -sum(float(logp[i, ids[0, i + 1]]) for i in range(ids.shape[1] - 1)) / (ids.shape[1] - 1)
    return math.exp(nll)


@pytest.mark.timeout(600)
def test_quality_report_matches_plain_torch():
    model = build_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 512, (1, 60), generator=g)
    text = " ".join(map(str, ids[0].tolist()))
    report = quality_report(model, _Tok(), text=text, prompt_tokens=10, greedy_tokens=8, kv_cache_dtype=None)
    assert report.tokens == 60 and report.quantization == "int8"
    assert report.ppl_float == pytest.approx(_ppl(model, ids), rel=1e-5)
    assert report.ppl_quantized == pytest.approx(_ppl(_plain_int8(model), ids), rel=1e-5)
    assert report.ppl_change == pytest.approx(report.ppl_quantized / report.ppl_float - 1)
    assert 0 <= report.greedy_agreement <= 8
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match=r"`quantization` must be one of \('int8', 'w8a8'\), got 'int3'"):
        quality_report(model, _Tok(), quantization="int3", text=text)


def _plain_w8a8(model):
    """Every linear computes ``(round(x / sx) @ Wq.T) * sx * s`` in float64 (``sx``: absmax of the
    input row / 127), its weight fake-quantized as in :func:`_plain_int8`."""
    ref = _plain_int8(model)

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1]).double()
        amax = x2.abs().amax(1, keepdim=True)
        sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        y = torch.nn.functional.linear(torch.round(x2 / sx).clamp(-127, 127) * sx, self.weight.double())
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    for m in ref.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = types.MethodType(forward, m)
    return ref


@pytest.mark.timeout(600)
def test_the_w8a8_report_matches_plain_torch_with_rounded_activations():
    model = build_model("llama")
    ids = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(8))
    text = " ".join(map(str, ids[0].tolist()))
    report = quality_report(
        model, _Tok(), quantization="w8a8", text=text, prompt_tokens=10, greedy_tokens=8, kv_cache_dtype=None
    )
    assert report.quantization == "w8a8"
    assert report.ppl_quantized == pytest.approx(_ppl(_plain_w8a8(model), ids), rel=1e-4)
    assert report.ppl_quantized != pytest.approx(_ppl(_plain_int8(model), ids), rel=1e-7)  # x was rounded
    assert all("forward" not in m.__dict__ for m in model.modules())


def _leading_equal(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.timeout(1500)
def test_the_kv_cache_figures_match_plain_torch_over_float_and_quantized_kv():
    """The KV cache's figures against transformers' own forward and generate: plain, and with an
    attention function that quantizes and dequantizes K/V by the scheme's definition (written in the
    int8 KV tests in plain torch, none of the cache's code)."""
    from test_int8_kv_engine import int8_reference_greedy

    from conftest import reference_greedy

    model = build_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 512, (1, 50), generator=g)
    text = " ".join(map(str, ids[0].tolist()))
    report = quality_report(model, _Tok(), text=text, prompt_tokens=10, greedy_tokens=8)
    assert report.kv_cache_dtype == "int8"
    assert report.kv_ppl_float == pytest.approx(_ppl(model, ids), rel=1e-4)
    previous = model.config._attn_implementation
    model.set_attn_implementation("test_int8_kv_sdpa")
    try:
        want_int8 = _ppl(model, ids)
    finally:
        model.set_attn_implementation(previous)
    assert report.kv_ppl_quantized == pytest.approx(want_int8, rel=1e-4)
    assert report.kv_ppl_change == pytest.approx(report.kv_ppl_quantized / report.kv_ppl_float - 1)
    prompt = ids[0, :10].tolist()
    want_agree = _leading_equal(reference_greedy(model, prompt, 8), int8_reference_greedy(model, prompt, 8))
    assert report.kv_greedy_agreement == want_agree
    lines = report.lines()
    assert len(lines) == 2 and lines[0].startswith("weights: ") and lines[1].startswith("KV cache: ")
    assert f"int8 {report.kv_ppl_quantized:.4f}" in lines[1] and f"the first {want_agree} of 8 tokens equal" in lines[1]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match=r"`kv_cache_dtype` must be one of \(None, 'int8'\)"):
        quality_report(model, _Tok(), text=text, kv_cache_dtype="int4")
    weights_only = quality_report(model, _Tok(), text=text, prompt_tokens=10, greedy_tokens=8, kv_cache_dtype=None)
    assert weights_only.kv_ppl_quantized is None and len(weights_only.lines()) == 1


@pytest.mark.timeout(600)
def test_a_model_an_open_engine_serves_is_refused_and_accepted_after_close():
    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine

    model = build_model("llama")
    engine = LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=16), linear_backend="torch"))
    try:
        with pytest.raises(ValueError, match="served by an open pipeline or engine"):
            quality_report(model, text="x", kv_cache_dtype=None)
    finally:
        engine.close()
    # closed: the model is its own again, so the report gets as far as checking the text's length
    one_token = lambda *args, **kwargs: types.SimpleNamespace(input_ids=torch.ones(1, 1, dtype=torch.long))  # noqa: E731
    with pytest.raises(ValueError, match="`text` must have at least 2 tokens"):
        quality_report(model, tokenizer=one_token, text="x", kv_cache_dtype=None)


@pytest.mark.timeout(300)
def test_max_tokens_beyond_the_context_is_clamped_to_it_and_said():
    """A 96-token context and the default ``max_tokens=512`` on a 200-token text: the report scores
    the text's first 96 tokens (plain torch over exactly those as the expectation), says so, and the
    engine's figures come out for the same 96 tokens (no error about a prompt the caller never wrote)."""
    model = build_model("llama", max_position_embeddings=96)
    ids = torch.randint(3, 512, (1, 200), generator=torch.Generator().manual_seed(13))
    text = " ".join(map(str, ids[0].tolist()))
    report = quality_report(model, _Tok(), text=text, prompt_tokens=10, greedy_tokens=8)
    first = ids[:, :96]
    assert report.tokens == 96 and report.clamped_to_context == 96
    assert report.ppl_float == pytest.approx(_ppl(model, first), rel=1e-5)
    assert report.ppl_quantized == pytest.approx(_ppl(_plain_int8(model), first), rel=1e-5)
    assert report.kv_ppl_float == pytest.approx(_ppl(model, first), rel=1e-4)
    assert any("clamped to the model's context of 96 tokens" in line for line in report.lines())
    # A text within the context is not reported as clamped.
    short = quality_report(model, _Tok(), text=" ".join(text.split()[:50]), greedy_tokens=8, kv_cache_dtype=None)
    assert short.tokens == 50 and short.clamped_to_context is None and len(short.lines()) == 1
    with pytest.raises(ValueError, match=r"`greedy_tokens`=90 exceeds the model's context of 96 tokens"):
        quality_report(model, _Tok(), text=text, prompt_tokens=10, greedy_tokens=90, kv_cache_dtype=None)
