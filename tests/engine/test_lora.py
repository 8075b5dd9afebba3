"""Several LoRA adapters of a ``peft.PeftModel`` in one continuous batch: every request equals PEFT's
own ``generate`` with its adapter active (float32, CPU), in a mixed batch with the base model, under
recompute and swap preemption, chunked prefill and prefix caching (kept apart per adapter); seeded
parallel sampling; bad adapter names refused while the engine keeps serving; refused PEFT features;
two engines on one model; requests per adapter in the stats.

The expected tokens come from a second, identically built ``PeftModel`` that no engine touches."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.frontends.dashboard.render import render_tiles
from hf_contbatch.frontends.dashboard.text import format_stats

from conftest import build_model, random_prompts

peft = pytest.importorskip("peft")

ADAPTERS = ("sql", "chat", "poem")
NAMES = ["sql", "chat", "__base__", "poem", "chat", "sql", "poem", "__base__", "sql", "chat"]
NEW = 12


def peft_llama(seed: int = 0):
    """The tiny llama with three adapters of different ranks and settings, random non-zero LoRA
    weights (``init_lora_weights=False``) on the attention's q/k/v/o and the MLP."""
    model = build_model("llama", seed=seed)
    torch.manual_seed(seed + 100)
    attn_mlp = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=attn_mlp, init_lora_weights=False), adapter_name="sql"
    )
    pm.add_adapter(
        "chat",
        peft.LoraConfig(
            r=8, lora_alpha=4, use_rslora=True, target_modules=attn_mlp + ["lm_head"], init_lora_weights=False
        ),
    )
    pm.add_adapter(
        "poem",
        peft.LoraConfig(r=2, lora_bias=True, target_modules=["k_proj", "v_proj", "up_proj"], init_lora_weights=False),
    )
    return pm.eval()


def peft_generate(pm, prompt, adapter, max_new_tokens=NEW, **kwargs):
    """PEFT's own generate with ``adapter`` active (``"__base__"``: adapters disabled)."""
    kw = {"max_new_tokens": max_new_tokens, "pad_token_id": 0, "eos_token_id": None, "do_sample": False, **kwargs}
    ids = torch.tensor([prompt])
    with torch.no_grad():
        if adapter == "__base__":
            with pm.disable_adapter():
                out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        else:
            pm.set_adapter(adapter)
            out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    pm.set_adapter("sql")
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference():
    return peft_llama()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 19, 9, 26, 13, 7, 30, 11, 22, 6], seed=4)


@pytest.fixture(scope="module")
def expected(reference, prompts):
    refs = [peft_generate(reference, p, n) for p, n in zip(prompts, NAMES)]
    base = [peft_generate(reference, p, "__base__") for p in prompts]
    for name in ADAPTERS:  # every adapter changes some output: the test can see a wrong adapter
        assert any(r != b for r, b, n in zip(refs, base, NAMES) if n == name), name
    return refs


def _run(pm, prompts, cfg, names=NAMES):
    engine = LLMEngine(pm, cfg)
    try:
        handles = [engine.submit(p, SamplingParams(max_new_tokens=NEW, adapter_name=n)) for p, n in zip(prompts, names)]
        outputs = [h.result(600).output_token_ids for h in handles]
        assert engine.wait_idle(30)
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_blocks  # no block leaked
        return outputs, stats
    finally:
        engine.close()


@pytest.mark.timeout(600)
def test_mixed_batch_of_base_and_three_adapters_equals_each_adapters_generate(prompts, expected):
    pm = peft_llama()
    outputs, _ = _run(pm, prompts, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=256)))
    assert outputs == expected
    assert not any("forward" in m.__dict__ for m in pm.modules())  # close() removed every instance forward


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_adapters_stay_exact_under_preemption_and_chunked_prefill(prompts, expected, mode):
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=24, swap_space_gib=0.01),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, preemption_mode=mode),
    )
    outputs, stats = _run(peft_llama(), prompts, cfg)
    assert outputs == expected
    assert stats.num_preemptions > 0
    assert (stats.num_preemptions_swap if mode == "swap" else stats.num_preemptions_recompute) > 0


@pytest.mark.timeout(600)
def test_prefix_cache_is_kept_apart_per_adapter(reference):
    prompt = random_prompts([21], seed=9)[0]
    order = ["sql", "chat", "__base__", "sql", "chat"]
    refs = {n: peft_generate(reference, prompt, n) for n in set(order)}
    assert refs["sql"] != refs["chat"]  # same prompt, two adapters: different outputs
    engine = LLMEngine(
        peft_llama(), EngineConfig(cache=CacheConfig(block_size=4, num_blocks=128, enable_prefix_caching=True))
    )
    try:
        done = []
        for name in order:  # one at a time: each finds the earlier ones' blocks cached
            h = engine.submit(prompt, SamplingParams(max_new_tokens=NEW, adapter_name=name))
            h.result(300)
            done.append((name, h.request))
        for name, req in done:
            assert req.output_token_ids == refs[name], name
        hits = [req.num_cached_prompt_tokens for _, req in done]
        assert hits[:3] == [0, 0, 0]  # the first of each adapter (and of the base) hits nothing
        assert hits[3] == hits[4] == 20  # a repeat hits its own adapter's 5 full blocks
        hashes = {name: set(req.block_hashes) for name, req in done}
        assert not hashes["sql"] & hashes["chat"] and not hashes["sql"] & hashes["__base__"]
    finally:
        engine.close()


