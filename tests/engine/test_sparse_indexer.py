"""Sparse attention's indexer (DeepSeek V3.2's DSA and kin) in an engine: the indexer's top-k per
request over the rows ``generate`` builds (``engine.sparse_indexer``), so keys tying at the top-k's
cut are cut as ``generate`` cuts them; the model's own ``generate`` while an engine serves it.
Expected tokens are transformers' ``generate`` on the same tiny random model."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

from conftest import load_family_sweep, reference_greedy

family_sweep = load_family_sweep()

NEW = 16


def _ties_at_the_cut(model, prompt) -> int:
    """Query rows of ``generate``'s prefill whose top-k cut falls among equal scores (finite ones)."""
    found = []
    original = torch.Tensor.topk

    def spy(self, k, dim=-1, *args, **kwargs):
        out = original(self, k, dim, *args, **kwargs)
        if self.dim() == 3:  # the indexer's [B, S, T] scores
            kth = out.values[..., -1:]
            found.append(int((((self == kth).sum(-1) > 1) & torch.isfinite(kth[..., 0])).sum()))
        return out

    torch.Tensor.topk = spy
    try:
        with torch.no_grad():
            model(torch.tensor([prompt]))
    finally:
        torch.Tensor.topk = original
    return sum(found)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("budget", [12, 5])
def test_tied_scores_are_cut_as_generate_cuts_them_under_chunks_and_recompute(budget):
    """The sweep's tiny DeepSeek V3.2 (4 indexer heads, top-4) has keys tying at the cut in its
    prefill; chunked prefills, decodes batched with them and requests recomputed after preemption
    still pick what ``generate`` picks, token for token."""
    model = family_sweep.build_tiny("deepseek_v32")
    prompts = family_sweep.prompts() * 2
    assert _ties_at_the_cut(model, prompts[1]) > 0, "the tiny config was meant to tie at the cut"
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=14),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget),
    )
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        outs = [h.result(timeout=240).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        stats = eng.stats()
        eng.block_manager.check_invariants()
    finally:
        eng.close()
    assert outs == refs
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"


@pytest.mark.timeout(300)
def test_the_models_own_generate_keeps_its_sparse_attention_while_an_engine_serves_it():
    """While an engine serves the model its attention implementation is the engine's, so the model
    passes its top-k to attention rather than folding it into the mask: outside an engine step the
    attention function folds it as the model's eager/SDPA path does."""
    model = family_sweep.build_tiny("glm_moe_dsa")
    prompt = family_sweep.prompts()[1]
    before = reference_greedy(model, prompt, NEW)
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    try:
        assert reference_greedy(model, prompt, NEW) == before
    finally:
        eng.close()


@pytest.mark.timeout(300)
def test_a_prefix_cache_hit_reads_the_indexer_keys_its_blocks_hold():
    """A second prompt sharing the first's 16-token prefix reuses its blocks, indexer keys included
    (computed from the same tokens): its tokens still equal ``generate``'s."""
    model = family_sweep.build_tiny("deepseek_v32")
    first = family_sweep.prompts()[1]
    second = first[:16] + [7, 11, 13, 17, 19]
    refs = [reference_greedy(model, p, NEW) for p in (first, second)]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32)))
    try:
        outs = [eng.submit(first, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=120)]
        outs.append(eng.submit(second, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=120))
        stats = eng.stats()
    finally:
        eng.close()
    assert [o.output_token_ids for o in outs] == refs
    assert stats.prefix_cache_hit_tokens >= 16, "the second prompt was meant to hit the prefix cache"
