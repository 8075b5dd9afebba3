"""``EngineConfig(compile_model=True)``: the model forward compiled by torch.compile (inductor) with
the paged attention and packed linears as opaque ops. Greedy output still equals transformers'
``generate`` token for token (float32), also under preemption and chunked prefill, with two
engines side by side, after an in-place weight change, and where compiling fails (eager, one
warning). Compiling takes tens of seconds on two cores, so these tests share few, small models: one
decoder layer, and the two engines' models of one class and config (different weights), whose
graphs inductor compiles once (its on-disk cache serves the second)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.config import resolve_compile_model

from conftest import build_model, enqueue_at_once, load_family_sweep, random_prompts, reference_greedy

LENGTHS = [1, 5, 17, 33, 64, 40, 9]
NEW = 12


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _tight_config(**kw) -> EngineConfig:
    # 22 blocks of 4 tokens for 7 requests of up to 76 tokens: preemption; a 24-token budget: chunks.
    return EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=22),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),
        compile_model=True,
        **kw,
    )


def _submit(engine, prompts):
    # All queued at once (not one submit() after another while the engine steps): each run of the
    # same prompts then schedules the same batches, whatever the machine's load, so the graph
    # counts below do not depend on arrival timing.
    return enqueue_at_once(engine, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_compiled_greedy_equals_generate_two_engines_preemption_and_weight_change():
    # Attention biases: the fused q/k/v (and o) GEMMs with a bias; the MLP's have none.
    models = [build_model("llama", seed=s, num_hidden_layers=1, attention_bias=True) for s in (0, 1)]
    prompts = random_prompts(LENGTHS, seed=3)
    refs = [[reference_greedy(m, p, NEW) for p in prompts] for m in models]
    engines = [LLMEngine(m, _tight_config()) for m in models]
    try:
        before = _graphs()
        handles = [_submit(e, prompts) for e in engines]  # both engines in flight at once
        for hs, ref, e in zip(handles, refs, engines):
            assert [h.result(timeout=1500).output_token_ids for h in hs] == ref
            assert e.compiled_forward.failed is None
            stats = e.stats()
            assert stats.num_preemptions > 0, "the pool was meant to force preemption"
            assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
            e.block_manager.check_invariants()
        # Really compiled, into a handful of graphs, not one per batch shape (18 distinct (model,
        # tokens, sampled rows) shapes run here): per model one-token steps, plus the general and
        # the one-row-logits cases (sizes 0 and 1 are specialized), each compiled dynamic; should
        # one be compiled static at its first shape and dynamic at its second (dynamo's automatic
        # dynamic shapes), at most 2 models x 3 cases x (static + dynamic) = 12.
        assert 1 <= _graphs() - before <= 12

        # An in-place weight change is followed (the packed copies are refreshed before each step),
        # before an engine opens and while it is open; ``shadow`` (never served) gives the references.
        engines[1].close()
        shadow = copy.deepcopy(models[1])
        with torch.no_grad():
            for m in (models[1], shadow):
                m.model.layers[0].mlp.down_proj.weight.mul_(-2.0)
                m.lm_head.weight.add_(0.05)
        changed = [reference_greedy(shadow, p, NEW) for p in prompts]
        assert changed != refs[1], "the change was meant to change the greedy tokens"
        engines[1] = LLMEngine(models[1], _tight_config())
        assert [h.result(timeout=1500).output_token_ids for h in _submit(engines[1], prompts)] == changed
        graphs = _graphs()
        with torch.no_grad():
            for m in (models[1], shadow):
                m.model.layers[0].self_attn.v_proj.weight.mul_(-4.0)  # a fused q/k/v member
        changed2 = [reference_greedy(shadow, p, NEW) for p in prompts]
        assert changed2 != changed
        assert [h.result(timeout=1500).output_token_ids for h in _submit(engines[1], prompts)] == changed2
        # The repacked weights are graph inputs like the old ones: nothing compiled again (a bias
        # repacked as an inference tensor once recompiled each of the model's graphs).
        assert _graphs() == graphs
    finally:
        for e in engines:
            e.close()
    # close() gives the models their own forwards and attention back.
    for m in models:
        assert m.config._attn_implementation != "hf_contbatch_paged"
        assert all("forward" not in sub.__dict__ for sub in m.modules())


@pytest.mark.timeout(1500)
def test_failed_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    model = build_model("llama", seed=2)
    prompts = random_prompts(LENGTHS[:4], seed=4)
    refs = [reference_greedy(model, p, NEW) for p in prompts]

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend=failing_backend))
    engine = LLMEngine(model, _tight_config())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [h.result(timeout=600).output_token_ids for h in _submit(engine, prompts)]
        assert outs == refs
        msgs = [str(w.message) for w in caught if "compile_model" in str(w.message)]
        assert len(msgs) == 1 and "eagerly" in msgs[0], msgs
        assert engine.compiled_forward.failed is not None
        # Still serving afterwards.
        assert [h.result(timeout=600).output_token_ids for h in _submit(engine, prompts[:1])] == refs[:1]
    finally:
        engine.close()


def test_compile_model_bad_values_are_named(monkeypatch):
    for bad in ("yes", 1, 0.5):
        with pytest.raises(ValueError, match="compile_model"):
            EngineConfig(compile_model=bad)
    monkeypatch.setenv("HF_CONTBATCH_COMPILE", "on")
    with pytest.raises(ValueError, match="HF_CONTBATCH_COMPILE"):
        resolve_compile_model(None)
    # Raised by the engine before it changes the model: generate still works afterwards.
    model = build_model("llama", seed=5)
    ref = reference_greedy(model, [5, 6, 7], 3)
    with pytest.raises(ValueError, match="HF_CONTBATCH_COMPILE"):
        LLMEngine(model, EngineConfig())
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert reference_greedy(model, [5, 6, 7], 3) == ref
    monkeypatch.setenv("HF_CONTBATCH_COMPILE", "1")
    assert resolve_compile_model(None) is True
    assert resolve_compile_model(False) is False
    monkeypatch.delenv("HF_CONTBATCH_COMPILE")
    assert resolve_compile_model(None) is False


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_model_the_attention_op_cannot_store_for_falls_back_to_eager():
    """DiffLlama attends twice per layer over halves of V picked after ``cache.update``: the
    compiled op, which stores K/V itself, would store a half of V over the pool; it refuses the
    second store of a layer in a step and the forward runs eagerly from then on (one warning),
    where the attention function reads the heads the model picked: greedy equals generate."""

    family_sweep = load_family_sweep()
    model = family_sweep.build_tiny("diffllama")
    prompts = family_sweep.prompts()
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    engine = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32), compile_model=True))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [h.result(timeout=1200).output_token_ids for h in _submit(engine, prompts)]
        assert outs == refs
        msgs = [str(w.message) for w in caught if "compile_model" in str(w.message)]
        assert len(msgs) == 1 and "more than once in a step" in msgs[0], msgs
    finally:
        engine.close()
