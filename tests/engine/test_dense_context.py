"""Models that compute attention in their own code over what ``cache.update`` returns (GPT-Neo,
Bloom, Falcon, MPT...): served through the cache object (``kernels.dense_context.DenseContextStep``,
``engine.dense_runner.DenseContextRunner``), exactly.

Greedy tokens equal transformers' own ``generate`` on each prompt alone (float32, CPU) for configs
that exercise what these families compute themselves: GPT-Neo's local-window layers with a window
shorter than the prompts (its causal buffer sliced by key index), Bloom's and Falcon's ALiBi built
from the 2-D attention mask, MPT's ALiBi counted from the last key, Falcon's new decoder
architecture (grouped K/V broadcast to the query heads before ``cache.update``), under chunked
prefill, a shared prompt prefix served from the prefix cache, and preemption (recompute and swap).
The cache view is specified against transformers' ``DynamicCache``; the types the check refuses are
refused in one line before any weight is touched.
"""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.core.plan import ScheduledRequest, StepPlan
from hf_contbatch.engine.dense_runner import DenseContextRunner
from hf_contbatch.kernels.attention.backends import TorchAttentionBackend
from hf_contbatch.kernels.attention.metadata import AttentionMetadata
from hf_contbatch.kernels.dense_context import DenseContextStep
from hf_contbatch.kernels.kv_spec import KVCacheSpec
from hf_contbatch.kernels.paged_cache import PagedKVCache

from conftest import load_family_sweep, reference_greedy, serve_greedy

family_sweep = load_family_sweep("family_sweep_dense")

NEW = 10
PREFIX = 13  # tokens the last two prompts share (prefix caching hits them)


def _tiny(model_type: str, **overrides):
    """A float32 random model of ``model_type``'s tiny sweep config with ``overrides`` (seed 0)."""
    from transformers import AutoModelForCausalLM

    cfg = family_sweep.tiny_config(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _prompts():
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, family_sweep.VOCAB, (PREFIX,), generator=g).tolist()
    rest = [torch.randint(3, family_sweep.VOCAB, (n,), generator=g).tolist() for n in (3, 22, 5, 9)]
    return [rest[0], rest[1], shared + rest[2], shared + rest[3]]


def _serve(model, prompts, cfg):
    """Greedy outputs of ``prompts`` queued together, and the stats; checks every block came back
    and that the dense-context runner served them."""

    def served_dense(engine):
        assert isinstance(engine.runner, DenseContextRunner)

    return serve_greedy(model, prompts, cfg, NEW, check=served_dense)


MODELS = {
    # window 4 < every prompt: the local layer's buffer masks keys the global layer sees
    "gpt_neo local window": ("gpt_neo", {"window_size": 4}),
    "bloom ALiBi": ("bloom", {}),
    "falcon ALiBi": ("falcon", {"alibi": True}),
    "falcon new decoder architecture": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "mpt ALiBi from the last key": ("mpt", {}),
    "xglm": ("xglm", {}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_refs(request):
    model_type, overrides = MODELS[request.param]
    model = _tiny(model_type, **overrides)
    prompts = _prompts()
    return model, prompts, [reference_greedy(model, p, NEW) for p in prompts]


@pytest.mark.timeout(300)
def test_chunked_prefill_prefix_cache_and_recompute_preemption_equal_generate(model_and_refs):
    model, prompts, refs = model_and_refs
    before = model.config._attn_implementation
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=14, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=8),  # the 22- and 18-token prompts in chunks
    )
    outs, stats = _serve(model, prompts, cfg)
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert model.config._attn_implementation == before, "the model's own attention was switched"


@pytest.mark.timeout(300)
def test_one_request_per_step_and_swap_preemption_equal_generate(model_and_refs):
    model, prompts, refs = model_and_refs
    one = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=16), scheduler=SchedulerConfig(max_num_seqs=1))
    assert _serve(model, prompts, one)[0] == refs
    swap = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=20), scheduler=SchedulerConfig(preemption_mode="swap")
    )
    outs, stats = _serve(model, prompts, swap)
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption (swap)"


