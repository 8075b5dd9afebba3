"""One weight format per model object: an engine changes the model's linears in place, so a second
engine of another format on the same model is refused (naming both formats and the way out, a copy
of the model) in either order, with nothing changed; copies made beforehand serve each format side
by side; engines of one format share the linears until the last closes. Expected values: greedy
tokens and log-probs of transformers' ``generate`` on plain-torch copies (the float model, or one
whose linears hold ``Wq * s``)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_quantized_models import dequantized_copy

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams

from conftest import build_model, random_prompts

pytestmark = pytest.mark.timeout(300)
NEW = 6
FLOAT = EngineConfig(cache=CacheConfig(num_blocks=64, block_size=4))
INT8 = EngineConfig(quantization="int8", cache=CacheConfig(num_blocks=64, block_size=4))
W8A8 = EngineConfig(quantization="w8a8", cache=CacheConfig(num_blocks=64, block_size=4))


def _generate(model, prompt):
    """(greedy tokens, log-prob of each) from transformers' ``generate`` on the prompt alone."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, len(prompt) :]
    return new.tolist(), torch.stack([torch.log_softmax(s[0], -1)[t] for s, t in zip(out.scores, new)])


def _served(engine, prompt):
    out = engine.submit(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=0)).result(120)
    return out.output_token_ids, torch.tensor(out.logprobs)


def _assert_serves(engine, prompt, reference):
    tokens, logprobs = _served(engine, prompt)
    want_tokens, want_logprobs = reference
    assert tokens == want_tokens
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-4, rtol=0)


def _forwards(model):
    """Each linear's instance forward (None: its class's), by name: what an engine installs."""
    return {n: m.__dict__.get("forward") for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _alone(model, cfg, prompt):
    """What an engine of ``cfg`` serves on a copy of ``model`` that no other engine touches."""
    eng = LLMEngine(copy.deepcopy(model), cfg)
    try:
        return _served(eng, prompt)
    finally:
        eng.close()


@pytest.mark.parametrize(
    "first, second", [(FLOAT, W8A8), (W8A8, FLOAT), (INT8, W8A8)], ids=["float,w8a8", "w8a8,float", "int8,w8a8"]
)
def test_a_second_format_on_one_model_is_refused_and_the_first_keeps_serving(first, second):
    model = build_model("llama")
    pristine = copy.deepcopy(model)  # before any engine: the copy the error message asks for
    prompt = random_prompts([9], seed=3)[0]
    if first.quantization == "w8a8":  # its plain-torch reference is tests/kernels/test_w8a8_serving's
        reference = _alone(model, first, prompt)
    else:
        reference = _generate(pristine if first.quantization is None else dequantized_copy(pristine), prompt)
    eng = LLMEngine(model, first)
    try:
        installed = _forwards(model)
        with pytest.raises(
            ValueError, match=r"already served by an open engine with (float32|int8|w8a8) linears"
        ) as err:
            LLMEngine(model, second)
        message = str(err.value)
        assert f"as {second.quantization or 'float32'}" in message and "copy.deepcopy(model)" in message
        assert _forwards(model) == installed  # the refusal changed nothing
        assert eng.patches.weight_format == (first.quantization or "float32")
        _assert_serves(eng, prompt, reference)
        # The copy made beforehand serves the second format beside the first engine, as alone.
        want = _generate(pristine, prompt) if second.quantization is None else _alone(pristine, second, prompt)
        other = LLMEngine(pristine, second)
        try:
            _assert_serves(other, prompt, want)
        finally:
            other.close()
    finally:
        eng.close()
    assert all(f is None for f in _forwards(model).values())
    # Closed, the model takes the other format.
    again = LLMEngine(model, second)
    try:
        assert again.patches.weight_format == (second.quantization or "float32")
        assert len(_served(again, prompt)[0]) == NEW
    finally:
        again.close()


@pytest.mark.parametrize("first_closed", ["first_opened", "last_opened"])
def test_int8_engines_on_one_model_serve_int8_until_the_last_closes(first_closed):
    model = build_model("llama")
    prompt = random_prompts([8], seed=4)[0]
    int8_reference = _generate(dequantized_copy(model), prompt)
    float_reference = _generate(copy.deepcopy(model), prompt)
    a = LLMEngine(model, INT8)
    b = LLMEngine(model, INT8)
    closing, staying = (a, b) if first_closed == "first_opened" else (b, a)
    try:
        closing.close()
        _assert_serves(staying, prompt, int8_reference)  # not the float weights closing put back
    finally:
        staying.close()
    assert all(f is None for f in _forwards(model).values())
    tokens, logprobs = _generate(model, prompt)
    assert tokens == float_reference[0]
    torch.testing.assert_close(logprobs, float_reference[1], atol=0, rtol=0)  # restored bit for bit


def test_a_copy_made_while_an_engine_serves_the_model_is_refused_until_copied_from_a_closed_one():
    model = build_model("llama")
    prompt = random_prompts([7], seed=5)[0]
    reference = _generate(dequantized_copy(model), prompt)
    eng = LLMEngine(model, FLOAT)
    try:
        served_copy = copy.deepcopy(model)  # carries the float engine's packed forwards
        with pytest.raises(ValueError, match=r"a copy .* of a model an open engine serves.*before building"):
            LLMEngine(served_copy, INT8)
    finally:
        eng.close()
    clean = LLMEngine(copy.deepcopy(model), INT8)  # copied after close: nothing carried
    try:
        _assert_serves(clean, prompt, reference)
    finally:
        clean.close()
