"""The fused per-forward work of Llama-form models (``kernels/fused_model``): its rotary table gives
the rotary module's own bits; installed by an engine, greedy tokens equal transformers' generate
(batched, and under preemption and chunked prefill, no block leaked) for Llama, Mistral (sliding
window) and Qwen2; the model's own forward serves what the fast path must not (hooks, a replaced
rotary forward, hidden states asked for, inputs_embeds, calls outside an engine step); two engines
share it and the last close removes it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.kernels.fused_model import FusedCausalLMForward, FusedModelForward, RotaryTable, model_form
from hf_contbatch.kernels.fused_ops import fused_library

from conftest import build_model, random_prompts, reference_greedy, serve_greedy

pytestmark = pytest.mark.skipif(fused_library() is None, reason="no C compiler")

NEW = 10
_PLAIN = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32))
# 14 blocks of 4 tokens for 4 requests of up to 45 tokens and a 12-token budget: preemption and chunks.
_TIGHT = EngineConfig(
    cache=CacheConfig(block_size=4, num_blocks=14),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12),
)


def _rotary(head_dim: int, theta: float = 10000.0):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta, max_position_embeddings=64
    )
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 16, 128])
def test_rotary_table_gives_the_modules_own_bits_on_random_positions(dtype, head_dim):
    rot = _rotary(head_dim)
    table = RotaryTable(rot)
    x = torch.empty(1, 1, 8, dtype=dtype)
    g = torch.Generator().manual_seed(head_dim)
    # Positions past the module's max_position_embeddings and past the table's first rows: it grows.
    for n in (1, 2, 7, 64, 65, 200):
        pos = torch.randint(0, 5000, (1, n), generator=g)
        want = rot(x, pos)  # the module as the model calls it
        got = table(x, pos)
        for w, t in zip(want, got):
            assert t.shape == (1, n, head_dim) and t.dtype == dtype and t.is_contiguous()
            assert torch.equal(t, w)
    assert table.usable  # served from the table, not from the module's forward


def test_rotary_table_is_rebuilt_when_the_module_changes():
    rot = _rotary(32)
    table = RotaryTable(rot)
    x32, x16 = torch.empty(1, 1, 8), torch.empty(1, 1, 8, dtype=torch.bfloat16)
    pos = torch.tensor([[0, 5, 77, 300]])
    assert all(torch.equal(a, b) for a, b in zip(table(x32, pos), rot(x32, pos)))
    with torch.no_grad():
        rot.inv_freq.mul_(0.5)  # written in place (what dynamic rotaries do)
    assert all(torch.equal(a, b) for a, b in zip(table(x32, pos), rot(x32, pos)))
    rot.inv_freq = rot.inv_freq * 3  # replaced
    assert all(torch.equal(a, b) for a, b in zip(table(x32, pos), rot(x32, pos)))
    rot.attention_scaling = 0.75
    assert all(torch.equal(a, b) for a, b in zip(table(x32, pos), rot(x32, pos)))
    got = table(x16, pos)  # another dtype
    assert got[0].dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(got, rot(x16, pos)))


def _serve(model, prompts, cfg):
    seen = {}

    def check(engine):
        fused = engine.patches.fused_model
        seen["fused"] = fused
        seen["served"] = 0 if fused is None else fused.base_forward.served

    outs, stats = serve_greedy(model, prompts, cfg, NEW, check=check, timeout=600)
    return outs, stats, seen["fused"], seen["served"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("cfg", [_PLAIN, _TIGHT], ids=["batched", "preempted-chunked"])
def test_greedy_tokens_equal_generate_with_the_fused_model_forward(family, cfg):
    model = build_model(family)
    assert model_form(model) is model.model
    prompts = random_prompts([1, 7, 30, 45], seed=5)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, stats, fused, served = _serve(model, prompts, cfg)
    assert outs == refs
    assert fused is not None and fused.base_forward.table.usable  # cos/sin from the table
    assert served >= NEW  # every step (at least one per new token) took the fast path
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    if cfg is _TIGHT and family != "mistral":  # Mistral's 8-token window gives blocks back: no pressure
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert not any("forward" in m.__dict__ for m in model.modules())  # all removed by close


@pytest.mark.timeout(600)
def test_a_hook_on_a_bypassed_module_runs_the_models_own_forward():
    model = build_model("llama")
    seen = []
    handle = model.model.norm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        prompts = random_prompts([7, 30], seed=7)
        refs = [reference_greedy(model, p, NEW) for p in prompts]
        seen.clear()
        outs, _, fused, served = _serve(model, prompts, _PLAIN)
    finally:
        handle.remove()
    assert outs == refs
    assert fused is not None and served == 0
    assert seen  # the hook saw the engine's steps


@pytest.mark.timeout(600)
def test_a_hooked_decoder_layer_is_called_through_its_module_call():
    model = build_model("llama")
    seen = []
    handle = model.model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(1))
    try:
        prompts = random_prompts([7, 30], seed=7)
        refs = [reference_greedy(model, p, NEW) for p in prompts]
        seen.clear()
        outs, _, fused, served = _serve(model, prompts, _PLAIN)
    finally:
        handle.remove()
    assert outs == refs
    assert served >= NEW and len(seen) >= served  # served fused, the layer's hook ran on every step


@pytest.mark.timeout(600)
def test_hidden_states_asked_for_or_a_replaced_rotary_forward_run_the_models_own_forward():
    model = build_model("llama")
    prompts = random_prompts([7, 30], seed=11)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    model.config.output_hidden_states = True  # transformers' output capture: the fast path skips it
    try:
        outs, _, fused, served = _serve(model, prompts, _PLAIN)
    finally:
        model.config.output_hidden_states = False
    assert outs == refs and fused is not None and served == 0
    # A forward installed on the rotary module after the engine's (per-request rotary factors,
    # accelerate's offload): the model's own forward calls it.
    calls = []
    eng = LLMEngine(model, _PLAIN)
    rot = model.model.rotary_emb
    try:
        own = rot.forward
        rot.forward = lambda x, position_ids: calls.append(1) or own(x, position_ids)
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        assert [h.result(timeout=600).output_token_ids for h in handles] == refs
        assert calls and eng.patches.fused_model.base_forward.served == 0
    finally:
        eng.close()
        del rot.forward


def test_calls_outside_an_engine_step_run_the_models_own_forward():
    model = build_model("llama")
    ids = torch.tensor([random_prompts([9], seed=8)[0]])
    with torch.no_grad():
        want = model(ids, output_hidden_states=True)
        want_embeds = model(inputs_embeds=model.model.embed_tokens(ids)).logits
    ref = reference_greedy(model, ids[0].tolist(), NEW)
    eng = LLMEngine(model, _PLAIN)
    try:
        assert isinstance(model.__dict__.get("forward"), FusedCausalLMForward)
        assert isinstance(model.model.__dict__.get("forward"), FusedModelForward)
        # The engine's packed linears run other GEMM kernels than torch's: close, not the same bits.
        close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)  # noqa: E731
        with torch.no_grad():
            got = model(ids, output_hidden_states=True)
            assert close(got.logits, want.logits) and len(got.hidden_states) == len(want.hidden_states)
            assert all(close(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
            assert close(model(inputs_embeds=model.model.embed_tokens(ids)).logits, want_embeds)
        assert reference_greedy(model, ids[0].tolist(), NEW) == ref  # the user's own generate
        assert eng.patches.fused_model.base_forward.served == 0
    finally:
        eng.close()


def test_two_engines_share_it_and_the_last_close_removes_it():
    model = build_model("llama")
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8))
    a, b = LLMEngine(model, cfg), LLMEngine(model, cfg)
    fused = a.patches.fused_model
    assert fused is not None and b.patches.fused_model is fused
    assert fused.report() == "fused model forward: yes"
    prompt = random_prompts([5], seed=3)[0]
    ref = reference_greedy(model, prompt, NEW)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    assert a.submit(prompt, params).result(timeout=600).output_token_ids == ref
    a.close()
    assert all(m.__dict__.get("forward") is f for m, f in fused.installed)
    assert b.submit(prompt, params).result(timeout=600).output_token_ids == ref
    b.close()
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "_hf_contbatch_fused_model" not in model.__dict__


def test_not_installed_without_fused_layers_or_for_other_forms():
    model = build_model("llama")
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8), fuse_model_ops=False))
    try:
        assert eng.patches.fused_model is None and "forward" not in model.__dict__
    finally:
        eng.close()
    # Gemma 2's layers keep their own forward (no fused layer step); Gemma's layers are fused but its
    # model forward scales the embedding, which the fused model forward does not do.
    for family in ("gemma2", "gemma"):
        other = build_model(family)
        eng = LLMEngine(other, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
        try:
            fused = eng.patches.fused_model
            assert (fused is None or not fused.installed) and "forward" not in other.__dict__
        finally:
            eng.close()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_transformers_builds_no_mask_for_a_paged_step(family):
    # Why the fast path passes the layers None: the mask functions these models call return None
    # for a paged cache and no mask given (the paged attention keeps requests apart by metadata).
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from hf_contbatch.kernels.paged_cache import PagedCacheStep

    model = build_model(family)
    step = PagedCacheStep.__new__(PagedCacheStep)  # its type is what the mask functions look at
    emb, pos = torch.zeros(1, 5, model.config.hidden_size), torch.arange(3, 8)[None]
    for fn in (create_causal_mask, create_sliding_window_causal_mask):
        assert fn(config=model.config, inputs_embeds=emb, attention_mask=None, cache=step, position_ids=pos) is None