@pytest.mark.timeout(120)
def test_prefix_cache_hit_serves_the_shared_prompt_from_the_pool():
    model = _tiny("bloom")
    prompts = _prompts()
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=True)))
    try:
        first = eng.submit(prompts[2], SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=120)
        second = eng.submit(prompts[3], SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=120)
        hits = eng.stats().prefix_cache_hit_tokens
    finally:
        eng.close()
    assert [first.output_token_ids, second.output_token_ids] == refs[2:]
    assert hits >= (PREFIX // 4) * 4, "the shared prefix's full blocks were meant to be hit"


def _pools(num_layers=2, heads=2, size=8, num_blocks=12, block_size=4):
    spec = KVCacheSpec(
        num_layers=num_layers, block_size=block_size, num_kv_heads=heads, head_size=size, dtype=torch.float32
    )
    return PagedKVCache(spec, num_blocks, [torch.device("cpu")] * num_layers, TorchAttentionBackend())


def _metadata(tables, past, n, block_size=4):
    slots = [t[p // block_size] * block_size + p % block_size for t in tables for p in range(past, past + n)]
    b = len(tables)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.arange(0, b * n + 1, n, dtype=torch.int32),
        seq_lens=torch.full((b,), past + n, dtype=torch.int32),
        block_tables=torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=b if n == 1 else 0,
        max_query_len=n,
        max_seq_len=past + n,
        query_start_loc_cpu=list(range(0, b * n + 1, n)),
        seq_lens_cpu=[past + n] * b,
        block_size=block_size,
        num_kv_heads=2,
    )


def test_update_returns_what_a_dynamic_cache_returns():
    """Forwards of 5, then 1, then 3 tokens for two rows: each ``update`` returns the K/V a
    ``DynamicCache`` returns for the same calls, and the mask-size queries answer as it does."""
    from transformers import DynamicCache

    cache = _pools()
    tables = [(3, 7, 2), (5, 0, 9)]  # rows' blocks scattered over the pool
    reference = DynamicCache()
    past = 0
    g = torch.Generator().manual_seed(0)
    for n in (5, 1, 3):
        step = DenseContextStep(cache, _metadata(tables, past, n), tables, past, n)
        assert step.get_seq_length() == reference.get_seq_length() == past
        assert step.get_mask_sizes(n, 0) == (past + n, 0)
        for layer in range(2):
            k = torch.randn(2, 2, n, 8, generator=g)
            v = torch.randn(2, 2, n, 8, generator=g)
            got_k, got_v = step.update(k, v, layer)
            want_k, want_v = reference.update(k, v, layer)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        step.check_stored()
        past += n


def test_update_refuses_what_the_pool_cannot_hold_in_one_line():
    cache = _pools()
    tables = [(1, 2)]
    step = DenseContextStep(cache, _metadata(tables, 0, 2), tables, 0, 2)
    with pytest.raises(ValueError, match="not served by hf_contbatch") as err:
        step.update(torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8), 0)  # 3 heads, the pool holds 2
    assert "\n" not in str(err.value)
    step.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), 0)
    with pytest.raises(ValueError, match="twice"):
        step.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), 0)
    with pytest.raises(ValueError, match=r"no K/V through cache.update for layers \[1\]"):
        step.check_stored()


def test_update_stores_heads_the_model_broadcast_once():
    """Falcon's new decoder architecture hands ``update`` its 2 K/V heads broadcast to 4 query heads:
    2 are stored, and the past comes back broadcast the same way."""
    cache = _pools(num_layers=1)
    tables = [(4, 6)]
    g = torch.Generator().manual_seed(1)
    first = torch.randn(1, 2, 3, 8, generator=g)
    step = DenseContextStep(cache, _metadata(tables, 0, 3), tables, 0, 3)
    k = first.repeat_interleave(2, dim=1)
    step.update(k, k.clone(), 0)
    new = torch.randn(1, 2, 1, 8, generator=g).repeat_interleave(2, dim=1)
    step = DenseContextStep(cache, _metadata(tables, 3, 1), tables, 3, 1)
    got_k, _ = step.update(new, new.clone(), 0)
    assert torch.equal(got_k, torch.cat([k, new], dim=2))
    assert torch.equal(cache.key_cache[0][4, :3], first[0].transpose(0, 1))  # 2 heads stored, not 4


