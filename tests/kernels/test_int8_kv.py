"""The int8 KV cache (``CacheConfig(dtype="int8")``): the layout's bytes by arithmetic, quantize on
write, swap and copy-on-write moving the scales, and attention over int8 pools (torch path and the
compiled C kernel) against the naive float reference run on K/V quantized and dequantized here, in
plain torch, by the scheme's definition (symmetric, scale = absmax / 127 per token and KV head)."""

from __future__ import annotations

import os
import platform
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_torch_attention import _batch, reference_for

from hf_contbatch import CacheConfig
from hf_contbatch.engine.kv_pools import cache_spec
from hf_contbatch.engine.pool_sizing import KVGeometry
from hf_contbatch.kernels.attention.backends import (
    Int8CPUKernelAttentionBackend,
    Int8TorchAttentionBackend,
    TorchAttentionBackend,
)
from hf_contbatch.kernels.attention.torch_paged import torch_paged_attention
from hf_contbatch.kernels.kv_spec import KVCacheSpec
from hf_contbatch.kernels.paged_cache import PagedKVCache

from conftest import variant_flags

DECODE_LENS = [1, 2, 5, 9, 16, 17, 33, 64, 100]


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` -> (int8 values, float32 scales ``[..., 1]``), row by row from the definition."""
    rows = x.reshape(-1, x.shape[-1]).double()
    qs, ss = [], []
    for row in rows:
        amax = max(abs(v) for v in row.tolist())
        s = amax / 127.0
        qs.append([0 if s == 0 else max(-127, min(127, round(v / s))) for v in row.tolist()])
        ss.append([s])
    q = torch.tensor(qs, dtype=torch.int8).view(x.shape)
    return q, torch.tensor(ss, dtype=torch.float32).view(*x.shape[:-1], 1)


def reference_dequantized(pool: torch.Tensor) -> torch.Tensor:
    q, s = reference_quantize(pool)
    return q.double().mul(s.double()).float()


def _spec(num_blocks_shape, dtype=torch.int8):
    _, block_size, kvh, dim = num_blocks_shape
    return KVCacheSpec(
        num_layers=1,
        block_size=block_size,
        num_kv_heads=kvh,
        head_size=dim,
        dtype=dtype,
        scale_dtype=torch.float32,
        scales_per_token_head=1,
    )


def _store_all(backend, k_float, v_float):
    """Every slot of the float pools ``k_float``/``v_float`` stored through ``backend`` into new int8
    pools; returns (k_pool, v_pool, k_scale, v_scale)."""
    nb, bs, kvh, d = k_float.shape
    cache = PagedKVCache(_spec(k_float.shape), nb, [torch.device("cpu")], backend)
    meta = type("M", (), {"slot_mapping": torch.arange(nb * bs)})()
    scales = cache.scales(0)
    backend.store_kv(
        k_float.reshape(-1, kvh, d),
        v_float.reshape(-1, kvh, d),
        cache.key_cache[0],
        cache.value_cache[0],
        meta,
        **scales,
    )
    return cache.key_cache[0], cache.value_cache[0], scales["k_scale"], scales["v_scale"]


@pytest.fixture(scope="module")
def cpu_backend():
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler on this machine: the compiled CPU kernel cannot be built")
    backend = Int8CPUKernelAttentionBackend()
    assert backend.decode_kernel.available, backend.decode_kernel.error
    return backend


def test_a_bad_cache_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="int8") as err:
        CacheConfig(dtype="int4")
    assert "'int4'" in str(err.value) and "bfloat16" in str(err.value)


@pytest.mark.parametrize("head_size", [32, 64, 80, 128, 256])
def test_int8_pool_holds_at_least_three_times_the_tokens_of_float32_in_the_same_memory(head_size):
    geometry = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=head_size, num_heads=4, max_model_len=512)
    int8 = cache_spec(CacheConfig(dtype="int8"), geometry, torch.float32)
    fp32 = cache_spec(CacheConfig(), geometry, torch.float32)
    # Per token, layer and KV head, for K and for V: head_size int8 bytes + a 4-byte scale vs 4 * head_size.
    assert int8.bytes_per_block == 4 * 16 * 2 * 2 * (head_size + 4)
    assert fp32.bytes_per_block == 4 * 16 * 2 * 2 * (4 * head_size)
    memory = 1 << 30
    assert (memory // int8.bytes_per_block) >= 3 * (memory // fp32.bytes_per_block)


def test_float_backends_refuse_an_int8_layout_and_int8_backends_a_float_one():
    spec = _spec((1, 4, 2, 8))
    with pytest.raises(ValueError, match="float K/V only"):
        TorchAttentionBackend().check_spec(spec)
    with pytest.raises(ValueError, match="int8"):
        Int8TorchAttentionBackend().check_spec(
            KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
        )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", ["torch", "c"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_quantizes_each_token_head_by_its_absmax(which, dtype, request):
    backend = Int8TorchAttentionBackend() if which == "torch" else request.getfixturevalue("cpu_backend")
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(5, 4, 2, 24, generator=g) * torch.rand(5, 4, 2, 1, generator=g) * 10).to(dtype)
    v = torch.randn(5, 4, 2, 24, generator=g).to(dtype)
    k[1, 2, 0] = 0  # an all-zero row: scale 0, values 0
    k_pool, v_pool, k_scale, v_scale = _store_all(backend, k, v)
    for got_q, got_s, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        want_q, want_s = reference_quantize(x.float())
        torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
        # Rounding of exact ties (and a last-ulp division) may differ by one step, never more.
        assert (got_q.int() - want_q.int()).abs().max() <= 1
        assert (got_q != want_q).float().mean() < 0.01
    assert k_scale[1, 2, 0].item() == 0 and bool((k_pool[1, 2, 0] == 0).all())


def _int8_case(decode_lens, prefill, block_size, kvh, heads, dim, backend, seed=0):
    query, k_float, v_float, meta = _batch(
        decode_lens, prefill, block_size=block_size, kvh=kvh, heads=heads, dim=dim, seed=seed
    )
    pools = _store_all(backend, k_float, v_float)
    return query, k_float, v_float, meta, pools


@pytest.mark.timeout(900)
@pytest.mark.parametrize("which", ["torch", "c"])
@pytest.mark.parametrize(
    "heads,kvh,dim,block_size",
    [(4, 2, 8, 4), (8, 8, 16, 16), (8, 1, 80, 8), (12, 4, 64, 16), (4, 2, 12, 4), (8, 4, 128, 16)],
    ids=["gqa", "mha", "mqa-d80", "small-model", "d12-scalar-tail", "d128"],
)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (7, 30.0)])
def test_int8_attention_matches_the_reference_on_dequantized_kv(
    which, heads, kvh, dim, block_size, sliding_window, softcap, request
):
    backend = Int8TorchAttentionBackend() if which == "torch" else request.getfixturevalue("cpu_backend")
    prefill = [(5, 5), (3, 20)]  # prefill chunks ride in the same batch (the torch gather path)
    query, k_float, v_float, meta, (k_pool, v_pool, k_scale, v_scale) = _int8_case(
        DECODE_LENS, prefill, block_size, kvh, heads, dim, backend
    )
    got = backend.attend(query, k_pool, v_pool, meta, 0.3, sliding_window, softcap, k_scale=k_scale, v_scale=v_scale)
    want = reference_for(
        query,
        reference_dequantized(k_float),
        reference_dequantized(v_float),
        meta,
        0.3,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    # A value one quantization step off (a rounding tie) moves an output by a fraction of that step.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-3)
    # And the quantization error itself is small against the float reference (int8: ~0.4% of absmax).
    exact = reference_for(query, k_float, v_float, meta, 0.3, sliding_window=sliding_window, softcap=softcap)
    assert (got - exact).abs().max() < 0.1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("split_context", [False, True], ids=["task-per-sequence", "task-per-partition"])
@pytest.mark.parametrize("split_heads", [False, True])
@pytest.mark.parametrize("heads,kvh,dim", [(12, 4, 64), (16, 2, 32), (6, 3, 128)])
def test_c_kernel_int8_decode_matches_the_torch_int8_path(cpu_backend, split_context, split_heads, heads, kvh, dim):
    query, _, _, meta, (k_pool, v_pool, k_scale, v_scale) = _int8_case(
        [300, 7, 150, 33], [], 16, kvh, heads, dim, cpu_backend, seed=3
    )
    kernel = cpu_backend.decode_kernel
    got = kernel(
        query,
        k_pool,
        v_pool,
        meta.block_tables,
        meta.seq_lens,
        0.2,
        25.0,
        40,
        split_heads=split_heads,
        split_context=split_context,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    want = torch_paged_attention(query, k_pool, v_pool, meta, 0.2, 40, 25.0, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_swap_and_copy_on_write_move_the_scales_with_their_blocks():
    spec = _spec((6, 4, 2, 8))
    spec = KVCacheSpec(**{**spec.__dict__, "num_layers": 2})
    cache = PagedKVCache(spec, 6, [torch.device("cpu")] * 2, Int8TorchAttentionBackend(), num_swap_blocks=3)
    g = torch.Generator().manual_seed(0)
    for t in (*cache.key_cache, *cache.value_cache):
        t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
    for t in (*cache.key_scales, *cache.value_scales):
        t.copy_(torch.rand(t.shape, generator=g))
    before = [[t.clone() for t in cache.device_tensors(layer)] for layer in range(2)]
    cache.swap_out([(1, 0), (4, 2)])
    for layer in range(2):
        for t in cache.device_tensors(layer):
            t[1].zero_()
            t[4].zero_()
    cache.swap_in([(0, 4), (2, 1)])  # back, crossed over
    cache.copy_blocks([(0, 5)])
    for layer in range(2):
        now = cache.device_tensors(layer)
        assert len(now) == 4  # K, V, K scales, V scales
        for b, n in zip(before[layer], now):
            assert torch.equal(n[4], b[1]) and torch.equal(n[1], b[4]) and torch.equal(n[5], b[0])
    assert cache.nbytes == 6 * spec.bytes_per_block
    cache.release()
    assert not cache.key_scales and not cache.swap_value_scales


def test_the_command_line_spells_the_cache_dtype_kv_cache_dtype():
    import argparse

    from hf_contbatch.cli import add_engine_arguments
    from hf_contbatch.frontends.cli_checks import engine_config

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-cache-dtype", "int8"])
    args.compile, args.seed = False, 0
    assert engine_config(args).cache.dtype == "int8"
    args.kv_cache_dtype = "auto"
    assert engine_config(args).cache.dtype is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "heads,kvh,dim,block_size",
    [(4, 2, 8, 4), (12, 4, 64, 16), (8, 1, 80, 8), (8, 4, 128, 16), (40, 2, 32, 16)],
    ids=["gqa", "small-model", "mqa-d80", "d128", "wide-group"],
)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (9, 30.0)])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_c_prefill_kernel_int8_matches_the_reference_on_dequantized_kv(
    cpu_backend, heads, kvh, dim, block_size, sliding_window, softcap, query_dtype
):
    """The compiled prefill kernel over int8 pools: fresh prompts, chunks after a cached prefix and a
    one-token chunk, beside decode rows, against the naive reference over K/V dequantized here."""
    prefill = [(5, 5), (7, 30), (1, 12), (40, 40)]
    query, k_float, v_float, meta, (k_pool, v_pool, k_scale, v_scale) = _int8_case(
        [3, 20], prefill, block_size, kvh, heads, dim, cpu_backend, seed=5
    )
    kernel = cpu_backend.prefill_kernel
    assert kernel.can_serve_int8(query.to(query_dtype), k_pool, v_pool), kernel.error
    out = torch.zeros_like(query).to(query_dtype)
    got = kernel(
        query.to(query_dtype),
        k_pool,
        v_pool,
        meta,
        0.3,
        softcap,
        sliding_window,
        out=out,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert got is out
    want = reference_for(
        query.to(query_dtype).float(),
        reference_dequantized(k_float),
        reference_dequantized(v_float),
        meta,
        0.3,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    rows = meta.query_start_loc_cpu[meta.num_decodes]
    assert bool((got[:rows] == 0).all())  # decode rows are left to the decode path
    tol = dict(rtol=1e-4, atol=2e-3) if query_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[rows:].float(), want[rows:], **tol)


@pytest.mark.timeout(600)
def test_c_int8_attention_equals_the_torch_int8_path_on_the_same_pools(cpu_backend):
    """Decode and prefill rows of one step through the compiled kernels and through the torch int8
    path (which gathers and dequantizes), over the very same int8 pools: arithmetic differences only."""
    query, _, _, meta, (k_pool, v_pool, k_scale, v_scale) = _int8_case(
        [300, 7, 150], [(9, 60), (33, 33)], 16, 4, 12, 64, cpu_backend, seed=4
    )
    got = cpu_backend.attend(query, k_pool, v_pool, meta, 0.125, 50, None, k_scale=k_scale, v_scale=v_scale)
    want = Int8TorchAttentionBackend().attend(
        query, k_pool, v_pool, meta, 0.125, 50, None, k_scale=k_scale, v_scale=v_scale
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_kernel_choices_time_int8_pools_holding_quantized_normal_rows():
    """The decode and prefill choices time their int8 paths on K/V as a model stores them (normal rows
    quantized by the scheme): dequantized, every row's largest magnitude is its own, a few units."""
    from hf_contbatch.kernels.attention.cpu_prefill import _prefill_batch
    from hf_contbatch.kernels.attention.decode_choice import _decode_batch

    _, k_pool, v_pool, _, scales = _decode_batch(2, 40, 4, 2, 16, 8, torch.int8)
    _, pk, pv, _, _, _, pscales = _prefill_batch(1, 8, 24, 4, 2, 16, 8, torch.int8)
    for pool, s in (
        (k_pool, scales["k_scale"]),
        (v_pool, scales["v_scale"]),
        (pk, pscales["k_scale"]),
        (pv, pscales["v_scale"]),
    ):
        assert pool.dtype == torch.int8
        assert bool((pool.abs().amax(-1) == 127).all())  # absmax / 127: each row reaches 127
        amax = s.squeeze(-1) * 127
        assert 0.5 < float(amax.min()) and float(amax.max()) < 8


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,tokens", [(32, 40), (64, 600), (128, 9)], ids=["d32", "d64-threaded", "d128"])
def test_c_store_quantizes_whole_vectors_and_long_chunks_by_the_definition(cpu_backend, dtype, dim, tokens):
    """The compiled store's register path (head sizes 32, 64, 128) and its threaded path (a prompt
    chunk of 600 tokens x 5 KV heads x 64), rows with magnitudes from 1e-3 to 1e3, against the
    definition computed here in double precision."""
    g = torch.Generator().manual_seed(1)
    kvh = 5
    scale = torch.logspace(-3, 3, tokens * kvh).view(tokens, kvh, 1)
    k = (torch.randn(tokens, kvh, dim, generator=g) * scale).to(dtype)
    v = (torch.randn(tokens, kvh, dim, generator=g) * scale.flip(0)).to(dtype)
    k[3, 1] = 0  # an all-zero row: scale 0, values 0
    k_pool, v_pool, k_scale, v_scale = _store_all(cpu_backend, k.view(tokens, 1, kvh, dim), v.view(tokens, 1, kvh, dim))
    for got_q, got_s, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        want_q, want_s = reference_quantize(x.float().view(tokens, 1, kvh, dim))
        torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
        assert (got_q.int() - want_q.int()).abs().max() <= 1  # a tie or a last-ulp product: one step
        assert (got_q != want_q).float().mean() < 0.01
    assert k_scale[3, 0, 1].item() == 0 and bool((k_pool[3, 0, 1] == 0).all())


@pytest.mark.timeout(1200)
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector widths only")
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx",)], ids=["avx2", "portable"])
def test_the_narrow_and_portable_builds_store_and_decode_int8_like_the_torch_path(flags):
    """The int8 store and decode of ``cpu_decode.c`` built without AVX-512 (the 8-float code AVX2-only
    CPUs run) and without AVX at all (the portable C), against the torch int8 path on the pools
    that build wrote, and the store against the definition."""
    from hf_contbatch.kernels.attention import cpu_kernel
    from hf_contbatch.kernels.native_build import LoadedOnce, build_library

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler")
    if flags == ("-mno-avx512f",) and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 on this CPU")
    from hf_contbatch.kernels.attention import cpu_prefill

    backend = Int8CPUKernelAttentionBackend()
    build = variant_flags(cpu_kernel._FLAGS, flags)
    pflags = variant_flags(cpu_prefill._FLAGS, flags)
    # Both libraries compiled side by side up front (cached for the session): 8 s and 11-24 s on two cores.
    sources = [(cpu_kernel.DECODE_SOURCE, build), (cpu_prefill.PREFILL_SOURCE, pflags)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda args: build_library(*args), sources))
    backend.decode_kernel._kernel = LoadedOnce(
        lambda: cpu_kernel._load(build_library(cpu_kernel.DECODE_SOURCE, build)), "narrow build", "-"
    )
    assert backend.decode_kernel.available, backend.decode_kernel.error
    for heads, kvh, dim in ((12, 4, 64), (6, 2, 24)):
        query, k_float, _, meta, (k_pool, v_pool, k_scale, v_scale) = _int8_case(
            [300, 7, 150, 33], [], 16, kvh, heads, dim, backend, seed=6
        )
        want_q, want_s = reference_quantize(k_float)
        torch.testing.assert_close(k_scale, want_s, rtol=1e-6, atol=0)
        assert (k_pool.int() - want_q.int()).abs().max() <= 1
        for split in (False, True):  # by KV head or not; by partition where the other is not
            got = backend.decode_kernel(
                query,
                k_pool,
                v_pool,
                meta.block_tables,
                meta.seq_lens,
                0.2,
                None,
                None,
                split_heads=split,
                split_context=not split,
                k_scale=k_scale,
                v_scale=v_scale,
            )
            want = torch_paged_attention(query, k_pool, v_pool, meta, 0.2, k_scale=k_scale, v_scale=v_scale)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The prefill kernel's int8 path in the same build (no vdpbf16ps there: float32 scores).
    prefill = cpu_prefill.CPUPrefillKernel()
    prefill.enabled = True
    prefill._kernel = LoadedOnce(
        lambda: cpu_prefill._load(build_library(cpu_prefill.PREFILL_SOURCE, pflags)), "narrow build", "-"
    )
    assert prefill.available, prefill.error
    query, _, _, meta, (k_pool, v_pool, k_scale, v_scale) = _int8_case(
        [], [(5, 5), (7, 30), (40, 40)], 16, 5, 15, 64, backend, seed=2
    )
    k_deq, v_deq = (k_pool.double() * k_scale.double()).float(), (v_pool.double() * v_scale.double()).float()
    for q in (query, query.bfloat16()):
        got = prefill(q, k_pool, v_pool, meta, 0.3, out=torch.zeros(query.shape), k_scale=k_scale, v_scale=v_scale)
        torch.testing.assert_close(got, reference_for(q.float(), k_deq, v_deq, meta, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_an_int8_decode_row_does_not_depend_on_its_batch(cpu_backend, query_dtype):
    """A sequence's decode output through the int8 backend is the same bits alone (the kernel then
    spreads its partitions over the threads), in a batch of many (one task per sequence), and beside
    prefill chunks."""
    query, _, _, meta, (k_pool, v_pool, k_scale, v_scale) = _int8_case(
        [70, 300, 7, 150, 33, 64, 90, 200, 11, 5, 250], [(9, 60), (33, 33)], 16, 5, 15, 64, cpu_backend, seed=8
    )
    query = query.to(query_dtype)
    full = cpu_backend.attend(query, k_pool, v_pool, meta, 0.125, k_scale=k_scale, v_scale=v_scale)
    decodes = cpu_backend.decode_kernel
    for i in range(meta.num_decodes):
        alone = decodes(
            query[i : i + 1],
            k_pool,
            v_pool,
            meta.block_tables[i : i + 1],
            meta.seq_lens[i : i + 1],
            0.125,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        assert torch.equal(alone[0], full[i]), i


@pytest.mark.timeout(600)
@pytest.mark.parametrize("heads,kvh,dim", [(15, 5, 64), (8, 2, 32), (8, 4, 128), (8, 1, 80)])
def test_c_prefill_int8_of_a_bfloat16_query_is_float32_exact(cpu_backend, heads, kvh, dim):
    """A bfloat16 model's query over int8 keys (where the CPU has AVX512-BF16 the scores are bfloat16
    dot products: exact products, float32 sums, the key's scale once per dot product): written to a
    float32 output, equal to the float32 reference over the dequantized cache to float32 rounding,
    not to bfloat16's."""
    prefill = [(5, 5), (7, 30), (1, 12), (40, 40), (70, 100)]
    query, k_float, v_float, meta, (k_pool, v_pool, k_scale, v_scale) = _int8_case(
        [3], prefill, 16, kvh, heads, dim, cpu_backend, seed=9
    )
    query = query.bfloat16()
    out = torch.zeros(query.shape)
    got = cpu_backend.prefill_kernel(
        query, k_pool, v_pool, meta, 0.3, None, None, out=out, k_scale=k_scale, v_scale=v_scale
    )
    # The reference over the cache as stored (so no quantization tie can differ): float rounding only.
    k_deq, v_deq = (k_pool.double() * k_scale.double()).float(), (v_pool.double() * v_scale.double()).float()
    want = reference_for(query.float(), k_deq, v_deq, meta, 0.3)
    rows = meta.query_start_loc_cpu[meta.num_decodes]
    torch.testing.assert_close(got[rows:], want[rows:], rtol=1e-5, atol=1e-5)
