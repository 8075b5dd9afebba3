"""Fused RMSNorm and SiLU-and-mul (``kernels/fused_ops``) against plain torch, and installed on a
model as per-instance forwards: greedy tokens equal transformers' generate, removed by close."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from hf_contbatch.kernels.fused_ops import FusedModelOps, fused_library, rms_norm, silu_mul

from conftest import build_model, random_prompts, reference_greedy

pytestmark = pytest.mark.skipif(fused_library() is None, reason="no C compiler")


def _fused_wins(op, width, dtype, fwd):
    return {"fused": [1.0, 1.0], "module": [2.0, 2.0]}


def _torch_rms(x, w, eps, gemma=False):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).to(x.dtype) if gemma else w * h.to(x.dtype)


def _dtype_or_skip(dtype):
    if dtype not in fused_library().dtypes:
        assert dtype == torch.float16  # float32 and bfloat16 always; float16 needs the compiler's _Float16
        pytest.skip("this compiler has no _Float16: float16 stays with the modules' forwards")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_torch_within_an_ulp_and_takes_strided_rows(dtype):
    _dtype_or_skip(dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 2, 300, generator=g).to(dtype)[:, 1]  # rows at a stride of 600
    w = torch.randn(300, generator=g).to(dtype)
    for gemma in (False, True):
        scale = (1.0 + w.float()) if gemma else w.float()
        got = rms_norm(x, scale, 1e-6, round_first=not gemma)
        rtol = {torch.float32: 2e-7, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]  # an ulp of the dtype
        torch.testing.assert_close(got, _torch_rms(x, w, 1e-6, gemma), rtol=rtol, atol=1e-6)
        assert got.dtype == dtype and got.shape == x.shape


def test_rms_norm_takes_a_qk_norm_decode_view_whose_size_one_dim_has_any_stride():
    # A QK norm over [1, H, T, D] transposed from [1, T, H, D]: with T = 1 (one decode row) the T
    # dim's stride is H * D, which contiguous() keeps (size-1 dims do not count); it crashed.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, 4, 16, generator=g).transpose(1, 2)
    assert x.shape == (1, 4, 1, 16) and x.is_contiguous() and x.stride(2) == 64
    w = torch.randn(16, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, round_first=True), _torch_rms(x, w, 1e-6), rtol=2e-7, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_torch_on_the_halves_of_a_fused_output(dtype):
    _dtype_or_skip(dtype)
    g = torch.Generator().manual_seed(1)
    both = (torch.randn(5, 3, 2 * 70, generator=g) * 6).to(dtype)
    gate, up = both[..., :70], both[..., 70:]
    ref = torch.nn.functional.silu(gate) * up
    got = silu_mul(gate, up)
    if dtype == torch.bfloat16:  # float32 exp within 2 ulp, then rounded to bf16 as torch does
        torch.testing.assert_close(got, ref, rtol=8e-3, atol=1e-6)
    elif dtype == torch.float16:  # the same, rounded to float16 (an ulp is 2**-10 relative)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-6)
    else:
        torch.testing.assert_close(got, ref, rtol=3e-7, atol=1e-7)
    edges = torch.tensor([-200.0, -90.0, -1.0, 0.0, 1.0, 90.0, 200.0, float("inf")])
    torch.testing.assert_close(silu_mul(edges, torch.ones(8)), torch.nn.functional.silu(edges))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "qwen3"])
def test_installed_fused_forwards_keep_greedy_tokens_equal_to_generate(family):
    model = build_model(family)
    prompts = random_prompts([1, 7, 30], seed=5)
    refs = [reference_greedy(model, p, 8) for p in prompts]
    ops = FusedModelOps(model, measure=_fused_wins)
    try:
        assert ops.installed and all(c[0] == "fused" for c in ops.choices.values())
        eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32), fuse_model_ops=False))
        try:
            hs = [eng.submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
            assert [h.result(timeout=600).output_token_ids for h in hs] == refs
        finally:
            eng.close()
    finally:
        ops.restore()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_module_keeps_its_forward_where_it_timed_faster():
    model = build_model("llama")
    ops = FusedModelOps(model, measure=lambda *a: {"fused": [1.0, 3.0], "module": [2.0, 2.0]})
    assert not ops.installed and all(c[0] == "module" for c in ops.choices.values())


def test_engines_share_the_forwards_and_the_last_close_removes_them():
    model = build_model("llama")
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8))
    a, b = LLMEngine(model, cfg), LLMEngine(model, cfg)
    ops = a.patches.fused_ops
    assert ops is not None and b.patches.fused_ops is ops
    a.close()
    assert all(m.__dict__.get("forward") is f for m, f in ops.installed)
    b.close()
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "_hf_contbatch_fused_ops" not in model.__dict__


def test_fuse_model_ops_must_be_a_bool():
    with pytest.raises(ValueError, match="fuse_model_ops"):
        EngineConfig(fuse_model_ops="yes")


def _conversion_builds():
    """This CPU's build, and on x86 the build a CPU without AVX512-FP16 gets (its float16
    conversions are integer code there: ``fused_ops.c``)."""
    import ctypes
    import platform

    from hf_contbatch.kernels.fused_ops import _FLAGS, _SOURCE
    from hf_contbatch.kernels.native_build import EMULATIONS, build_library

    builds = {"this CPU": ctypes.CDLL(fused_library().path)}
    if platform.machine() in ("x86_64", "AMD64"):
        builds["no AVX512-FP16"] = ctypes.CDLL(str(build_library(_SOURCE, [*_FLAGS, *EMULATIONS["no-bf16"]])))
    return builds


def test_float16_conversions_are_torchs_for_every_value_in_every_build():
    # Widening: every one of the 65,536 float16 bit patterns, bit for bit (NaNs made quiet, payload
    # kept, as c10::Half does). Narrowing (round to nearest even, overflow to infinity, subnormals):
    # every float16 value, the midpoints between neighbours and the floats either side of them, and
    # random float32 bit patterns, bit for bit; a NaN stays a NaN.
    import ctypes

    _dtype_or_skip(torch.float16)
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = halves.float()
    finite = values[torch.isfinite(values)].unique()
    mid = ((finite[1:].double() + finite[:-1].double()) / 2).float()
    up = torch.nextafter(mid, torch.tensor(float("inf")))
    down = torch.nextafter(mid, torch.tensor(-float("inf")))
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    floats = torch.cat([values, mid, up, down, noise.view(torch.float32), torch.tensor([65519.996, 65520.0, 1e-45])])
    nan = torch.isnan(floats)
    ptr = ctypes.c_void_p
    for name, lib in _conversion_builds().items():
        widened = torch.empty(65536)
        lib.hf_contbatch_fused_f16_to_f32(ptr(halves.data_ptr()), ptr(widened.data_ptr()), ctypes.c_int64(65536))
        assert torch.equal(widened.view(torch.int32), values.view(torch.int32)), name
        narrowed = torch.empty(floats.numel(), dtype=torch.float16)
        lib.hf_contbatch_fused_f32_to_f16(
            ptr(floats.data_ptr()), ptr(narrowed.data_ptr()), ctypes.c_int64(floats.numel())
        )
        want = floats.half()
        assert torch.equal(narrowed[~nan].view(torch.int16), want[~nan].view(torch.int16)), name
        assert torch.isnan(narrowed[nan]).all(), name


def test_float16_ops_give_the_same_bits_in_every_build():
    # Where the CPU has AVX512-FP16 its build converts element by element through _Float16; the build
    # of a CPU without it converts blocks by F16C's vectors (fused_ops.c, F16_BLOCKS). Both promise the
    # same operations and roundings (each op rounded to float16 as torch's eager ops), so the same bits.
    import ctypes

    _dtype_or_skip(torch.float16)
    builds = _conversion_builds()
    if len(builds) < 2:
        pytest.skip("one build here (not x86)")
    g = torch.Generator().manual_seed(3)
    rows, n, heads, d = 7, 300, 3, 66  # n past one 256-value block, d not a multiple of 8
    x, res = (torch.randn(rows, n, generator=g) * 4).half(), torch.randn(rows, n, generator=g).half()
    scale = torch.rand(n, generator=g) + 0.5
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 6).half()
    qk = torch.randn(rows, heads * d + 5, generator=g).half()  # a column slice at a row stride
    cos, sin = torch.randn(rows, d, generator=g).half(), torch.randn(rows, d, generator=g).half()
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    outs = {}
    for name, lib in builds.items():
        got = []
        for round_first in (0, 1):
            y = torch.empty(rows, n, dtype=torch.float16)
            lib.hf_contbatch_rms_norm_f16(p(x.data_ptr()), i64(rows), i64(n), i64(n), p(scale.data_ptr()), f32(1e-6),
                                          i32(round_first), p(y.data_ptr()), i64(n), i32(1))  # fmt: skip
            s, y2 = torch.empty_like(y), torch.empty_like(y)
            lib.hf_contbatch_add_rms_norm_f16(p(x.data_ptr()), p(res.data_ptr()), i64(rows), i64(n), i64(n), i64(n),
                                              p(scale.data_ptr()), f32(1e-6), i32(round_first), p(s.data_ptr()),
                                              p(y2.data_ptr()), i32(1))  # fmt: skip
            got += [y, s, y2]
        y = torch.empty(rows, n, dtype=torch.float16)
        lib.hf_contbatch_silu_mul_f16(p(gate_up.data_ptr()), p(gate_up.data_ptr() + 2 * n), i64(rows), i64(n),
                                      i64(2 * n), i64(2 * n), p(y.data_ptr()), i32(1))  # fmt: skip
        r = torch.empty(rows, heads, d, dtype=torch.float16)
        lib.hf_contbatch_rotary_f16(p(qk.data_ptr()), i64(rows), i64(heads), i64(d), i64(d), i64(heads * d + 5),
                                    p(cos.data_ptr()), p(sin.data_ptr()), i64(d), p(r.data_ptr()), i32(1))  # fmt: skip
        # Partial rotary (Phi-3's form): the first 40 features of each head rotated, the rest copied.
        partial = torch.empty(rows, heads, d, dtype=torch.float16)
        lib.hf_contbatch_rotary_f16(p(qk.data_ptr()), i64(rows), i64(heads), i64(d), i64(40), i64(heads * d + 5),
                                    p(cos.data_ptr()), p(sin.data_ptr()), i64(d), p(partial.data_ptr()), i32(1))  # fmt: skip
        outs[name] = [*got, y, r, partial]
    first, second = outs.values()
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # The copied features are the input's bits.
    tail = qk[:, : heads * d].reshape(rows, heads, d)[..., 40:]
    assert torch.equal(first[-1][..., 40:].view(torch.int16), tail.view(torch.int16))
