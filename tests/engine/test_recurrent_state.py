"""Models with recurrent layers (Mamba, gated delta-net, short convolutions, hybrids): a state per
request in a slot, served exactly.

Greedy tokens equal transformers' own ``generate`` on each prompt alone (float32, CPU), for a pure
recurrent model (Mamba) and hybrids (Qwen3-Next: gated delta-net and full attention; LFM2: short
convolutions and attention; Zamba 2: Mamba layers with a shared attention block; Falcon-H1: Mamba 2
and attention side by side in each layer; Inkling: short convolutions over K, V and each block's
output, a relative position bias and log-scaled queries computed from the cache's positions; Inkling 2:
per-query attention sinks too; Inkling 2 Loop: a layer run in two passes, each with its cache layer),
several requests
of different lengths at once, one at a time, and under forced preemption (recompute, including a
resumed request longer than one step's token budget). Slots are given back, blocks too; what the
engine cannot serve for such a model is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.scheduler import Scheduler
from hf_contbatch.kernels.recurrent_state import RecurrentStatePool
from hf_contbatch.request import Request

from conftest import load_family_sweep, reference_greedy

family_sweep = load_family_sweep()

NEW = 12
LENGTHS = (3, 9, 17, 26)


def _prompts(lengths=LENGTHS):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, family_sweep.VOCAB, (n,), generator=g).tolist() for n in lengths]


def _tiny_inkling():
    """Inkling with the sweep's tiny sizes, where position matters within the test's contexts (3 to
    38 tokens): the full-attention layer's relative position bias reaches back 6 tokens (beyond, it
    is 0) and its queries and bias are log-scaled from position 4 on; the sliding layer's window (8
    tokens) bounds its bias too. Sliding layers of 4 heads of 16 over 2 KV heads (the config's
    default 64 of 128 would only slow the test). The random weights would leave attention nearly
    uniform, the bias near 0 and attention's share of the residual stream small (RMS-normed Q and K
    at a 1/d scale, weights of std 0.02): the Q/K norm weights, the bias profiles and the output
    projection are scaled up, so that without the bias about half the greedy tokens of a prompt's
    forward change."""
    from transformers import AutoModelForCausalLM

    cfg = family_sweep.tiny_config("inkling_text")
    cfg.rel_extent, cfg.log_scaling_n_floor, cfg.log_scaling_alpha = 6, 4, 0.5
    cfg.swa_num_attention_heads, cfg.swa_num_key_value_heads, cfg.swa_head_dim = 4, 2, 16
    assert cfg.layer_types == ["hybrid_sliding", "hybrid"] and cfg.sliding_window_size == 8
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_norm.weight.fill_(4.0)
            attn.k_norm.weight.fill_(4.0)
            attn.rel_logits_proj.proj.normal_(0.0, 3.0)
            attn.o_proj.weight.mul_(30.0)
    return model


def _tiny_inkling2(model_type="inkling2_text"):
    """Inkling 2 as :func:`_tiny_inkling` sets Inkling up (a 6-token bias reach, log-scaled queries
    and relative states from position 4, 4 sliding heads of 16), with its per-query attention sinks
    (one logit per token and head from its hidden state) and bias profiles scaled up from their
    near-zero random values: without either, most greedy tokens of a prompt's forward change.
    ``inkling2_loop_text``: the sweep's three layers, the middle one run in two passes, the second
    with cache layers of its own."""
    from transformers import AutoModelForCausalLM

    cfg = family_sweep.tiny_config(model_type)
    cfg.rel_extent, cfg.log_scaling_n_floor, cfg.log_scaling_alpha = 6, 4, 0.5
    cfg.swa_num_attention_heads, cfg.swa_num_key_value_heads, cfg.swa_head_dim = 4, 2, 16
    assert "hybrid" in cfg.layer_types and "hybrid_sliding" in cfg.layer_types and cfg.sliding_window_size == 8
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sink_proj.weight.normal_(0.0, 1.0)
            layer.self_attn.relative_position_bias.proj.normal_(0.0, 3.0)
    return model


_HAND_BUILT = {
    "inkling_text": _tiny_inkling,
    "inkling2_text": _tiny_inkling2,
    "inkling2_loop_text": lambda: _tiny_inkling2("inkling2_loop_text"),
}


@pytest.fixture(
    scope="module",
    params=[
        "mamba",
        "qwen3_next",
        "lfm2",
        "zamba2",
        "falcon_h1",
        "inkling_text",
        "inkling2_text",
        "inkling2_loop_text",
    ],
)
def model_and_refs(request):
    build = _HAND_BUILT.get(request.param)
    model = build() if build is not None else family_sweep.build_tiny(request.param)
    prompts = _prompts()
    return request.param, model, prompts, [reference_greedy(model, p, NEW) for p in prompts]


def _serve(model, prompts, cfg, sampling=None):
    """Greedy outputs of ``prompts`` served together; checks that every slot and block came back."""
    eng = LLMEngine(model, cfg)
    try:
        sp = sampling or SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        handles = [eng.submit(p, sp) for p in prompts]
        outs = [h.result(timeout=120).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
        assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
        states = eng.runner.states
        assert states.num_held == 0 and states.num_free == states.num_slots, "state slots leaked"
        return outs, stats
    finally:
        eng.close()


@pytest.mark.timeout(300)
def test_greedy_equals_generate_for_requests_of_different_lengths_at_once(model_and_refs):
    _, model, prompts, refs = model_and_refs
    outs, _ = _serve(model, prompts, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32)))
    assert outs == refs


@pytest.mark.timeout(300)
def test_greedy_equals_generate_one_request_at_a_time(model_and_refs):
    _, model, prompts, refs = model_and_refs
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=1))
    outs, _ = _serve(model, prompts, cfg)
    assert outs == refs


@pytest.mark.timeout(300)
def test_greedy_equals_generate_under_forced_preemption(model_and_refs):
    """14 blocks of 4 tokens (56) for requests of 15 to 38 tokens: some are preempted and recomputed.
    A 30-token budget: the 26-token prompt prefills whole, and a request resumed with more than 30
    tokens runs its first 30 as a prefill and the rest one token per forward."""
    model_type, model, prompts, refs = model_and_refs
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=14),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=30),
    )
    outs, stats = _serve(model, prompts, cfg)
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", ["mamba", "qwen3_next", "deepseek_v4"])
def test_a_request_resumed_with_more_tokens_than_a_step_holds_continues_one_token_at_a_time(model_type):
    """A 26-token prompt preempted after about 14 tokens comes back with 40 tokens under a 30-token
    budget: its first 30 run as a prefill, the next 10 one per forward from the state the prefill
    left (the path ``generate`` took for them; DeepSeek V4: the cache it left), and its tokens still
    equal ``generate``'s."""
    model = family_sweep.build_tiny(model_type)
    short, long = _prompts((3, 26))
    refs = [reference_greedy(model, short, 30), reference_greedy(model, long, 20)]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=14),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=30),
    )
    eng = LLMEngine(model, cfg)
    continued = []
    parts = eng.runner._parts

    def spy(plan):  # the rows that continue a prefill (start > 0, several tokens)
        continued.extend(s.num_new_tokens for s in plan.scheduled if s.start_position > 0 and s.num_new_tokens > 1)
        return parts(plan)

    eng.runner._parts = spy
    try:
        handles = [
            eng.submit(short, SamplingParams(max_new_tokens=30, ignore_eos=True)),
            eng.submit(long, SamplingParams(max_new_tokens=20, ignore_eos=True)),
        ]
        outs = [h.result(timeout=120).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        assert eng.stats().num_preemptions > 0
        assert eng.runner.states.num_held == 0
        # A model keeping its own caches (OwnCacheModelRunner) gives every request's cache back too.
        assert getattr(eng.runner, "_caches", {}) == {}
    finally:
        eng.close()
    assert outs == refs
    assert continued, "no request was resumed with more tokens than one step holds"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", ["mamba", "qwen3_next"])
def test_prompt_logprobs_equal_the_models_own_forward(model_type):
    """Scoring a prompt (lm-eval's path) while other requests decode: each position's log-prob of
    the next prompt token equals the log-softmax of the model's own forward over the prompt."""
    model = family_sweep.build_tiny(model_type)
    scored, other = _prompts((17, 9))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([scored])).logits[0].float(), -1)
    expected = [ref[p, scored[p + 1]].item() for p in range(len(scored) - 1)]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32)))
    try:
        busy = eng.submit(other, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        h = eng.submit(scored[:-1], SamplingParams(max_new_tokens=1, prompt_logprobs=1, score_token_id=scored[-1]))
        h.result(120)
        busy.result(120)
        got = [lp for lp, _ in h.request.prompt_logprobs[1:]]
    finally:
        eng.close()
    assert got == pytest.approx(expected, abs=1e-4)


@pytest.mark.timeout(300)
def test_parallel_sequences_run_as_independent_requests():
    """``num_return_sequences=2`` cannot fork a recurrent state: the second sequence is its own
    request with seed + 1, so it samples what a request submitted alone with that seed samples."""
    model = family_sweep.build_tiny("lfm2")
    prompt = _prompts((9,))[0]
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32))

    def sampled(seed, n=None):
        eng = LLMEngine(model, cfg)
        try:
            sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True, do_sample=True, seed=seed)
            got = eng.submit(prompt, sp, num_return_sequences=n)
            return [h.result(timeout=120).output_token_ids for h in (got if n else [got])]
        finally:
            eng.close()

    assert sampled(7, n=2) == sampled(7) + sampled(8)


