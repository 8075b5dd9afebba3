"""Models whose layers keep their state in a cache layer class of their own (DeepSeek V4's compressed
attention), served on transformers' own cache per request (``engine.own_cache_runner``).

The tiny DeepSeek V4 (``scripts/family_sweep.py``'s ``HAND_TINY``) has one layer of each kind: a
sliding window of 8, a compressed sparse layer pooling every 4 tokens with an indexer keeping 4 of
its entries per query, and a heavily compressed layer pooling every 8 tokens; prompts of 17 to 33
tokens and 12 new ones make both compressors emit entries, close windows during decode, and the
indexer select. Greedy tokens equal transformers' own ``generate`` on each prompt alone (float32,
CPU): several requests at once, under forced preemption (recompute, a request resumed past the
step's token budget continuing one token per forward), with the pool sized by default; caches,
slots and blocks are given back; a step's forwards change no request's cache until the step ran.
"""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.engine.kv_groups import own_cache_kinds
from hf_contbatch.engine.own_cache_runner import _copied

from conftest import enqueue_at_once, load_family_sweep, reference_greedy, serve_greedy

family_sweep = load_family_sweep()

NEW = 12
LENGTHS = (17, 23, 26, 33)


def _prompts(lengths=LENGTHS):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, family_sweep.VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model_and_refs():
    model = family_sweep.build_tiny("deepseek_v4")
    prompts = _prompts()
    return model, prompts, [reference_greedy(model, p, NEW) for p in prompts]


def _meta_model(model_type):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family_sweep.tiny_config(model_type)).eval()


def test_own_cache_kinds_are_those_whose_cache_class_the_models_module_defines():
    """DeepSeek V4's two compressed kinds (its sliding layers use transformers' shared class); none
    for models whose every kind has transformers' shared cache layer class."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

    v4 = _meta_model("deepseek_v4")
    assert own_cache_kinds(v4) == ["compressed_sparse_attention", "heavily_compressed_attention"]
    for kind in own_cache_kinds(v4):
        assert DYNAMIC_LAYER_TYPE_MAPPING[kind].__module__ == type(v4).__module__
    for model_type in ("deepseek_v32", "gemma3_text", "qwen3_next"):
        assert own_cache_kinds(_meta_model(model_type)) == []


def _caches_given_back(engine):
    """Every request's own transformers cache and recurrent state slot was given back."""
    assert engine.runner._caches == {} and engine.runner.states.num_held == 0


@pytest.mark.timeout(300)
def test_greedy_equals_generate_for_requests_at_once_and_every_cache_is_given_back(model_and_refs):
    model, prompts, refs = model_and_refs
    outs, _ = serve_greedy(
        model, prompts, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)), NEW, check=_caches_given_back
    )
    assert outs == refs


@pytest.mark.timeout(300)
def test_greedy_equals_generate_under_forced_preemption(model_and_refs):
    """14 blocks of 4 tokens (56) for requests of 29 to 45 tokens: some are preempted and recomputed."""
    model, prompts, refs = model_and_refs
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=14),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=34),
    )
    outs, stats = serve_greedy(model, prompts, cfg, NEW, check=_caches_given_back)
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert outs == refs


@pytest.mark.timeout(300)
def test_the_default_pool_counts_what_the_model_can_use_and_serves_exactly(model_and_refs):
    """No ``num_blocks``: the pool (one channel per layer) holds ``max_num_seqs`` requests of the
    model's whole context (256 tokens) at once, whatever the device."""
    model, prompts, refs = model_and_refs
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16), scheduler=SchedulerConfig(max_num_seqs=2)))
    try:
        assert eng.block_manager.num_blocks == 2 * 256 // 16
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts[:2]]
        outs = [h.result(timeout=120).output_token_ids for h in handles]
    finally:
        eng.close()
    assert outs == refs[:2]


@pytest.mark.timeout(300)
def test_a_step_failing_after_some_requests_ran_leaves_their_caches_as_they_were(model_and_refs):
    """The first forward at position 30 raises once (the 26-token prompt's fifth decode), after the
    forwards of the requests before it in that step ran: the engine runs the step again in halves,
    and those requests decode again from the caches the previous step left (their advanced copies
    dropped), so every request's tokens still equal ``generate``'s."""
    model, prompts, refs = model_and_refs
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)))
    fired = []

    def fault(module, args, kwargs):
        if not fired and kwargs["position_ids"].shape[1] == 1 and int(kwargs["position_ids"][0, 0]) == 30:
            fired.append(True)
            raise RuntimeError("injected transient fault")

    hook = model.register_forward_pre_hook(fault, with_kwargs=True)
    try:
        handles = enqueue_at_once(eng, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        outs = [h.result(timeout=120).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        assert eng.runner._caches == {}
    finally:
        hook.remove()
        eng.close()
    assert fired, "the fault never fired"
    assert outs == refs


@torch.no_grad()
def test_a_copied_cache_advances_without_changing_the_one_it_was_copied_from(model_and_refs):
    """A step's forwards run on copies (``_copied``): five decodes on a copy leave the original
    where its prefill left it, so its next decode gives the logits a fresh prefill's does."""
    from transformers import DynamicCache

    model, prompts, _ = model_and_refs
    prompt = torch.tensor([prompts[1]])
    n = prompt.shape[1]

    def prefilled():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt, position_ids=torch.arange(n)[None], cache=cache, use_cache=True)
        return cache, int(out.logits[0, -1].argmax())

    def decode(cache, token, position):
        out = model(
            input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), cache=cache, use_cache=True
        )
        return out.logits[0, -1]

    original, first = prefilled()
    copy = _copied(original)
    token = first
    for i in range(5):  # past a compressed sparse window (4) and into the next heavily compressed one (8)
        token = int(decode(copy, token, n + i).argmax())
    reference, _ = prefilled()
    assert torch.equal(decode(original, first, n), decode(reference, first, n))


@pytest.mark.timeout(60)
def test_engine_settings_it_cannot_serve_are_refused_in_one_line_before_any_weight_is_touched():
    model = _meta_model("deepseek_v4")
    with pytest.raises(ValueError, match="layers keeping their own cache: prompt-lookup drafts") as err:
        LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=8), prompt_lookup_num_tokens=2))
    assert "model type 'deepseek_v4'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="layers keeping their own cache: compile_model=True"):
        LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=8), compile_model=True))
    # An int8 KV cache would quantize nothing: the K/V stay in transformers' cache.
    with pytest.raises(ValueError, match=r"KV cache dtype \(CacheConfig.dtype='int8'\) is not served") as err:
        LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=8, dtype="int8")))
    assert "\n" not in str(err.value)
