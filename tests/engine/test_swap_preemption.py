"""Swap preemption on a real tiny model (greedy outputs equal ``generate``), cancellation of a
swapped request, the stats snapshot, and sizing the pool from memory (CPU checks; the CUDA
arithmetic with a mocked ``torch.cuda``, since the profiling forward itself runs here on CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.core.scheduler import PHASES
from hf_contbatch.engine.pool_sizing import KVGeometry, KVPoolSizer
from hf_contbatch.kernels.kv_spec import KVCacheSpec

from conftest import build_model, random_prompts, reference_greedy

LENGTHS = [1, 5, 17, 33, 64, 40, 9]
NEW = 16


def _tight(mode, swap_gib=0.01, num_blocks=22, **sched):
    # 22 blocks of 4 = 88 tokens for 7 requests of up to 80: preemption is certain (as in
    # test_engine_equivalence), and the 24-token budget chunks the long prompts.
    return EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, swap_space_gib=swap_gib),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, preemption_mode=mode, **sched),
    )


def _run(model, prompts, cfg, new=NEW):
    eng = LLMEngine(model, cfg)
    try:
        outs = [h.result(600) for h in [eng.submit(p, SamplingParams(max_new_tokens=new)) for p in prompts]]
        assert eng.wait_idle(10)
        eng.block_manager.check_invariants()
        eng.host_block_manager.check_invariants()
        return outs, eng.stats()
    finally:
        eng.close()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_greedy_equals_generate_under_swap_preemption(family, mode):
    model = build_model(family)
    prompts = random_prompts(LENGTHS, seed=3)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    # Mistral's layers slide over 8 tokens: a request holds at most 9 blocks of 4 (a 24-token chunk
    # and the 7 positions before it), 3 while it decodes; 8 blocks force preemption there.
    outs, stats = _run(model, prompts, _tight(mode, num_blocks=8 if family == "mistral" else 22))
    assert [o.output_token_ids for o in outs] == refs
    # On CPU the estimated swap cost per block is far below one recomputed token: auto swaps too.
    assert stats.num_preemptions_swap > 0 and stats.num_blocks_swapped_out > 0
    assert stats.num_blocks_swapped_in == stats.num_blocks_swapped_out  # every swapped request came back
    assert stats.num_swapped_blocks == 0 and stats.num_free_blocks == stats.num_blocks


@pytest.mark.timeout(1200)
def test_full_swap_pool_falls_back_to_recompute_and_stays_exact(llama_model):
    prompts = random_prompts(LENGTHS, seed=3)
    refs = [reference_greedy(llama_model, p, NEW) for p in prompts]
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 heads, 16 channels, float32
    outs, stats = _run(llama_model, prompts, _tight("swap", swap_gib=2 * block_bytes / 2**30))
    assert stats.num_swap_blocks == 2
    assert [o.output_token_ids for o in outs] == refs
    assert stats.num_swap_fallbacks > 0 and stats.num_preemptions_recompute > 0
    assert stats.num_preemptions == stats.num_preemptions_swap + stats.num_preemptions_recompute


@pytest.mark.timeout(1200)
def test_auto_mode_recomputes_when_swapping_is_priced_higher(llama_model):
    prompts = random_prompts(LENGTHS, seed=3)
    refs = [reference_greedy(llama_model, p, NEW) for p in prompts]
    outs, stats = _run(llama_model, prompts, _tight("auto", swap_cost_per_block=1e6))
    assert [o.output_token_ids for o in outs] == refs
    assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0


@pytest.mark.timeout(900)
def test_cancel_while_swapped_frees_host_blocks_and_returns_the_partial_output():
    model = build_model("llama")
    low_prompt, high_prompt = random_prompts([10, 12], seed=7)
    low_ref = reference_greedy(model, low_prompt, 200)
    high_ref = reference_greedy(model, high_prompt, 150)
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=128, swap_space_gib=0.01),
        scheduler=SchedulerConfig(max_num_seqs=1, preemption_mode="swap", aging_seconds=None),
    )
    eng = LLMEngine(model, cfg)
    try:
        low = eng.submit(low_prompt, SamplingParams(max_new_tokens=200), priority=5)
        stream = low.token_stream()
        for _ in range(3):
            next(stream)
        # One seat: the priority-0 request preempts the running priority-5 one, which is swapped out.
        high = eng.submit(high_prompt, SamplingParams(max_new_tokens=150), priority=0)
        deadline = time.monotonic() + 150
        while eng.stats().num_swapped != 1:
            assert time.monotonic() < deadline, "the low-priority request was never swapped out"
            time.sleep(0.005)
        swapped_blocks = eng.stats().num_swapped_blocks
        low.cancel()
        out_low = low.result(150)
        assert not high.done(), "the window closed: the cancel did not hit a swapped request"
        out_high = high.result(300)
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.host_block_manager.check_invariants()
    finally:
        eng.close()
    assert swapped_blocks > 0
    assert out_low.finish_reason == "cancelled" and len(out_low.output_token_ids) >= 3
    assert out_low.output_token_ids == low_ref[: len(out_low.output_token_ids)]
    assert out_high.output_token_ids == high_ref
    assert stats.num_swapped == 0 and stats.num_swapped_blocks == 0 and stats.num_free_blocks == 128


@pytest.mark.timeout(600)
def test_stats_snapshot_reports_memory_management_and_phase_times(llama_model):
    prompts = random_prompts(LENGTHS, seed=3)
    outs, stats = _run(llama_model, prompts, _tight("swap"))
    assert stats.capacity_tokens == 22 * 4 and stats.swap_capacity_tokens == stats.num_swap_blocks * 4
    assert stats.watermark_blocks == int(0.01 * 22)
    assert stats.num_preemptions == stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert (stats.num_waiting, stats.num_running, stats.num_swapped) == (0, 0, 0)
    assert [name for name, _ in stats.phase_seconds] == list(PHASES)
    assert all(seconds >= 0 for _, seconds in stats.phase_seconds)
    assert [name for name, _ in stats.last_phases] == list(PHASES)
    assert stats.swap_seconds > 0
    assert stats.block_ref_counts == (0,) * 22
    assert stats.prefix_caching is True  # the default, as in vLLM (hit counts: test_prefix_caching.py)
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        stats.num_swapped = 1  # a frozen snapshot


# --- sizing from memory ---------------------------------------------------------------------------------
def _sizer(eng: LLMEngine) -> KVPoolSizer:
    """The pool sizer ``eng`` asked at construction (same model, configuration and backend)."""
    return KVPoolSizer(eng.model, eng.config, KVGeometry.of(eng.model), device=eng.device, backend=eng.backend)


@pytest.mark.timeout(600)
def test_profiling_forward_runs_the_token_budget_through_the_paged_path(llama_model):
    eng = LLMEngine(
        llama_model,
        EngineConfig(
            cache=CacheConfig(block_size=4, num_blocks=8), scheduler=SchedulerConfig(max_num_batched_tokens=1100)
        ),
    )
    try:
        before = llama_model.config._attn_implementation
        cpu = [torch.device("cpu")] * eng.num_layers
        probe = _sizer(eng).profile_forward(cpu, KVCacheSpec(2, 4, 2, 16, torch.float32))
        assert llama_model.config._attn_implementation == before
        # 1100 tokens exceed the 512-token context: split into 512 + 512 + 76 -> 128 + 128 + 19 blocks.
        assert probe == {torch.device("cpu"): 275 * 2 * 2 * 4 * 2 * 16 * 4}  # K and V of 2 layers
        assert eng.submit([5, 6, 7], SamplingParams(max_new_tokens=3)).result(150).finish_reason == "length"
    finally:
        eng.close()


@pytest.mark.timeout(300)
def test_gpu_memory_utilization_sizing_subtracts_memory_in_use_and_the_activation_peak(llama_model, monkeypatch):
    gib = 2**30
    eng = LLMEngine(
        llama_model,
        EngineConfig(
            cache=CacheConfig(block_size=16, num_blocks=8, gpu_memory_utilization=0.5),
            scheduler=SchedulerConfig(max_num_batched_tokens=256),
        ),
    )
    try:
        d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
        memory = {
            d0: dict(total=80 * gib, free=70 * gib, allocated=2 * gib, peak=5 * gib),
            d1: dict(total=80 * gib, free=76 * gib, allocated=1 * gib, peak=3 * gib),
        }
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (memory[d]["free"], memory[d]["total"]))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: memory[d]["allocated"])
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: memory[d]["peak"])
        sizer = _sizer(eng)
        monkeypatch.setattr(sizer, "profile_forward", lambda devices, spec: {d0: gib, d1: gib // 2})
        per_layer_block = 2 * 16 * 2 * 16 * 4  # K and V of one layer: 16 tokens, 2 heads, 16 channels, float32
        spec = KVCacheSpec(2, 16, 2, 16, torch.float32)
        # One device: 80 * 0.5 - 10 in use - (5 - 2 - 1 probe) activation = 28 GiB over both layers.
        assert sizer.blocks_from_device_memory([d0, d0], spec) == int(28 * gib // (2 * per_layer_block))
        # Layers split over two devices: each holds one layer's slice; the tighter device decides.
        # d1: 40 - 4 - (3 - 1 - 0.5) = 34.5 GiB; d0: 28 GiB.
        assert sizer.blocks_from_device_memory([d0, d1], spec) == int(28 * gib // per_layer_block)
        memory[d0]["free"] = 30 * gib  # 50 GiB in use: above 0.5 of 80 GiB
        with pytest.raises(ValueError, match="gpu_memory_utilization=0.5"):
            sizer.blocks_from_device_memory([d0, d0], spec)
    finally:
        eng.close()


@pytest.mark.timeout(300)
def test_host_memory_checks_name_the_argument(llama_model):
    with pytest.raises(ValueError, match="cpu_cache_gib"):
        LLMEngine(llama_model, EngineConfig(cache=CacheConfig(cpu_cache_gib=1e7)))
    with pytest.raises(ValueError, match="swap_space_gib"):
        LLMEngine(
            llama_model,
            EngineConfig(
                cache=CacheConfig(num_blocks=8, swap_space_gib=1e7), scheduler=SchedulerConfig(preemption_mode="swap")
            ),
        )