@pytest.mark.timeout(120)
def test_a_prompt_no_step_can_prefill_whole_is_rejected_in_one_line():
    model = family_sweep.build_tiny("mamba")
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=32), scheduler=SchedulerConfig(max_num_batched_tokens=16)
    )
    eng = LLMEngine(model, cfg)
    try:
        with pytest.raises(ValueError, match="prefills a prompt in one step") as err:
            eng.submit(list(range(3, 20)), SamplingParams(max_new_tokens=4))
        assert "\n" not in str(err.value) and "17 tokens" in str(err.value)
        with pytest.raises(ValueError, match="prompt-lookup drafts"):
            eng.submit([3, 4, 5], SamplingParams(max_new_tokens=4, prompt_lookup_num_tokens=2))
        # What it refused left nothing behind: a prompt that fits runs.
        assert len(eng.submit(list(range(3, 19)), SamplingParams(max_new_tokens=2)).result(60).output_token_ids) == 2
    finally:
        eng.close()


@pytest.mark.timeout(120)
def test_engine_settings_a_recurrent_model_cannot_serve_are_refused_or_turned_off(monkeypatch):
    model = family_sweep.build_tiny("mamba")
    with pytest.raises(ValueError, match="recurrent layers: prompt-lookup drafts") as err:
        LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=8), prompt_lookup_num_tokens=2))
    assert "model type 'mamba'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="recurrent layers: compile_model=True"):
        LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=8), compile_model=True))
    monkeypatch.setenv("HF_CONTBATCH_COMPILE", "1")  # a default from the environment is turned off
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=8, enable_prefix_caching=True),
        scheduler=SchedulerConfig(preemption_mode="swap", long_prefill_token_threshold=4),
    )
    eng = LLMEngine(model, cfg)
    try:
        assert not eng.block_manager.enable_prefix_caching
        assert eng.config.scheduler.preemption_mode == "recompute"
        assert eng.config.scheduler.long_prefill_token_threshold is None
        assert eng.config.scheduler.per_request_state
        assert eng.config.compile_model is False and eng.compiled_forward is None
    finally:
        eng.close()