@pytest.mark.timeout(600)
def test_seeded_parallel_sampling_equals_peft_seeded_generate_per_sequence(reference):
    # Sequence k of a seeded request samples with seed + k (RequestFactory.build), each the draw
    # generate makes after torch.manual_seed(seed + k).
    prompt = random_prompts([9], seed=5)[0]
    sampled = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    engine = LLMEngine(peft_llama(), EngineConfig(cache=CacheConfig(block_size=4, num_blocks=128)))
    try:
        sp = SamplingParams(max_new_tokens=NEW, do_sample=True, seed=7, adapter_name="chat")
        outputs = [h.result(300).output_token_ids for h in engine.submit(prompt, sp, num_return_sequences=3)]
    finally:
        engine.close()
    want = []
    for k in range(3):
        torch.manual_seed(7 + k)
        want.append(peft_generate(reference, prompt, "chat", **sampled))
    assert outputs == want and len(set(map(tuple, want))) == 3


@pytest.mark.timeout(600)
def test_unknown_adapter_is_refused_naming_the_loaded_ones_and_the_engine_keeps_serving(prompts, expected):
    engine = LLMEngine(peft_llama(), EngineConfig(cache=CacheConfig(block_size=4, num_blocks=128)))
    try:
        with pytest.raises(ValueError, match=r"unknown adapter 'sq1'.*'sql', 'chat', 'poem', '__base__'"):
            engine.submit(prompts[0], SamplingParams(max_new_tokens=NEW, adapter_name="sq1"))
        with pytest.raises(ValueError, match="strings"):
            engine.submit(prompts[0], SamplingParams(max_new_tokens=NEW, adapter_name=3))
        h = engine.submit(prompts[0], SamplingParams(max_new_tokens=NEW))  # None: the active adapter ("sql")
        assert h.request.sampling.adapter_name == "sql"
        assert h.result(300).output_token_ids == expected[0]
        with engine.model.disable_adapter():  # PEFT's own switch: no adapter name means the base model
            h = engine.submit(prompts[2], SamplingParams(max_new_tokens=NEW))
        assert h.request.sampling.adapter_name is None and h.result(300).output_token_ids == expected[2]
        engine.model.base_model.set_adapter(["sql", "chat"])  # several active: a name is needed
        with pytest.raises(ValueError, match="2 active adapters"):
            engine.submit(prompts[0], SamplingParams(max_new_tokens=NEW))
    finally:
        engine.close()
    plain = LLMEngine(build_model("llama"), EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32)))
    try:
        with pytest.raises(ValueError, match="no LoRA adapters"):
            plain.submit(prompts[0], SamplingParams(max_new_tokens=2, adapter_name="sql"))
        assert plain.submit(prompts[0], SamplingParams(max_new_tokens=2, adapter_name="__base__")).result(300)
    finally:
        plain.close()


@pytest.mark.timeout(600)
def test_two_engines_share_one_peft_model_and_the_last_close_restores_it(prompts, expected):
    pm = peft_llama()
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=128))
    first, second = LLMEngine(pm, cfg), LLMEngine(pm, cfg)
    try:
        h1 = [first.submit(p, SamplingParams(max_new_tokens=NEW, adapter_name=n)) for p, n in zip(prompts, NAMES)]
        h2 = [second.submit(p, SamplingParams(max_new_tokens=NEW, adapter_name=n)) for p, n in zip(prompts, NAMES)]
        assert [h.result(600).output_token_ids for h in h1 + h2] == expected + expected
        first.close()
        h = second.submit(prompts[1], SamplingParams(max_new_tokens=NEW, adapter_name=NAMES[1]))
        assert h.result(300).output_token_ids == expected[1]
    finally:
        first.close()
        second.close()
    assert not any("forward" in m.__dict__ for m in pm.modules())
    assert peft_generate(pm, prompts[3], NAMES[3]) == expected[3]  # PEFT's own forward is back


@pytest.mark.timeout(300)
def test_unservable_peft_models_are_refused_and_left_untouched():
    pm = peft_llama()
    with pytest.raises(ValueError, match="compile_model"):
        LLMEngine(pm, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32), compile_model=True))
    pm.merge_adapter()
    with pytest.raises(ValueError, match="merged"):
        LLMEngine(pm, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32)))
    assert not any("forward" in m.__dict__ for m in pm.modules())
    assert "hf_contbatch" not in str(pm.config._attn_implementation)


@pytest.mark.timeout(300)
def test_stats_and_dashboard_count_requests_per_adapter(prompts):
    engine = LLMEngine(peft_llama(), EngineConfig(cache=CacheConfig(block_size=4, num_blocks=128)))
    snapshots = []

    def snapshot_at_first_token(req):  # called in the engine's iteration, after each new token
        if len(req.output_token_ids) == 1:
            snapshots.append(engine.stats())
        return False

    try:
        built = [
            engine.build_request(p, SamplingParams(max_new_tokens=NEW, adapter_name=n), stop_checker=check)
            for p, n, check in zip(prompts, NAMES, [snapshot_at_first_token] + [None] * (len(NAMES) - 1))
        ]
        for hs in engine.enqueue(built):  # all queued at once: the first step sees them all
            hs[0].result(300)
        in_flight = {name: w + r + s for name, w, r, s in snapshots[0].requests_per_adapter}
        assert in_flight == {"__base__": 2, "chat": 3, "poem": 2, "sql": 3}
        assert engine.stats().requests_per_adapter == ()  # all finished
        text = format_stats(snapshots[0])
        assert "adapters   __base__: 2 " in text and "sql: 3 " in text
        html = render_tiles(snapshots[0], None)
        assert all(f"adapter {name}" in html for name in in_flight)
    finally:
        engine.close()
    plain = LLMEngine(build_model("llama"), EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32)))
    try:  # a plain model shows no adapters
        plain.submit(prompts[0], SamplingParams(max_new_tokens=2)).result(300)
        assert plain.stats().requests_per_adapter == () and "adapters" not in format_stats(plain.stats())
    finally:
        plain.close()