def test_a_step_runs_one_forward_per_shape_of_rows():
    """Rows group by (stored length, new tokens), in plan order: equal-length decodes together, a
    prefill chunk alone."""
    rows = [
        ScheduledRequest(num_new_tokens=1, samples=True, request_id=1, start_position=9, is_decode=True),
        ScheduledRequest(num_new_tokens=1, samples=True, request_id=2, start_position=4, is_decode=True),
        ScheduledRequest(num_new_tokens=1, samples=True, request_id=3, start_position=9, is_decode=True),
        ScheduledRequest(num_new_tokens=6, samples=False, request_id=4, start_position=0),
    ]
    plan = StepPlan(iteration=0, scheduled=rows)
    parts = DenseContextRunner._parts(plan)
    assert [[s.request_id for s in part] for part in parts] == [[1, 3], [2], [4]]
    # A model taking position_ids gets its decodes as one left-padded batch, as generate batches.
    parts = DenseContextRunner._parts(plan, pad_decodes=True)
    assert [[s.request_id for s in part] for part in parts] == [[1, 2, 3], [4]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type, pads", [("gpt_neo", True), ("falcon", True), ("trocr", False), ("bloom", False)])
def test_decodes_of_different_lengths_share_a_forward_only_where_positions_are_given(model_type, pads):
    """TrOCR counts positions from the cache's length and Bloom takes no position_ids: their decodes
    group by length; GPT-Neo and Falcon take each row's positions and get one left-padded batch."""
    eng = LLMEngine(_tiny(model_type), EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    try:
        assert eng.runner.pads_decodes is pads
    finally:
        eng.close()


def test_rows_of_different_stored_lengths_come_back_left_padded():
    """Two decode rows with 5 and 2 positions stored: each gets its own stored K/V, right-aligned
    before its new token, zeros in front; the sizes are those of the left-padded batch."""
    cache = _pools(num_layers=1)
    tables = [(2, 8), (6,)]
    g = torch.Generator().manual_seed(2)
    stored = [torch.randn(1, 2, n, 8, generator=g) for n in (5, 2)]
    for t, kv in zip(tables, stored):  # each row's past, stored by a forward of its own
        n = kv.shape[2]
        DenseContextStep(cache, _metadata([t], 0, n), [t], 0, n).update(kv, kv.clone(), 0)
    step = DenseContextStep(cache, _one_token_metadata(tables, [5, 2]), tables, [5, 2], 1)
    assert (step.past, step.padding(), step.get_seq_length(), step.get_mask_sizes(1, 0)) == (5, [0, 3], 5, (6, 0))
    new = torch.randn(2, 2, 1, 8, generator=g)
    got, _ = step.update(new, new.clone(), 0)
    assert got.shape == (2, 2, 6, 8)
    assert torch.equal(got[0], torch.cat([stored[0][0], new[0]], dim=1))
    assert torch.equal(got[1, :, :3], torch.zeros(2, 3, 8))
    assert torch.equal(got[1, :, 3:], torch.cat([stored[1][0], new[1]], dim=1))


def _one_token_metadata(tables, pasts, block_size=4):
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, pasts)]
    b, width = len(tables), max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.arange(0, b + 1, dtype=torch.int32),
        seq_lens=torch.tensor([p + 1 for p in pasts], dtype=torch.int32),
        block_tables=torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=b,
        max_query_len=1,
        max_seq_len=max(pasts) + 1,
        query_start_loc_cpu=list(range(b + 1)),
        seq_lens_cpu=[p + 1 for p in pasts],
        block_size=block_size,
        num_kv_heads=2,
    )


def _meta_model(model_type):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family_sweep.tiny_config(model_type)).eval()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "model_type, why",
    [
        ("openai-gpt", "no KV cache"),
        ("rwkv", "recurrent state of its own"),
        ("xlnet", "memory of past hidden states"),
        ("xlm", "key_cache lists"),
        ("cpmant", "prompt tokens"),
    ],
)
def test_models_the_cache_cannot_serve_are_refused_in_one_line_before_any_weight(model_type, why):
    with pytest.raises(ValueError) as err:
        LLMEngine(_meta_model(model_type), EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    message = str(err.value)
    assert "\n" not in message and f"model type {model_type!r} is not served by hf_contbatch" in message
    assert why in message


@pytest.mark.timeout(60)
def test_compile_model_is_refused_for_such_a_model():
    model = _tiny("gpt_neo")
    with pytest.raises(ValueError, match="compile_model=True is not served"):
        LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8), compile_model=True))


