"""The decode program (``kernels/decode_program``): every layer of a decode step in one
native call. Greedy tokens equal transformers' generate (batched, and under preemption and chunked
prefill, no block leaked) for the plain pre-norm forms, with the program serving the decode steps;
its log-probs have the bits of the layer-by-layer fused path, in float32 and bfloat16; steps it
must not serve (a hooked projection, float16, forms it does not have) run layer by layer."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.kernels.fused_ops import fused_library

from conftest import build_model, random_prompts, reference_greedy

pytestmark = pytest.mark.skipif(fused_library() is None, reason="no C compiler")

NEW = 12
# Our GEMM for every linear, whatever the timing here picks for the test models' small shapes: the
# program serves only linears our float32 kernel runs.
_PLAIN = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32), linear_backend="native")
# 15 blocks of 4 tokens for 4 requests of up to 57 tokens and a 12-token budget: preemption and chunks.
_TIGHT = EngineConfig(
    cache=CacheConfig(block_size=4, num_blocks=15),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12),
    linear_backend="native",
)


def _program(engine):
    fused = engine.patches.fused_model
    return None if fused is None else fused.base_forward.program


def _engine(model, cfg):
    """An engine whose decode attention is the compiled kernel (the program calls it), whichever
    path the timing here chose for the test models' small heads."""
    engine = LLMEngine(model, cfg)
    kernel = engine.cache.backend.decode_kernel
    assert kernel.built_ok, kernel.error
    kernel.enabled = True
    return engine


def _serve(model, prompts, cfg):
    """Greedy outputs, stats and the steps the program served; blocks checked as serve_greedy does."""
    engine = _engine(model, cfg)
    try:
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        handles = [engine.submit(p, params) for p in prompts]
        outs = [h.result(timeout=600).output_token_ids for h in handles]
        assert engine.wait_idle(10)
        stats = engine.stats()
        engine.block_manager.check_invariants()
        program = _program(engine)
        served = 0 if program is None else program.served
    finally:
        engine.close()
    return outs, stats, served


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["llama", "llama-mqa", "mistral", "qwen2"])
@pytest.mark.parametrize("cfg", [_PLAIN, _TIGHT], ids=["batched", "preempted-chunked"])
def test_greedy_tokens_equal_generate_with_the_decode_program(family, cfg):
    model = build_model(family)
    prompts = random_prompts([1, 7, 30, 45], seed=13)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, stats, served = _serve(model, prompts, cfg)
    assert outs == refs
    # Requests are queued one after another: the decode-only steps (all but the prompts' first
    # steps) ran in the program.
    assert served >= NEW - 1
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    if cfg is _TIGHT and family != "mistral":  # Mistral's 8-token window gives blocks back: no pressure
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("family", "dtype"),
    [("llama", torch.float32), ("qwen2", torch.float32), ("llama", torch.bfloat16), ("qwen2", torch.bfloat16)],
)
def test_log_probs_have_the_bits_of_the_layer_by_layer_path(family, dtype):
    model = build_model(family).to(dtype)
    prompts = random_prompts([3, 11, 26, 40], seed=17)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=0)
    results = {}
    for use_program in (True, False):
        engine = _engine(model, _PLAIN)
        try:
            program = _program(engine)
            assert program is not None and program.usable
            program.usable = use_program  # off: every layer's fused step, one by one
            handles = [engine.submit(p, params) for p in prompts]
            reqs = [h.result(timeout=600) for h in handles]
            results[use_program] = [(r.output_token_ids, list(r.logprobs)) for r in reqs]
            assert (program.served > 0) == use_program
        finally:
            engine.close()
    assert results[True] == results[False]


@pytest.mark.timeout(600)
def test_a_hooked_projection_runs_the_layers_one_by_one():
    model = build_model("llama")
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(1))
    try:
        prompts = random_prompts([7, 30], seed=7)
        refs = [reference_greedy(model, p, NEW) for p in prompts]
        seen.clear()
        outs, _, served = _serve(model, prompts, _PLAIN)
    finally:
        handle.remove()
    assert outs == refs
    assert served == 0 and len(seen) >= NEW  # the hook ran at every step


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("family", "dtype"), [("llama", torch.float16), ("qwen3", torch.float32), ("phi3", torch.float32)]
)
def test_steps_it_does_not_serve_run_the_layers_one_by_one(family, dtype):
    model = build_model(family).to(dtype)
    prompts = random_prompts([5, 19], seed=3)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, _, served = _serve(model, prompts, _PLAIN)
    if dtype == torch.float32:  # float16 engine tokens may differ from generate's by rounding
        assert outs == refs
    else:
        assert [len(o) for o in outs] == [NEW] * len(prompts)
    assert served == 0


@pytest.mark.timeout(600)
def test_weights_changed_in_place_between_requests_are_served_by_the_program():
    # The program reads each step's packed weights (repacked by the step's verified check after a
    # write): a write between requests changes the next request's tokens as generate's.
    model = build_model("qwen2")  # biases too
    prompts = random_prompts([9, 21], seed=23)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine = _engine(model, _PLAIN)
    try:
        program = _program(engine)
        before = [engine.submit(p, params).result(timeout=600).output_token_ids for p in prompts]
        served = program.served
        assert served > 0
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
            model.model.layers[1].self_attn.k_proj.bias.add_(0.25)
            model.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
        after = [engine.submit(p, params).result(timeout=600).output_token_ids for p in prompts]
        assert program.served > served
    finally:
        engine.close()
    assert after == [reference_greedy(model, p, NEW) for p in prompts]
    assert after != before  # the writes changed the tokens: the check above is not vacuous
