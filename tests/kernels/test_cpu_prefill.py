"""The compiled CPU prefill-attention kernel (``hf_contbatch/kernels/attention/cpu_prefill.c``)
against the naive reference (``tests/reference_attention.py``), its AVX2 build where the CPU has
AVX-512, its choice by timing, and greedy equality with ``generate`` through an engine that uses it."""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch
from test_torch_attention import _batch, reference_for

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.kernels import native_build
from hf_contbatch.kernels.attention import cpu_prefill
from hf_contbatch.kernels.attention.cpu_kernel import CPUDecodeKernel
from hf_contbatch.kernels.attention.cpu_prefill import CPUPrefillKernel, choose_prefill_path
from hf_contbatch.kernels.attention.torch_paged import torch_paged_attention
from hf_contbatch.kernels.native_build import LoadedOnce, build_library

from conftest import build_model, random_prompts, reference_greedy, variant_flags

# (query tokens, context) per prefill request: fresh prompts (equal), chunks that start mid-context
# (chunked prefill, prefix-cache hits), one token after a long prefix, and up to 300 tokens.
CHUNKS = [(5, 5), (3, 20), (40, 40), (1, 9), (70, 130), (17, 17), (300, 300), (33, 250)]


def _has_compiler() -> bool:
    return bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"))


@pytest.fixture(scope="module")
def kernel():
    if not _has_compiler():
        pytest.skip("no C compiler on this machine: the compiled CPU prefill kernel cannot be built")
    k = CPUPrefillKernel()
    k.enabled = True  # whatever the environment says: these tests are about the kernel
    assert k.available, f"a C compiler is here but the CPU prefill kernel did not build: {k.error}"
    return k


def _check(kernel, query, k_pool, v_pool, meta, scale, sliding_window, softcap, tol=1e-5):
    got = torch_paged_attention(
        query, k_pool, v_pool, meta, scale, sliding_window=sliding_window, softcap=softcap, prefill_kernel=kernel
    )
    want = reference_for(query, k_pool, v_pool, meta, scale, sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "heads,kvh,dim,block_size",
    [(4, 4, 16, 16), (8, 4, 64, 16), (16, 4, 32, 16), (15, 5, 64, 16), (6, 2, 80, 16), (8, 2, 128, 7), (4, 2, 12, 1)],
    ids=["mha", "gqa2-d64", "gqa4-d32", "medium", "d80", "d128-block7", "d12-block1"],
)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (6, None), (None, 20.0), (50, 30.0)])
def test_prefill_chunks_match_the_reference(kernel, heads, kvh, dim, block_size, sliding_window, softcap):
    query, k_pool, v_pool, meta = _batch([], CHUNKS, block_size=block_size, kvh=kvh, heads=heads, dim=dim, seed=1)
    _check(kernel, query, k_pool, v_pool, meta, dim**-0.5, sliding_window, softcap)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("chunk", [(1, 1), (8, 8), (192, 192), (64, 300), (2, 2)], ids=lambda c: f"{c[0]}of{c[1]}")
def test_one_request(kernel, chunk):
    query, k_pool, v_pool, meta = _batch([], [chunk], block_size=16, kvh=5, heads=15, dim=64, seed=2)
    _check(kernel, query, k_pool, v_pool, meta, 0.125, None, None)


@pytest.mark.timeout(600)
def test_more_query_heads_per_kv_head_than_a_tile_holds(kernel):
    # 130 query heads on one KV head: each query token's heads are split across tiles.
    query, k_pool, v_pool, meta = _batch([], [(9, 9), (4, 30)], block_size=8, kvh=1, heads=130, dim=8, seed=3)
    _check(kernel, query, k_pool, v_pool, meta, 0.3, 5, None)


@pytest.mark.timeout(600)
def test_decode_rows_in_the_same_step_are_left_to_the_decode_path(kernel):
    decode = CPUDecodeKernel()
    query, k_pool, v_pool, meta = _batch([1, 7, 33, 100], CHUNKS[:5], block_size=16, kvh=2, heads=6, dim=32, seed=4)
    for decode_kernel in (None, decode if decode.available else None):
        got = torch_paged_attention(
            query, k_pool, v_pool, meta, 0.2, decode_kernel=decode_kernel, prefill_kernel=kernel, softcap=25.0
        )
        want = reference_for(query, k_pool, v_pool, meta, 0.2, softcap=25.0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
def test_the_query_as_the_model_passes_it_a_transposed_view(kernel):
    # The model hands [1, H, T, D]; attention sees its [T, H, D] transpose, and the output follows
    # that layout (empty_like): the kernel reads and writes both through their strides.
    query, k_pool, v_pool, meta = _batch([], CHUNKS[:4], block_size=4, kvh=2, heads=4, dim=16, seed=5)
    view = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not view.is_contiguous() and torch.equal(view, query)
    _check(kernel, view, k_pool, v_pool, meta, 0.25, None, None)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_pools_give_the_float32_result_of_their_values(kernel, query_dtype):
    # bf16 keys and values are widened exactly and everything is computed in float32: the float32
    # reference over the same (bf16-rounded) values, rounded once to the query's dtype.
    query, k_pool, v_pool, meta = _batch([], CHUNKS, block_size=16, kvh=4, heads=12, dim=64, seed=6)
    q, k16, v16 = query.to(query_dtype), k_pool.bfloat16(), v_pool.bfloat16()
    got = torch_paged_attention(q, k16, v16, meta, 0.125, sliding_window=40, prefill_kernel=kernel)
    assert got.dtype == query_dtype
    want = reference_for(q.float(), k16.float(), v16.float(), meta, 0.125, sliding_window=40)
    tol = 1e-5 if query_dtype == torch.float32 else 2.0**-8
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=1e-5)


