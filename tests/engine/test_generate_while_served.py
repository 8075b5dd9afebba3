"""While an engine serves a model, the model's own ``generate`` runs its previous attention (with its
causal, padding and sliding-window masks) and gives what it gave before the engine existed; the
engine's own steps build no dense mask."""

from __future__ import annotations

import pytest
import torch
import transformers.masking_utils as masking_utils

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams

from conftest import build_model, random_prompts, reference_greedy

NEW = 10


def _batched_greedy(model, prompts):
    """Greedy generate of all prompts in one left-padded batch (float32)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[:, width:].tolist()


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("mistral", "sdpa"), ("mistral", "eager")])
def test_generate_while_an_engine_is_open_equals_generate_before(family, attn, monkeypatch):
    model = build_model(family)
    model.set_attn_implementation(attn)
    # lengths beyond mistral's 8-token window, and unequal so the batch is padded
    prompts = random_prompts([3, 12, 21], seed=5)
    before = _batched_greedy(model, prompts)
    singles = [reference_greedy(model, p, NEW) for p in prompts]
    engine = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)))
    try:
        assert model.config._attn_implementation != attn  # switched to ours
        assert _batched_greedy(model, prompts) == before
        # The engine's steps: transformers' mask code exits at once with no mask, where it runs.
        masks = []
        preprocess = masking_utils._preprocess_mask_arguments

        def spy(*args, **kwargs):
            result = preprocess(*args, **kwargs)
            masks.append((result[0], result[1]))
            return result

        monkeypatch.setattr(masking_utils, "_preprocess_mask_arguments", spy)
        outs = [engine.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        assert [h.result(300).output_token_ids for h in outs] == singles
        # The fused model forward (Llama form, fuse_model_ops) calls no mask function at all.
        fused = engine.patches.fused_model is not None and engine.patches.fused_model.installed
        assert (fused or masks) and all(early and mask is None for early, mask in masks)
        monkeypatch.undo()
        assert _batched_greedy(model, prompts) == before  # still, after the engine's steps
    finally:
        engine.close()
    assert model.config._attn_implementation == attn
    assert _batched_greedy(model, prompts) == before


@pytest.mark.timeout(1500)
def test_two_engines_on_one_model_and_generate_between():
    model = build_model("qwen2")
    prompts = random_prompts([4, 9], seed=6)
    before = _batched_greedy(model, prompts)
    singles = [reference_greedy(model, p, NEW) for p in prompts]
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32))
    first, second = LLMEngine(model, cfg), LLMEngine(model, cfg)
    try:
        assert _batched_greedy(model, prompts) == before
        first.close()  # the other engine still serves the model
        assert _batched_greedy(model, prompts) == before
        outs = [second.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        assert [h.result(300).output_token_ids for h in outs] == singles
    finally:
        first.close()
        second.close()
    assert _batched_greedy(model, prompts) == before