@pytest.mark.timeout(60)
def test_an_open_engine_counts_as_serving_the_model_without_switching_its_attention():
    """Nothing to switch, but the model is served: ``quality_report`` and a second weight format see it."""
    from hf_contbatch.engine.attention_switch import num_open_engines

    model = _tiny("mpt")
    before = model.config._attn_implementation
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    try:
        assert num_open_engines(model) == 1
        assert model.config._attn_implementation == before
    finally:
        eng.close()
    assert num_open_engines(model) == 0
    assert model.config._attn_implementation == before


@pytest.mark.timeout(300)
def test_prompt_lookup_drafts_and_parallel_sequences_equal_generate():
    """Draft verification rows (``1 + m`` tokens over a stored past) and forked sequences sharing a
    prompt's blocks (copy-on-write of the partial one) run through the same cache view."""
    model = _tiny("gpt_neo", window_size=4)
    g = torch.Generator().manual_seed(11)
    motif = torch.randint(3, family_sweep.VOCAB, (5,), generator=g).tolist()
    prompts = [motif * 4 + motif[:2], _prompts()[1]]  # a repetitive prompt gets drafts
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64), prompt_lookup_num_tokens=3)
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        assert [h.result(timeout=120).output_token_ids for h in handles] == refs
        assert eng.stats().num_draft_tokens > 0, "the repetitive prompt was meant to get drafts"
        forks = eng.submit(prompts[1], SamplingParams(max_new_tokens=NEW, ignore_eos=True), num_return_sequences=3)
        assert [h.result(timeout=120).output_token_ids for h in forks] == [refs[1]] * 3
        assert eng.wait_idle(10)
        stats = eng.stats()
        assert stats.num_forks > 0 and stats.num_free_blocks == stats.num_blocks
    finally:
        eng.close()


@pytest.mark.timeout(120)
def test_prompt_log_probs_equal_the_models_own_forward():
    """Scored prompt rows come from the rows of the forward that computed them: each equals
    ``log_softmax`` of the model's own forward over the whole prompt."""
    model = _tiny("bloom")
    prompt = _prompts()[1]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = [want[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=32), scheduler=SchedulerConfig(max_num_batched_tokens=8)
    )
    eng = LLMEngine(model, cfg)
    try:
        h = eng.submit(prompt, SamplingParams(max_new_tokens=1, prompt_logprobs=1))
        h.result(timeout=120)
        got = [lp for lp, _ in h.request.prompt_logprobs[1 : len(prompt)]]
    finally:
        eng.close()
    assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.timeout(300)
def test_mpt_context_is_its_max_seq_len():
    """MPT's config has no ``max_position_embeddings``: its context is ``max_seq_len`` (the ALiBi bias
    its forward builds is that long; transformers' own ``generate`` fails feeding more). A prompt of the
    whole context is refused in one line naming it, and a request reaching it finishes "length"
    with ``generate``'s tokens up to it (28 prompt tokens of 32: 4 new tokens), its blocks freed."""
    model = _tiny("mpt", max_seq_len=32)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, family_sweep.VOCAB, (28,), generator=g).tolist()
    with pytest.raises(RuntimeError):
        reference_greedy(model, prompt, 6)  # the model's own forward of 33 tokens, past max_seq_len
    ref = reference_greedy(model, prompt, 4)
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)))
    try:
        with pytest.raises(ValueError, match="prompt of 32 tokens \\+ 1 new token exceeds the model's context of 32"):
            eng.submit(prompt + prompt[:4], SamplingParams(max_new_tokens=2))
        out = eng.submit(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True)).result(120)
        assert eng.wait_idle(10)
        stats = eng.stats()
    finally:
        eng.close()
    assert out.output_token_ids == ref
    assert out.finish_reason == "length"
    assert stats.num_free_blocks == stats.num_blocks