@pytest.mark.timeout(600)
def test_float16_pools_give_the_float32_result_of_their_values(kernel):
    # As bf16: float16 keys and values widened exactly, float32 arithmetic, one rounding at the end.
    if not kernel.reads(torch.float16):
        pytest.skip("this compiler has no _Float16: float16 pools take the torch path")
    query, k_pool, v_pool, meta = _batch([], CHUNKS, block_size=16, kvh=4, heads=12, dim=64, seed=9)
    q, k16, v16 = query.half(), k_pool.half(), v_pool.half()
    got = torch_paged_attention(q, k16, v16, meta, 0.125, sliding_window=40, prefill_kernel=kernel)
    assert got.dtype == torch.float16
    want = reference_for(q.float(), k16.float(), v16.float(), meta, 0.125, sliding_window=40)
    torch.testing.assert_close(got.float(), want, rtol=2.0**-10, atol=1e-5)


def test_can_serve_dense_float32_bfloat16_or_float16_cpu_pools_only(kernel):
    q = torch.zeros(2, 4, 8)
    pool = torch.zeros(3, 4, 2, 8)
    assert kernel.can_serve(q, pool, pool.clone())
    assert kernel.can_serve(q.bfloat16(), pool.bfloat16(), pool.bfloat16())
    # float16 where the compiler has _Float16 (GCC 12+, Clang on x86-64 and arm64)
    assert kernel.can_serve(q.half(), pool.half(), pool.half()) == kernel.reads(torch.float16)
    assert not kernel.can_serve(q.double(), pool.double(), pool.double())
    assert not kernel.can_serve(q, pool, pool.bfloat16())
    assert not kernel.can_serve(q, pool, torch.zeros(3, 4, 2, 16)[..., :8])
    assert not kernel.can_serve(torch.zeros(2, 4, 16)[..., ::2], pool, pool.clone())


@pytest.mark.timeout(900)
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector widths only")
def test_the_avx2_build_matches_the_reference_too():
    # -march=native picks 16-float vectors on an AVX-512 CPU; the 8-float code that AVX2-only CPUs
    # run is built here without AVX-512 (on an AVX2-only CPU this is the same build).
    if not _has_compiler():
        pytest.skip("no C compiler")
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 on this CPU")
    k = CPUPrefillKernel()
    k.enabled = True
    flags = variant_flags(cpu_prefill._FLAGS, ["-mno-avx512f"])
    k._kernel = LoadedOnce(lambda: cpu_prefill._load(build_library(cpu_prefill.PREFILL_SOURCE, flags)), "avx2", "-")
    assert k.available, k.error
    query, k_pool, v_pool, meta = _batch([], CHUNKS, block_size=16, kvh=2, heads=6, dim=64, seed=7)
    _check(k, query, k_pool, v_pool, meta, 0.125, 30, 20.0)
    _check(k, query, k_pool.bfloat16(), v_pool.bfloat16(), meta, 0.125, None, None)


@pytest.mark.timeout(600)
def test_the_choice_is_timed_once_and_cached(kernel, tmp_path, monkeypatch):
    # Both kernels load the library from the session's cache first (an empty cache would compile it
    # again, 10 s); then the choice's cache file goes to tmp_path.
    k, k2 = CPUPrefillKernel(), CPUPrefillKernel()
    assert k.available and k2.available
    monkeypatch.setattr(native_build, "cache_dir", lambda: tmp_path)
    calls = []

    def fake_measure(*args):
        calls.append(args)
        return {"kernel": 2.0, "torch": 1.0}  # the torch path faster: the kernel must be turned off

    monkeypatch.setattr(cpu_prefill, "measure_prefill_paths", fake_measure)
    line = choose_prefill_path(k, 4, 2, 16, 16, torch.float32)
    assert not k.enabled and "torch path" in line
    choose_prefill_path(k2, 4, 2, 16, 16, torch.float32)
    assert len(calls) == 1 and not k2.enabled  # the second engine read the cached times
    monkeypatch.setenv("HF_CONTBATCH_CPU_PREFILL", "0")
    k3 = CPUPrefillKernel()
    assert not k3.available and "disabled" in choose_prefill_path(k3, 4, 2, 16, 16, torch.float32)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_greedy_equals_generate_with_the_kernel_under_chunked_prefill_and_prefix_hits(kernel, family):
    model = build_model(family)
    shared = random_prompts([24], seed=8)[0]
    # The two prompts that share 24 tokens come first and last: the last may hit the prefix cache.
    prompts = [shared + [7, 8, 9]] + random_prompts([1, 5, 17, 33, 64, 40], seed=9) + [shared + [10, 11]]
    refs = [reference_greedy(model, p, 12) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),  # prompts split in chunks
    )
    eng = LLMEngine(model, cfg)
    try:
        prefill = eng.cache.backend.prefill_kernel
        prefill.enabled = True  # whatever the timing chose on this machine
        assert prefill.available
        (fn, fn_q8, has_f16), calls = prefill._kernel.get(), []
        prefill._kernel._value = (lambda *args: calls.append(1) or fn(*args), fn_q8, has_f16)  # count its calls
        handles = [eng.submit(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
        assert [h.result(timeout=600).output_token_ids for h in handles] == refs
        assert eng.wait_idle(10)
        assert len(calls) >= 2 * 8  # every layer of every prefill step
        assert eng.stats().num_free_blocks == eng.stats().num_blocks
    finally:
        eng.close()
