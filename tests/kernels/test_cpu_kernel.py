"""The compiled CPU decode-attention kernel (``hf_contbatch/attention/cpu_decode.c``) against the
naive reference, and its fallback to the torch path where it cannot be built."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from test_torch_attention import _batch, reference_for

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from hf_contbatch.kernels.attention.cpu_kernel import CPUDecodeKernel
from hf_contbatch.kernels.attention.torch_paged import torch_paged_attention
from hf_contbatch.kernels.linears.native_gemm import _load_native_library

from conftest import random_prompts, reference_greedy

DECODE_LENS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 100, 127]


@pytest.fixture(scope="module")
def kernel():
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        # The engine then uses the torch path (its fallback is tested below); .ci/run installs gcc.
        pytest.skip("no C compiler on this machine: the compiled CPU decode kernel cannot be built")
    k = CPUDecodeKernel()
    assert k.available, f"a C compiler is here but the CPU decode kernel did not build: {k.error}"
    return k


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "heads,kvh,dim,block_size",
    [(4, 2, 8, 4), (8, 8, 16, 16), (8, 1, 80, 8), (12, 4, 64, 16), (6, 3, 32, 1), (4, 2, 12, 4), (8, 4, 128, 16)],
    ids=["gqa", "mha", "mqa-d80", "small-model", "block1", "d12-scalar-tail", "d128"],
)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (5, None), (None, 20.0), (7, 30.0), (500, None)])
def test_kernel_matches_the_reference_with_prefills_in_the_same_batch(
    kernel, heads, kvh, dim, block_size, sliding_window, softcap
):
    prefill = [(5, 5), (3, 20)]  # served by the torch path in the same call
    query, k_pool, v_pool, meta = _batch(DECODE_LENS, prefill, block_size=block_size, kvh=kvh, heads=heads, dim=dim)
    got = torch_paged_attention(
        query, k_pool, v_pool, meta, 0.3, sliding_window=sliding_window, softcap=softcap, decode_kernel=kernel
    )
    want = reference_for(query, k_pool, v_pool, meta, 0.3, sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


WORK_SPLITS = [(False, False), (False, True), (True, False), (True, True)]
WORK_SPLIT_IDS = ["task-per-sequence", "task-per-kv-head", "task-per-partition", "task-per-partition-and-kv-head"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("split_context,split_heads", WORK_SPLITS, ids=WORK_SPLIT_IDS)
@pytest.mark.parametrize(
    "decode_lens", [[300], [7, 150, 33], DECODE_LENS, [1000, 64]], ids=["one", "three", "fourteen", "long"]
)
@pytest.mark.parametrize("heads,kvh,dim", [(12, 4, 64), (8, 4, 32), (6, 2, 20)], ids=["d64", "d32", "d20"])
def test_every_work_split_matches_the_reference(kernel, split_context, split_heads, decode_lens, heads, kvh, dim):
    # The kernel picks per-partition tasks (cut by KV head too when still few) for a few sequences
    # and per-sequence tasks for many; every combination is forced here, whatever this machine's
    # thread count would pick. Windows of 40 and 100 start mid-partition (partitions are 64 keys).
    query, k_pool, v_pool, meta = _batch(decode_lens, [], block_size=16, kvh=kvh, heads=heads, dim=dim, seed=3)
    for sliding_window, softcap in [(None, None), (40, 25.0), (100, None)]:
        got = kernel(
            query,
            k_pool,
            v_pool,
            meta.block_tables,
            meta.seq_lens,
            0.2,
            softcap,
            sliding_window,
            split_heads=split_heads,
            split_context=split_context,
        )
        want = reference_for(query, k_pool, v_pool, meta, 0.2, sliding_window=sliding_window, softcap=softcap)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block_size", [1, 4, 16, 48])
@pytest.mark.parametrize("split_context", [False, True], ids=["task-per-sequence", "task-per-partition"])
def test_partitions_across_block_sizes_match_the_reference(kernel, block_size, split_context):
    # Partitions of 64 keys against pages of 1, 4, 16 and 48 tokens (a partition ending mid-page),
    # sequences of one partition, of several and of a short last one; with a window too.
    query, k_pool, v_pool, meta = _batch(
        [1, 63, 64, 65, 129, 200], [], block_size=block_size, kvh=2, heads=6, dim=32, seed=4
    )
    for sliding_window, softcap in [(None, None), (70, 30.0)]:
        got = kernel(
            query,
            k_pool,
            v_pool,
            meta.block_tables,
            meta.seq_lens,
            0.25,
            softcap,
            sliding_window,
            split_context=split_context,
        )
        want = reference_for(query, k_pool, v_pool, meta, 0.25, sliding_window=sliding_window, softcap=softcap)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_whatever_the_work_split_and_the_batch(kernel, dtype):
    """A sequence's keys are cut into partitions by its own length only, and partitions are combined
    in order by one function: alone or in a batch, in one task or spread over many, by KV head or
    not, its output is the same bits (greedy tokens then never depend on what else is running)."""
    lens = [300, 7, 150, 33, 1000, 64, 65]
    query, k_pool, v_pool, meta = _batch(lens, [], block_size=16, kvh=4, heads=12, dim=64, seed=6)
    query, k_pool, v_pool = query.to(dtype), k_pool.to(dtype), v_pool.to(dtype)
    results = [
        kernel(query, k_pool, v_pool, meta.block_tables, meta.seq_lens, 0.2, split_heads=h, split_context=c)
        for c, h in WORK_SPLITS
    ]
    for other in results[1:]:
        assert torch.equal(other, results[0])
    for i in range(len(lens)):
        for c, h in WORK_SPLITS:
            alone = kernel(
                query[i : i + 1],
                k_pool,
                v_pool,
                meta.block_tables[i : i + 1],
                meta.seq_lens[i : i + 1],
                0.2,
                split_heads=h,
                split_context=c,
            )
            assert torch.equal(alone[0], results[0][i]), (i, c, h)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("threads", [1, 2])
def test_an_engine_on_the_kernel_generates_greedy_tokens_equal_to_generate(llama_model, kernel, monkeypatch, threads):
    # The kernel serves every decode step, whatever the timing would pick on this machine; a few
    # requests with contexts of several 64-key partitions, so the steps' decodes run one task per
    # partition (and KV head): greedy tokens must stay transformers' own.
    from hf_contbatch.kernels.attention import backends

    monkeypatch.setattr(backends.CPUKernelAttentionBackend, "setup", lambda self, spec, num_heads: "kernel forced")
    calls = []
    call = CPUDecodeKernel.__call__
    monkeypatch.setattr(
        CPUDecodeKernel, "__call__", lambda self, *a, **kw: calls.append(a[0].shape[0]) or call(self, *a, **kw)
    )
    prompts = random_prompts([5, 70, 150], seed=12)
    refs = [reference_greedy(llama_model, p, 40) for p in prompts]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    eng = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    try:
        assert eng.cache.backend.decode_kernel.available
        handles = [eng.submit(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts]
        assert [h.result(600).output_token_ids for h in handles] == refs
        assert calls and max(calls) == 3  # the decode steps went through the kernel, three rows at most
    finally:
        eng.close()
        torch.set_num_threads(before)


def test_kernel_serves_dense_float32_bfloat16_or_float16_cpu_pools_only(kernel):
    q = torch.zeros(2, 4, 8)
    pool = torch.zeros(3, 4, 2, 8)
    assert kernel.can_serve(q, pool, pool.clone())
    assert kernel.can_serve(q.bfloat16(), pool.bfloat16(), pool.bfloat16())
    # float16 where the compiler has _Float16 (GCC 12+, Clang on x86-64 and arm64)
    assert kernel.can_serve(q.half(), pool.half(), pool.half()) == kernel.reads(torch.float16)
    assert not kernel.can_serve(q.double(), pool.double(), pool.double())
    # The kernel reads both pools as dense arrays of one dtype: anything else goes to the torch path.
    assert not kernel.can_serve(q, pool, pool.bfloat16())
    assert not kernel.can_serve(q, pool, torch.zeros(3, 4, 2, 16)[..., :8])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("heads,kvh,dim", [(12, 4, 64), (8, 8, 32), (6, 2, 20)], ids=["d64", "d32", "d20"])
def test_bfloat16_pools_give_the_float32_result_of_their_values(kernel, heads, kvh, dim):
    # The kernel widens bf16 keys and values exactly and computes in float32, so it must give the
    # float32 reference over the same (bf16-rounded) values, rounded once to bf16 at the end.
    query, k_pool, v_pool, meta = _batch(DECODE_LENS, [], block_size=16, kvh=kvh, heads=heads, dim=dim, seed=7)
    q16, k16, v16 = query.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16()
    got = torch_paged_attention(q16, k16, v16, meta, 0.3, decode_kernel=kernel)
    assert got.dtype == torch.bfloat16
    want = reference_for(q16.float(), k16.float(), v16.float(), meta, 0.3)
    torch.testing.assert_close(got.float(), want, rtol=2.0**-8, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("heads,kvh,dim", [(12, 4, 64), (6, 2, 20)], ids=["d64", "d20"])
def test_float16_pools_give_the_float32_result_of_their_values(kernel, heads, kvh, dim):
    # As bf16: float16 keys and values widened exactly (VCVTPH2PS), float32 arithmetic, the output
    # rounded once to float16 (half an ulp: 2**-11 relative).
    if not kernel.reads(torch.float16):
        pytest.skip("this compiler has no _Float16: float16 pools take the torch path")
    query, k_pool, v_pool, meta = _batch(DECODE_LENS, [], block_size=16, kvh=kvh, heads=heads, dim=dim, seed=8)
    q16, k16, v16 = query.half(), k_pool.half(), v_pool.half()
    got = torch_paged_attention(q16, k16, v16, meta, 0.3, decode_kernel=kernel)
    assert got.dtype == torch.float16
    want = reference_for(q16.float(), k16.float(), v16.float(), meta, 0.3)
    torch.testing.assert_close(got.float(), want, rtol=2.0**-10, atol=1e-5)


@pytest.mark.timeout(300)
def test_a_strided_value_pool_is_served_by_the_torch_path_with_the_reference_result(kernel):
    query, k_pool, v_pool, meta = _batch([5, 17, 40], [], block_size=4, kvh=2, heads=4, dim=8, seed=5)
    strided_v = torch.cat([v_pool, torch.zeros_like(v_pool)], dim=-1)[..., :8]  # same values, not dense
    got = torch_paged_attention(query, k_pool, strided_v, meta, 0.3, decode_kernel=kernel)
    want = reference_for(query, k_pool, v_pool, meta, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(900)
def test_without_a_compiler_the_torch_path_serves_with_one_warning(llama_model, monkeypatch, tmp_path, caplog, request):
    monkeypatch.setenv("CC", "/bin/false")  # every build fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built before
    # The engine below also tries to build our GEMM, and the process keeps that outcome: forget it
    # before and after, or a failure here fails every later GEMM test in this process.
    _load_native_library.cache_clear()
    request.addfinalizer(_load_native_library.cache_clear)
    prompts = random_prompts([5, 17, 30], seed=9)
    refs = [reference_greedy(llama_model, p, 12) for p in prompts]
    eng = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)))
    try:
        with caplog.at_level(logging.WARNING, logger="hf_contbatch.kernels.attention.cpu_kernel"):
            outs = [eng.submit(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
            outs = [h.result(300).output_token_ids for h in outs]
        assert outs == refs
        kernel = eng.cache.backend.decode_kernel
        assert not kernel.available and "/bin/false" in kernel.error
        warnings = [r.getMessage() for r in caplog.records if "using the torch path" in r.getMessage()]
        # One warning per compiled attention kernel, not one per step.
        assert sorted(w.split(" unavailable")[0] for w in warnings) == [
            "compiled CPU decode attention",
            "compiled CPU prefill attention",
        ]
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kv_store_writes_exactly_what_index_copy_writes(kernel, dtype):
    g = torch.Generator().manual_seed(11)
    blocks, bs, kvh, d, t = 6, 4, 3, 20, 9
    # The [T, KVH, D] views transformers' [1, KVH, T, D] states give (K rotated and dense, V transposed).
    key = torch.randn(1, kvh, t, d, generator=g).to(dtype)[0].transpose(0, 1)
    value = torch.randn(1, t, kvh, d, generator=g).to(dtype).transpose(1, 2)[0].transpose(0, 1)
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    pools = [torch.randn(blocks, bs, kvh, d, generator=g).to(dtype) for _ in range(2)]
    want = [p.clone() for p in pools]
    want[0].view(-1, kvh, d).index_copy_(0, slots, key)
    want[1].view(-1, kvh, d).index_copy_(0, slots, value)
    assert kernel.store(key, value, pools[0], pools[1], slots)
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])
    # Not its case: nothing written, the caller stores them.
    assert not kernel.store(key.double() if dtype == torch.float32 else key.float(), value, *pools, slots)
