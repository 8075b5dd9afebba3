"""Doge's dynamic mask attention in an engine: the bias it computes per key from the key's value,
cached beside the key (``engine.dynamic_mask``), added to the scores with the top-k of
``keep_window_size`` keys per row over the rows ``generate`` builds (``torch_paged.key_biased_attention``).
Expected tokens are transformers' ``generate`` on the same tiny random model."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

from conftest import load_family_sweep, reference_greedy

family_sweep = load_family_sweep("family_sweep_doge")

NEW = 16


def _doge(keep: int = 4, sliding_window=8, random_a: bool = False):
    """The sweep's tiny Doge (float32, seed 0) with ``keep_window_size=keep`` and the given window.
    Its ``A`` starts at zero, so every key's bias is ``exp(0) = 1``: all tie at the top-k's cut;
    ``random_a`` draws ``A`` (seed 2) so the biases differ and change the scores."""
    from transformers import AutoModelForCausalLM

    cfg = family_sweep.tiny_config("doge")
    cfg.keep_window_size, cfg.sliding_window = keep, sliding_window
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if random_a:
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.copy_(torch.randn(layer.self_attn.A.shape, generator=g))
    return model


def _serve(model, prompts, **kw):
    """(greedy tokens per prompt, stats) of one engine; its pool is checked whole at the end."""
    sched = dict(max_num_seqs=4, max_num_batched_tokens=kw.pop("budget", 1024))
    sched.update(kw.pop("scheduler", {}))
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(**kw), scheduler=SchedulerConfig(**sched)))
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        outs = [h.result(timeout=240).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    return outs, stats


def _prompts():
    """The sweep's two prompts (5 and 23 tokens), one more of 30 sharing the long one's first 16
    (a prefix-cache hit of whole blocks), and the long one again."""
    short, long = family_sweep.prompts()
    return [short, long, long[:16] + [7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53], long]


def test_the_top_k_changes_what_generate_gives():
    """The reference itself: with ``keep_window_size`` past every row, transformers' Doge gives other
    tokens than with 4, so tokens equal to ``generate``'s below mean the top-k was applied."""
    prompts = _prompts()
    for random_a in (False, True):
        kept = [reference_greedy(_doge(4, random_a=random_a), p, NEW) for p in prompts]
        unlimited = [reference_greedy(_doge(10_000, random_a=random_a), p, NEW) for p in prompts]
        assert kept != unlimited


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "budget, blocks, mode",
    [(1024, 64, "recompute"), (6, 18, "recompute"), (1024, 18, "swap")],
    ids=["whole", "chunks-recompute", "swap"],
)
def test_tied_biases_are_cut_as_generate_cuts_them(budget, blocks, mode):
    """Every key's bias ties (1.0): which ``keep`` keys a row keeps is where ``torch.topk`` cuts a row
    laid out as ``generate``'s, prompt rows the prompt long, generated rows their window long. Chunked
    prefills, decodes batched with other requests, and requests preempted
    (recomputed, or swapped out with their biases and back) give ``generate``'s tokens."""
    model = _doge()
    prompts = _prompts()
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    extra = {"swap_space_gib": 0.01} if mode == "swap" else {}
    outs, stats = _serve(
        model, prompts, budget=budget, block_size=4, num_blocks=blocks, scheduler={"preemption_mode": mode}, **extra
    )
    assert outs == refs
    if blocks < 64:
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"


@pytest.mark.timeout(300)
def test_a_prompt_sharing_another_lengths_prefix_is_cut_as_generate_cuts_it():
    """Where biases tie, which keys ``torch.topk`` keeps in a prompt row depends on how long the
    prompt's rows are, so ``generate``'s hidden states at a prefix's positions (and the next layers'
    K/V there) depend on the whole prompt's length: K/V cached from a prompt of another length are
    not those ``generate`` computes. The 23-token prompt, served after a 30-token one sharing its
    first 20 tokens (5 whole blocks; sequentially, so they are cached by then), gives ``generate``'s
    tokens: the engine serving a dynamic mask keeps no prefix cache."""
    model = _doge()
    long = _prompts()[1]
    first = long[:20] + [7, 9, 11, 13, 17, 19, 23, 29, 31, 37]
    refs = [reference_greedy(model, p, NEW) for p in (first, long)]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)))
    try:
        outs = [
            eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(240).output_token_ids
            for p in (first, long)
        ]
        assert eng.wait_idle(10)
        stats = eng.stats()
    finally:
        eng.close()
    assert outs == refs
    assert stats.prefix_cache_hit_tokens == 0
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sliding_window, mode", [(None, "recompute"), (8, "recompute"), (None, "swap")], ids=["full", "window", "swap"]
)
def test_learned_biases_change_the_scores_as_in_generate(sliding_window, mode):
    """With ``A`` drawn the biases differ per key and head: added to the scores, and the top-k keeps
    the keys of largest bias, with and without a sliding window (without one, every row past 4
    keys is cut), under chunks and preemption (a request swapped out takes its biases with its
    blocks and brings them back)."""
    model = _doge(sliding_window=sliding_window, random_a=True)
    prompts = _prompts()
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    extra = {"swap_space_gib": 0.01} if mode == "swap" else {}
    sched = {"preemption_mode": mode}
    outs, stats = _serve(model, prompts, budget=7, block_size=4, num_blocks=14, scheduler=sched, **extra)
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    if mode == "swap":
        assert stats.num_blocks_swapped_in > 0, "the pool was meant to swap blocks out and back"


