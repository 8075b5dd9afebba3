"""bfloat16 models on the CPU path (a speed option on CPUs with native bf16; greedy tokens may change,
so these are tolerance tests, not exactness tests: fp32 exactness is tested elsewhere)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_torch_attention import _batch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from hf_contbatch.kernels.attention.backends import CPUKernelAttentionBackend
from hf_contbatch.kernels.attention.torch_paged import torch_paged_attention

from conftest import build_model, enqueue_at_once, random_prompts
from reference_attention import reference_paged_attention


@pytest.mark.timeout(300)
def test_bf16_paged_attention_within_bf16_tolerance_of_fp32_reference():
    decode_lens = [1, 3, 9, 17, 40, 41, 70, 2]
    query, k_pool, v_pool, meta = _batch(decode_lens, [(5, 5), (3, 20)], seed=7)
    want = reference_paged_attention(query, k_pool, v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.3)
    got = torch_paged_attention(query.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16(), meta, 0.3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.timeout(900)
def test_bf16_engine_greedy_tokens_are_near_argmax_under_fp32():
    model = build_model("llama")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    prompts = random_prompts([5, 19, 33], seed=5)
    engine = LLMEngine(bf16, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)))
    try:
        outs = [
            engine.submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True)).result(600).output_token_ids
            for p in prompts
        ]
    finally:
        engine.close()
    assert engine.cache.key_cache == [] and all(len(o) == 8 for o in outs)
    worst = 0.0
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + out])).logits[0].float(), -1)
        for t, tok in enumerate(out):
            row = logp[len(p) - 1 + t]
            worst = max(worst, float(row.max() - row[tok]))
    # Each bf16 greedy token is the fp32 argmax or within bf16 rounding of it (bf16 keeps 8 bits
    # of mantissa: logits of order 1 move by ~1e-2 through a few layers).
    assert worst < 0.15, worst


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["native", "native-without-avx512bf16", "onednn"])
def test_bf16_linears_pack_where_the_kernel_has_a_bf16_path_and_agree_with_f_linear(backend, monkeypatch):
    from hf_contbatch.kernels.linears import NativeGEMM, pack_linears, registry

    if backend == "native-without-avx512bf16":
        # Our GEMM as a CPU without AVX512-BF16 builds it, forced here: that fallback runs on every CPU.
        monkeypatch.setitem(registry.KERNELS, "native", functools.partial(NativeGEMM, bf16=False))
        backend = "native"
    model = build_model("llama").to(torch.bfloat16)
    kernel = registry.available_kernels().get(backend)
    if kernel is None:  # no C compiler / no oneDNN ops: a forced backend that cannot run says so
        with pytest.raises(RuntimeError):
            pack_linears(model, backend, fuse=True)
        return
    if not kernel.supports(torch.zeros(8, 8, dtype=torch.bfloat16)):
        # No bf16 path (no AVX512-BF16 / oneDNN bf16): nothing is packed, every linear stays F.linear's.
        x = torch.randint(0, model.config.vocab_size, (1, 7))
        with torch.no_grad():
            want = model(x).logits
            assert pack_linears(model, backend, fuse=True) is None
            assert torch.equal(model(x).logits, want)
        return
    packed = pack_linears(model, backend, fuse=True)
    try:
        assert packed is not None and len(packed) == sum(type(m) is torch.nn.Linear for m in model.modules())
        g = torch.Generator().manual_seed(0)
        for name in ("self_attn.k_proj", "mlp.down_proj"):
            lin = model.model.layers[0].get_submodule(name)
            x = torch.randn(5, lin.in_features, generator=g).bfloat16()
            with torch.no_grad():
                got = lin(x).float()
                # float32 accumulation of the same bf16 values, rounded once (a bf16 ulp is 2**-8 relative)
                want = torch.nn.functional.linear(x.float(), lin.weight.float())
            assert got.dtype == torch.float32 and lin(x).dtype == torch.bfloat16
            torch.testing.assert_close(got, want, rtol=2.0**-7, atol=1e-3)
    finally:
        packed.restore()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_engine_has_the_compiled_decode_kernel_as_a_candidate_and_generates(dtype):
    model = build_model("llama").to(dtype)
    engine = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)))
    try:
        # bf16/fp16 pools on CPU: the compiled decode kernel is a candidate (kept where it is faster
        # here; its bf16/fp16 results are checked against the reference in test_cpu_kernel.py).
        assert isinstance(engine.cache.backend, CPUKernelAttentionBackend)
        assert engine.cache.key_cache[0].dtype == dtype
        out = engine.submit([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=6, ignore_eos=True)).result(300)
        assert len(out.output_token_ids) == 6
    finally:
        engine.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_linears_widened_by_our_gemm_agree_with_f_linear_on_their_float32_values(dtype, monkeypatch):
    # The widening path (each weight widened to float32 in registers: what a CPU without
    # AVX512-BF16 runs, forced here with half_isa="widen"): float32 accumulation of the same
    # half-precision values, rounded once to the dtype.
    from hf_contbatch.kernels.linears import NativeGEMM, pack_linears, registry

    if "native" not in registry.available_kernels():
        pytest.skip("no C compiler: our GEMM cannot be built")
    monkeypatch.setitem(registry.KERNELS, "native", functools.partial(NativeGEMM, half_isa="widen"))
    kernel = registry.make_kernel("native")
    if dtype not in kernel.dtypes:  # float16 needs the CPU's vector conversion (F16C)
        assert dtype == torch.float16
        pytest.skip("no vector float16 conversion on this CPU")
    model = build_model("llama").to(dtype)
    packed = pack_linears(model, "native", fuse=True)
    try:
        assert packed is not None and len(packed) == sum(type(m) is torch.nn.Linear for m in model.modules())
        assert model.model.layers[0].mlp.down_proj.forward.kernel.half_isa == "widen"
        g = torch.Generator().manual_seed(0)
        for name in ("self_attn.q_proj", "mlp.down_proj"):
            lin = model.model.layers[0].get_submodule(name)
            x = torch.randn(3, lin.in_features, generator=g).to(dtype)
            with torch.no_grad():
                got = lin(x)
                want = torch.nn.functional.linear(x.float(), lin.weight.float())
            assert got.dtype == dtype
            unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # half an ulp, relative
            torch.testing.assert_close(got.float(), want, rtol=2 * unit, atol=1e-4)
    finally:
        packed.restore()


@pytest.mark.timeout(900)
def test_a_bf16_model_on_the_build_without_native_bf16_is_batch_invariant_and_follows_generate(monkeypatch):
    # What a CPU without AVX512-BF16 runs (our GEMM built without it, bf16 weights widened in
    # registers), forced here on any CPU; the reference is transformers' generate on the same bf16
    # weights (a copy the engine never touches).
    from hf_contbatch.kernels.linears import NativeGEMM, registry

    if "native" not in registry.available_kernels():
        pytest.skip("no C compiler: our GEMM cannot be built")
    monkeypatch.setitem(registry.KERNELS, "native", functools.partial(NativeGEMM, bf16=False))
    model = build_model("llama").to(torch.bfloat16)
    reference = copy.deepcopy(model)
    prompts = random_prompts([5, 19, 33, 12], seed=11)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = LLMEngine(model, EngineConfig(linear_backend="native", cache=CacheConfig(block_size=4, num_blocks=96)))
    try:
        kernel = model.model.layers[0].mlp.down_proj.forward.kernel
        assert kernel.half_isa == "widen" and kernel.library.gemm_bf16 is None
        batched = [h.result(600).output_token_ids for h in enqueue_at_once(engine, prompts, params)]
        alone = []
        for p in prompts:
            engine.reset_prefix_cache()  # each prompt computed again, alone in its steps
            alone.append(engine.submit(p, params).result(600).output_token_ids)
    finally:
        engine.close()
    # Each output a float32 chain over the same widened values, rounded once: a row's tokens do
    # not depend on the rows beside it.
    assert batched == alone
    for p, ours in zip(prompts, batched):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        theirs = out.sequences[0, len(p) :].tolist()
        if ours == theirs:
            continue
        # Drift only where generate's own bf16 logits tie within bf16 rounding (8 bits of
        # mantissa, a few roundings deep) at the first token that differs; later tokens follow
        # another context.
        t = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        row = out.scores[t][0].float()
        assert float(row.max() - row[ours[t]]) <= 4 * 2.0**-8 * float(row.abs().max()), (p, ours, theirs)