@pytest.mark.timeout(60)
def test_recurrent_layers_keeping_their_state_on_the_modules_are_refused_before_any_weight_is_touched():
    """RecurrentGemma's RG-LRU keeps its state on the module, not in the cache it is given: a state
    the engine would share between requests (wrong tokens), so the model is refused in one line."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = CONFIG_MAPPING["recurrent_gemma"](
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=3, head_dim=16
    )
    with torch.device("meta"):  # reading a weight would fail
        model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="keep their state on the modules") as err:
        LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    assert "model type 'recurrent_gemma'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(120)
def test_a_prefill_that_writes_no_state_fails_at_the_first_step_rather_than_a_wrong_token(monkeypatch):
    """The runtime net under the static check: with that check fooled, RecurrentGemma's first
    prefill hands the cache no state, and its request fails with one line instead of decoding."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from hf_contbatch.engine import model_support
    from hf_contbatch.engine.llm_engine import EngineError

    cfg = CONFIG_MAPPING["recurrent_gemma"](
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=3, head_dim=16
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    monkeypatch.setattr(model_support, "_state_through_cache", lambda model: True)
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    try:
        handle = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
        with pytest.raises(EngineError, match="wrote no recurrent state") as err:
            handle.result(timeout=60)
        assert isinstance(err.value.__cause__, ValueError) and "\n" not in str(err.value.__cause__)
    finally:
        eng.close()


# --- the state pool ------------------------------------------------------------------------------
def test_state_pool_hands_out_the_lowest_free_slot_and_refuses_when_all_are_held():
    pool = RecurrentStatePool(3)
    assert [pool.allocate(r) for r in (10, 11, 12)] == [0, 1, 2]
    assert pool.allocate(11) == 1  # a request holds one slot
    with pytest.raises(RuntimeError, match="all 3 are held"):
        pool.allocate(13)
    pool.free(10)
    pool.free(10)  # twice: nothing more
    assert pool.num_free == 1 and pool.allocate(13) == 0
    assert pool.num_held == 3


def test_state_pool_keeps_each_slot_apart_and_grows_by_doubling_up_to_its_slots():
    pool = RecurrentStatePool(5)
    key = (0, "recurrent", 0)
    assert pool.read(key, torch.tensor([0])) is None  # nothing written yet
    a = torch.arange(6.0).reshape(1, 2, 3)
    pool.write(key, [0], a)
    assert pool.nbytes == 1 * 6 * 4  # one row: only slot 0 written
    b = -torch.arange(6.0).reshape(1, 2, 3)
    pool.write(key, [2], b)  # 1 -> 2 -> 4 rows
    assert pool.nbytes == 4 * 6 * 4
    pool.write(key, [4], a + 100)  # 4 -> 8, capped at 5
    assert pool.nbytes == 5 * 6 * 4
    got = pool.read(key, torch.tensor([2, 0, 4]))
    assert torch.equal(got, torch.cat([b, a, a + 100]))
    with pytest.raises(RuntimeError, match="changed shape"):
        pool.write(key, [1], torch.zeros(1, 3, 3))


# --- the scheduler's whole prefills -------------------------------------------------------------
def test_per_request_state_prefills_whole_or_waits_for_a_step_with_room():
    """A prompt that fits one step's budget is never chunked: it waits for a step with room. One
    with more tokens than any step holds (a resumed request) still runs, in chunks."""
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, watermark=0.0, per_request_state=True), bm)
    sched.add_request(Request(0, list(range(3, 10)), SamplingParams(max_new_tokens=4)))  # 7 tokens
    sched.add_request(Request(1, list(range(3, 9)), SamplingParams(max_new_tokens=4)))  # 6: 3 left, waits
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.plan.scheduled] == [(0, 7)]
    long = Scheduler(SchedulerConfig(max_num_batched_tokens=10, watermark=0.0, per_request_state=True), bm)
    long.add_request(Request(2, list(range(3, 28)), SamplingParams(max_new_tokens=4)))  # 25 > 10: chunks
    assert [s.num_new_tokens for s in long.schedule().plan.scheduled] == [10]
    # Resumed with its generated tokens (more than a step holds), a request still starts with its
    # whole prompt: while another's rows leave less room than the prompt, it waits.
    resumed = Scheduler(SchedulerConfig(max_num_batched_tokens=10, watermark=0.0, per_request_state=True), bm)
    resumed.add_request(Request(3, list(range(3, 7)), SamplingParams(max_new_tokens=4)))  # 4 tokens
    again = Request(4, list(range(3, 11)), SamplingParams(max_new_tokens=20))  # an 8-token prompt
    again.output_token_ids.extend(range(11, 17))  # 6 generated before a preemption: 14 to recompute
    resumed.add_request(again)
    assert again.num_tokens == 14 and again.num_prompt_tokens == 8
    # 6 tokens left after the first request's 4: less than the 8-token prompt, so it waits.
    assert [(s.request_id, s.num_new_tokens) for s in resumed.schedule().plan.scheduled] == [(3, 4)]