@pytest.mark.timeout(300)
def test_the_models_own_generate_runs_its_own_mask_while_an_engine_serves_it():
    """Outside an engine step ``prepare_dynamic_mask`` is the model's own (nothing stored right
    before on the thread): ``generate`` while an engine is open gives what it gave before."""
    model = _doge(random_a=True)
    prompt = family_sweep.prompts()[1]
    before = reference_greedy(model, prompt, NEW)
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32)))
    try:
        assert reference_greedy(model, prompt, NEW) == before
        served = eng.submit(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=120)
    finally:
        eng.close()
    assert served.output_token_ids == before
    assert all("prepare_dynamic_mask" not in layer.self_attn.__dict__ for layer in model.model.layers)


def test_the_bias_pool_is_sized_per_kv_head_beside_the_keys():
    """Each layer caches one float32 bias per KV head and token (its ``dt_proj``'s outputs): counted in
    the block's bytes."""
    model = _doge()
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=8)))
    try:
        spec = eng.cache.spec
        kvh, d = model.config.num_key_value_heads, model.model.layers[0].self_attn.head_dim
        assert [spec.layer(i).key_bias_heads for i in range(spec.num_layers)] == [kvh] * spec.num_layers
        assert spec.key_bias_shape(8, 0) == (8, 4, kvh)
        assert spec.layer_block_bytes(0) == 4 * kvh * 2 * d * 4 + 4 * kvh * 4
    finally:
        eng.close()


def test_a_dynamic_mask_without_a_projection_to_size_its_pool_is_refused_in_one_line():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_sweep.tiny_config("doge")).eval()
    del model.model.layers[1].self_attn.dt_proj
    with pytest.raises(ValueError) as err:
        LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    assert "\n" not in str(err.value) and "'doge'" in str(err.value) and "dynamic attention mask" in str(err.value)


def _doge_moe():
    """The tiny Doge with its CDMoE (16 product-key experts, 4 per token), ``A`` drawn, window 8, keep 4."""
    from transformers import AutoModelForCausalLM

    cfg = family_sweep.tiny_config("doge")
    cfg.is_moe, cfg.num_experts, cfg.num_experts_per_tok = True, 16, 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.copy_(torch.randn(layer.self_attn.A.shape, generator=g))
    return model


def test_the_cdmoe_routes_a_token_by_the_forward_it_is_in():
    """The reference itself: transformers' CDMoE pairs router-logit halves of different tokens of one
    forward, so a prompt's tokens route otherwise in one forward than one at a time (what the
    engine's per-request forwards must keep apart)."""
    model = _doge_moe()
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        together = mlp(x)[0]
        alone = torch.cat([mlp(x[:, i : i + 1])[0] for i in range(6)], dim=1)
    assert not torch.allclose(together, alone)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cdmoe_is_served_as_generate_routes_it(mode):
    """Doge's CDMoE routes a prompt's tokens together and each generated token alone: prompts
    prefilled whole (no prefix cache), decodes batched with other requests' rows, requests
    preempted (recomputed: prompt and generated tokens in one step; or swapped) give ``generate``'s
    tokens, and so do prompt-lookup drafts (each draft row routed alone)."""
    model = _doge_moe()
    prompts = _prompts()
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    extra = {"swap_space_gib": 0.01} if mode == "swap" else {}
    outs, stats = _serve(model, prompts, block_size=4, num_blocks=16, scheduler={"preemption_mode": mode}, **extra)
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64), prompt_lookup_num_tokens=3))
    try:
        assert not eng.config.cache.enable_prefix_caching
        looked_up = [
            eng.submit(p + p[:6], SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=120)
            for p in prompts[:2]
        ]
        drafted = eng.stats().num_draft_tokens
    finally:
        eng.close()
    assert drafted > 0, "the repeated prompts were meant to draft"
    assert [r.output_token_ids for r in looked_up] == [reference_greedy(model, p + p[:6], NEW) for p in prompts[:2]]


@pytest.mark.timeout(300)
def test_cdmoe_int8_equals_its_plain_torch_quantized_reference():
    """``quantization="int8"``: the CDMoE's router and shared expert linears are int8 (its expert
    embeddings stay float), tokens equal ``generate`` on the same weights dequantized in plain torch."""
    model = _doge_moe()
    prompts = family_sweep.prompts()
    outs, names = family_sweep.serve_int8(model, prompts)
    assert any(n.endswith("mlp.router_gate") for n in names) and any(n.endswith("mlp.up_proj") for n in names)
    reference = family_sweep.dequantized_copy(model, names)
    assert outs == [reference_greedy(reference, p, family_sweep.NEW_TOKENS) for p in prompts]


def test_a_cdmoe_prompt_longer_than_one_step_is_refused_at_build():
    model = _doge_moe()
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=16)
    )
    eng = LLMEngine(model, cfg)
    try:
        with pytest.raises(ValueError, match="router mixes tokens") as err:
            eng.build_request(list(range(3, 23)), SamplingParams(max_new_tokens=2))
        assert "\n" not in str(err.value)
    finally:
        eng.close()


@pytest.mark.timeout(300)
def test_compile_model_serves_a_dynamic_mask_eagerly_with_one_warning():
    """The compiled forward's attention op stores K/V itself, so the model's ``prepare_dynamic_mask``
    never sees a stored step: such a model runs eagerly, said once, tokens still ``generate``'s."""
    model = _doge(random_a=True)
    prompt = family_sweep.prompts()[1]
    with pytest.warns(RuntimeWarning, match="dynamic attention mask"):
        eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32), compile_model=True))
    try:
        served = eng.submit(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=120)
    finally:
        eng.close()
    assert served.output_token_ids == reference_greedy(model, prompt, NEW)
