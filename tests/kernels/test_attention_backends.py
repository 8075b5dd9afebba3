"""Which attention backend object an engine gets, for which request, device, dtype and environment;
and that each engine step's metadata belongs to that step alone."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from hf_contbatch.kernels.attention.backends import (
    CPUKernelAttentionBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
    select_backend,
)
from hf_contbatch.kernels.kv_spec import KVCacheSpec
from hf_contbatch.kernels.paged_cache import PagedKVCache

from conftest import build_model, random_prompts, reference_greedy

CPU = torch.device("cpu")


def _spec(dtype=torch.float32, **kw):
    return KVCacheSpec(**{**dict(num_layers=2, block_size=16, num_kv_heads=2, head_size=16, dtype=dtype), **kw})


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv("HF_CONTBATCH_ATTENTION_BACKEND", raising=False)


@pytest.mark.parametrize("requested", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_float32_bf16_and_fp16_pools_get_the_c_kernel_backend(requested, dtype):
    # float16: the kernels read it where the compiler has _Float16 (else they leave it to the torch path)
    backend = select_backend(requested, CPU, _spec(dtype), num_heads=4)
    assert type(backend) is CPUKernelAttentionBackend and backend.name == "torch"


def test_a_layer_off_the_cpu_gets_plain_torch():
    meta = torch.device("meta")
    backend = select_backend("torch", CPU, _spec(), num_heads=4, layer_devices=[CPU, meta])
    assert type(backend) is TorchAttentionBackend


def test_each_selection_is_a_new_object():
    # per-engine state (the C kernel's timing choice) must not be shared between engines
    a, b = select_backend("auto", CPU, _spec(), 4), select_backend("auto", CPU, _spec(), 4)
    assert a is not b and a.decode_kernel is not b.decode_kernel


def test_the_environment_overrides_auto_only(monkeypatch):
    monkeypatch.setenv("HF_CONTBATCH_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    assert type(select_backend("auto", CPU, _spec(), 4)) is TritonAttentionBackend
    assert type(select_backend("torch", CPU, _spec(), 4)) is CPUKernelAttentionBackend
    monkeypatch.setenv("HF_CONTBATCH_ATTENTION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="HF_CONTBATCH_ATTENTION_BACKEND"):
        select_backend("auto", CPU, _spec(), 4)


def test_triton_on_cpu_needs_the_interpreter_and_unknown_names_fail(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", CPU, _spec(), 4)
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("flash", CPU, _spec(), 4)


def test_only_the_triton_backends_say_their_decode_step_can_be_captured_in_a_cuda_graph():
    from hf_contbatch.kernels.attention import backends as b

    # The torch path loops over each step's host-side lists and the CPU paths have no CUDA graphs;
    # the Triton launches depend on tensor shapes alone.
    capturable = {b.TritonAttentionBackend, b.Int8TritonAttentionBackend}
    classes = [
        b.TorchAttentionBackend,
        b.Int8TorchAttentionBackend,
        b.TritonAttentionBackend,
        b.Int8TritonAttentionBackend,
    ]
    for cls in classes:
        assert cls().supports_graph_capture is (cls in capturable), cls
    for backend in (
        select_backend("torch", CPU, _spec(), num_heads=4),
        select_backend(
            "torch", CPU, _spec(torch.int8, scale_dtype=torch.float32, scales_per_token_head=1), num_heads=4
        ),
    ):
        assert backend.supports_graph_capture is False


def test_a_float_backend_refuses_a_layout_with_scales():
    spec = _spec(torch.int8, scale_dtype=torch.float16, scales_per_token_head=1)
    with pytest.raises(ValueError, match="one float32 scale per token"):  # int8 layouts: float32 scales only
        select_backend("torch", CPU, spec, 4)
    with pytest.raises(ValueError, match="float K/V only"):
        PagedKVCache(spec, 4, [CPU, CPU], TorchAttentionBackend())


def test_the_cache_holds_no_step_state_and_views_are_independent():
    cache = PagedKVCache(_spec(block_size=4), 8, [CPU, CPU], TorchAttentionBackend())
    assert not hasattr(cache, "metadata")
    a, b = cache.for_step("meta a"), cache.for_step("meta b")
    assert (a.metadata, b.metadata) == ("meta a", "meta b") and a.cache is b.cache is cache


@pytest.mark.timeout(1500)
def test_two_engines_stepping_at_once_each_read_their_own_metadata():
    """Two engines (one model each) step in two threads at once; every K/V store of an engine sees
    a slot mapping of that engine's own step, and both generate what ``generate`` does."""
    models = [build_model("llama", seed=0), build_model("qwen2", seed=1)]
    prompts = random_prompts([5, 11, 20], seed=4)
    refs = [[reference_greedy(m, p, 8) for p in prompts] for m in models]
    engines = [LLMEngine(m, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64))) for m in models]
    stores = [0, 0]
    try:
        for i, eng in enumerate(engines):
            own_pools = {t.data_ptr() for t in eng.cache.key_cache}
            store = eng.cache.backend.store_kv

            def spy(key, value, k_pool, v_pool, meta, store=store, i=i, own_pools=own_pools):
                assert k_pool.data_ptr() in own_pools
                assert meta.slot_mapping.numel() == key.shape[0]
                stores[i] += 1
                return store(key, value, k_pool, v_pool, meta)

            eng.cache.backend.store_kv = spy
        outs = [None, None]

        def run(i):
            handles = [engines[i].submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
            outs[i] = [h.result(600).output_token_ids for h in handles]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(1200)
        assert outs == refs
        assert stores[0] and stores[1]
    finally:
        for eng in engines:
            eng.close()
