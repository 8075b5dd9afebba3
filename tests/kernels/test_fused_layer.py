"""The fused decoder-layer step (``kernels/fused_layer``): its C rotary embedding and residual-add +
RMSNorm against transformers' eager code, and installed by an engine on Llama-form layers: greedy
tokens equal transformers' generate (also under preemption and chunked prefill, no block leaked;
a one-request decode with q and k rotated in one call), the unchecked kernel entries give the
checked functions' bits,
other families keep their own forwards, hooks and unserved calls run the layer's own forward, and
the last close removes the forwards."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.kernels.fused_layer import FusedLayerForward, layer_form
from hf_contbatch.kernels.fused_ops import (
    UncheckedKernels,
    add_rms_norm,
    fused_library,
    rms_norm,
    rms_norm_rotary,
    rotary,
    silu_mul,
    unchecked_kernels,
)
from hf_contbatch.kernels.linears.fused import FusedGroup
from hf_contbatch.kernels.paged_cache import PagedCacheStep

from conftest import build_model, random_prompts, reference_greedy, serve_greedy

pytestmark = pytest.mark.skipif(fused_library() is None, reason="no C compiler")

NEW = 10


def _dtype_or_skip(dtype):
    if dtype not in fused_library().dtypes:
        assert dtype == torch.float16  # float32 and bfloat16 always; float16 needs the compiler's _Float16
        pytest.skip("this compiler has no _Float16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 16, 7])
def test_rotary_equals_transformers_eager_bit_for_bit_on_fused_qkv_slices(dtype, head_dim):
    _dtype_or_skip(dtype)
    g = torch.Generator().manual_seed(head_dim)
    rows, heads, kv_heads = 37, 4, 2
    # q, k: column slices of one fused q/k/v GEMM output, as the layer gets them.
    qkv = (torch.randn(1, rows, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    q, k = qkv[..., : heads * head_dim], qkv[..., heads * head_dim : (heads + kv_heads) * head_dim]
    cos, sin = (torch.randn(1, rows, head_dim, generator=g).to(dtype) for _ in range(2))
    as_heads = lambda t: t.view(1, rows, -1, head_dim).transpose(1, 2)  # noqa: E731 - the module's view
    want_q, want_k = apply_rotary_pos_emb(as_heads(q), as_heads(k), cos, sin)
    got_q, got_k = rotary(q[0], cos[0], sin[0], head_dim), rotary(k[0], cos[0], sin[0], head_dim)
    assert got_q.shape == (rows, heads, head_dim) and got_q.is_contiguous() and got_q.dtype == dtype
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [128, 16, 7])
@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_q_norm_and_rotary_equal_the_modules_norm_then_rotary(family, dtype, head_dim):
    """Qwen3's per-head ``q_norm(q.view(..., heads, head_dim))`` or OLMo2's ``q_norm(q)`` over all
    heads, then ``apply_rotary_pos_emb``, from one C pass over column slices of a fused q/k/v
    output: in bfloat16/float16 torch's bits; in float32 within an ulp (the sum of squares is added
    in another order, as ``rms_norm``'s), and always bit for bit ``rotary`` of ``rms_norm`` (the
    kernels the other tests hold to torch)."""
    _dtype_or_skip(dtype)
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm_cls = getattr(module, f"{family.capitalize()}RMSNorm")
    g = torch.Generator().manual_seed(head_dim)
    rows, heads, kv_heads = 9, 4, 2
    group = 1 if family == "qwen3" else heads  # heads per norm
    qkv = (torch.randn(1, rows, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    q = qkv[..., : heads * head_dim]
    cos, sin = (torch.randn(1, rows, head_dim, generator=g).to(dtype) for _ in range(2))
    norm = norm_cls(group * head_dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(group * head_dim, generator=g))
        norm = norm.to(dtype)
        if family == "qwen3":
            normed = norm(q.view(1, rows, heads, head_dim)).transpose(1, 2)
        else:
            normed = norm(q).view(1, rows, heads, head_dim).transpose(1, 2)
        want = module.apply_rotary_pos_emb(normed, normed, cos, sin)[0][0].transpose(0, 1)
    scale, round_first = norm.weight.float(), family == "qwen3"
    got = rms_norm_rotary(q[0], scale, 1e-6, round_first, cos[0], sin[0], head_dim, group)
    assert got.shape == (rows, heads, head_dim) and got.is_contiguous() and got.dtype == dtype
    two_passes = rms_norm(q[0].reshape(rows * heads // group, -1), scale, 1e-6, round_first).view(rows, -1)
    assert torch.equal(got, rotary(two_passes, cos[0], sin[0], head_dim))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)
    kernels = unchecked_kernels(dtype)
    unchecked = kernels.rms_norm_rotary(
        q, rows, heads, head_dim, q.stride(1), group, scale, 1e-6, round_first, cos, sin
    )
    assert torch.equal(unchecked, got)
    with pytest.raises(RuntimeError, match="rms_norm_rotary"):
        rms_norm_rotary(q[0], scale[:-1].contiguous(), 1e-6, round_first, cos[0], sin[0], head_dim, group)


def test_rotary_refuses_what_does_not_fit():
    x = torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="rotary"):
        rotary(x, torch.randn(3, 8), torch.randn(3, 8), 16)  # cos of another width
    with pytest.raises(RuntimeError, match="rotary"):
        rotary(x, torch.randn(3, 16).double(), torch.randn(3, 16).double(), 16)  # another dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_residual_add_and_rms_norm_match_the_layer_ops(dtype):
    _dtype_or_skip(dtype)
    g = torch.Generator().manual_seed(3)
    width = 300
    both = torch.randn(2, 7, 2 * width, generator=g).to(dtype)
    x = both[..., width:]  # a column slice: rows at a stride of 2 * width
    residual = torch.randn(2, 7, width, generator=g).to(dtype)
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=g))
    norm = norm.to(dtype)
    total, normed = add_rms_norm(x, residual, norm.weight.float(), 1e-5, round_first=True)
    assert torch.equal(total, residual + x)  # the layer's residual add, exactly
    with torch.no_grad():
        want = norm(residual + x)
    # torch sums the squares in another order: an ulp of the dtype at most.
    rtol = {torch.float32: 2e-7, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(normed, want, rtol=rtol, atol=1e-6)
    assert normed.dtype == dtype and normed.shape == x.shape


def _serve(model, prompts, cfg, monkeypatch=None):
    """Greedy tokens of ``prompts`` through an engine (no block leaked), the fast path's calls counted."""
    served = []
    if monkeypatch is not None:
        real = PagedCacheStep.store_and_attend

        def counted(self, layer_idx, *args):
            served.append(layer_idx)
            return real(self, layer_idx, *args)

        monkeypatch.setattr(PagedCacheStep, "store_and_attend", counted)
    seen = {}

    def count_fused(engine):
        layers = engine.patches.fused_layers
        seen["fused"] = {} if layers is None else layers.forms()  # before close removes them

    outs, stats = serve_greedy(model, prompts, cfg, NEW, check=count_fused, timeout=600)
    return outs, stats, seen["fused"], served


_PLAIN = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32))
# 14 blocks of 4 tokens for 4 requests of up to 45 tokens and a 12-token budget: preemption and chunks.
_TIGHT = EngineConfig(
    cache=CacheConfig(block_size=4, num_blocks=14),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12),
)


# Each family's layer form as FusedLayers.forms names it (LayerForm.name).
_FORMS = {
    "llama": "llama",
    "llama-mqa": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qk-norm",
    "phi3": "packed-qkv+packed-gate-up+dropouts+partial-rotary",
    "granite": "residual-multiplier",
    "olmo2": "qk-norm-all+post-norms",
    "gemma": "module-activation+one-plus-norms",
}


def _build(family: str):
    """conftest's tiny model of ``family``, or here those it has none of (Granite with multipliers
    that are not 1, OLMo2)."""
    import transformers as tf

    from conftest import _common

    if family == "granite":
        torch.manual_seed(0)
        cfg = tf.GraniteConfig(
            **_common(residual_multiplier=0.5, attention_multiplier=0.2, embedding_multiplier=2.0, logits_scaling=1.5)
        )
        return tf.GraniteForCausalLM(cfg).eval()
    if family == "olmo2":
        torch.manual_seed(0)
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**_common())).eval()
    return build_model(family)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(_FORMS))
@pytest.mark.parametrize("cfg", [_PLAIN, _TIGHT], ids=["batched", "preempted-chunked"])
def test_recognized_layers_take_the_fused_step_and_keep_greedy_tokens_equal_to_generate(family, cfg, monkeypatch):
    model = _build(family)
    prompts = random_prompts([1, 7, 30, 45], seed=5)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, stats, fused, served = _serve(model, prompts, cfg, monkeypatch)
    assert outs == refs
    n = model.config.num_hidden_layers
    assert fused == {_FORMS[family]: n}
    assert served and set(served) == set(range(n))  # every layer took the fused step
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    if cfg is _TIGHT and family != "mistral":  # Mistral's 8-token window gives blocks back: no pressure
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert not any("forward" in m.__dict__ for m in model.modules())  # all removed by close


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gemma2"])
def test_other_families_keep_their_own_layer_forward(family, monkeypatch):
    # Gemma 2 norms before and after each sublayer (four norms a layer) and soft-caps attention:
    # its code reads otherwise, so no fused step, and generate's tokens all the same.
    model = build_model(family)
    assert not any(layer_form(m) for m in model.modules())
    prompts = random_prompts([7, 30], seed=6)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, _, fused, served = _serve(model, prompts, _PLAIN, monkeypatch)
    assert outs == refs and fused == {} and not served


@pytest.mark.timeout(600)
def test_qwen3_moe_dense_layers_take_the_fused_step_and_its_sparse_layers_keep_their_forward(monkeypatch):
    # Qwen3-MoE's layer and attention read as Qwen3's; a layer listed in mlp_only_layers has the
    # gated SiLU MLP (fused), the others a sparse MoE block (their own forward).
    import transformers as tf

    from conftest import _common

    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(
        **_common(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])
    )
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    prompts = random_prompts([1, 7, 30, 45], seed=5)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, stats, fused, served = _serve(model, prompts, _TIGHT, monkeypatch)
    assert outs == refs
    assert fused == {"qk-norm": 1} and served and set(served) == {0}
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"


@pytest.mark.timeout(600)
def test_a_phi3_layer_with_a_dropout_in_training_mode_runs_its_own_forward(monkeypatch):
    # The fast path skips Phi-3's residual dropouts as the identity they are in evaluation mode; a
    # dropout put in training mode after the engine started (p = 0 here, so generate's tokens stay
    # the reference) is not skipped: that layer runs its own forward.
    model = build_model("phi3")
    prompts = random_prompts([7, 30], seed=6)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    served = []
    real = PagedCacheStep.store_and_attend
    monkeypatch.setattr(PagedCacheStep, "store_and_attend", lambda self, i, *a: served.append(i) or real(self, i, *a))
    eng = LLMEngine(model, _PLAIN)
    try:
        model.model.layers[0].resid_mlp_dropout.train()
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        assert [h.result(timeout=600).output_token_ids for h in handles] == refs
        assert eng.patches.fused_layers.forms() == {"packed-qkv+packed-gate-up+dropouts+partial-rotary": 2}
    finally:
        eng.close()
    assert served and set(served) == {1}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cfg", [_PLAIN, _TIGHT], ids=["batched", "preempted-chunked"])
def test_phi3_with_partial_rotary_takes_the_fused_step(cfg, monkeypatch):
    # Phi-3's rotary leaves a head's last features unrotated when cos is narrower than the head:
    # the C rotary rotates the first half of each head here and copies the rest.
    model = build_model("phi3", partial_rotary_factor=0.5)
    prompts = random_prompts([1, 7, 30, 45], seed=6)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, stats, fused, served = _serve(model, prompts, cfg, monkeypatch)
    assert outs == refs and fused == {"packed-qkv+packed-gate-up+dropouts+partial-rotary": 2}
    assert served and set(served) == {0, 1}
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary_dim", [8, 6, 24])
def test_partial_rotary_equals_phi3s_eager_rotary_bit_for_bit(dtype, rotary_dim):
    _dtype_or_skip(dtype)
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rotary

    g = torch.Generator().manual_seed(rotary_dim)
    rows, heads, kv_heads, head_dim = 5, 4, 2, 32
    qkv = (torch.randn(1, rows, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    q, k = qkv[..., : heads * head_dim], qkv[..., heads * head_dim : (heads + kv_heads) * head_dim]
    cos, sin = (torch.randn(1, rows, rotary_dim, generator=g).to(dtype) for _ in range(2))
    as_heads = lambda t: t.view(1, rows, -1, head_dim).transpose(1, 2)  # noqa: E731 - the module's view
    want_q, want_k = phi3_rotary(as_heads(q), as_heads(k), cos, sin)
    assert torch.equal(rotary(q[0], cos[0], sin[0], head_dim, rotary_dim), want_q[0].transpose(0, 1))
    assert torch.equal(rotary(k[0], cos[0], sin[0], head_dim, rotary_dim), want_k[0].transpose(0, 1))
    kernels = unchecked_kernels(dtype)
    got = kernels.rotary(q, rows, heads, head_dim, q.stride(1), cos, sin, rotary_dim)
    assert torch.equal(got, want_q[0].transpose(0, 1))
    with pytest.raises(RuntimeError, match="rotary"):
        rotary(q[0], cos[0], sin[0], head_dim)  # cos narrower than the head without rotary_dim


@pytest.mark.timeout(600)
def test_a_hooked_module_runs_the_layers_own_forward(monkeypatch):
    model = build_model("llama")
    seen = []
    handle = model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        prompts = random_prompts([7, 30], seed=7)
        refs = [reference_greedy(model, p, NEW) for p in prompts]
        seen.clear()
        outs, _, fused, served = _serve(model, prompts, _PLAIN, monkeypatch)
    finally:
        handle.remove()
    assert outs == refs
    assert fused == {"llama": 2}
    assert served and set(served) == {0}  # layer 1's hook ran on every step: its own forward served it
    assert seen  # the hook saw the engine's steps


@pytest.mark.timeout(600)
def test_a_forward_replaced_after_install_runs_the_layers_own_forward(monkeypatch):
    # What accelerate's offload does (a wrapper as the instance's forward): the fused step, which
    # does the MLP's work without calling its forward, steps aside for that layer.
    model = build_model("llama")
    prompts = random_prompts([7, 30], seed=9)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    calls = []
    served = []
    real = PagedCacheStep.store_and_attend
    monkeypatch.setattr(PagedCacheStep, "store_and_attend", lambda self, i, *a: served.append(i) or real(self, i, *a))
    eng = LLMEngine(model, _PLAIN)
    try:
        mlp = model.model.layers[0].mlp
        own = mlp.forward
        mlp.forward = lambda x: calls.append(x.shape) or own(x)
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        assert [h.result(timeout=600).output_token_ids for h in handles] == refs
    finally:
        eng.close()
        del mlp.forward
    assert calls and served and set(served) == {1}


def test_outside_an_engine_step_the_layer_runs_its_own_forward():
    # The user's own generate while an engine serves the model: no paged step, the layer's forward.
    model = build_model("llama")
    prompt = random_prompts([9], seed=8)[0]
    ref = reference_greedy(model, prompt, NEW)
    eng = LLMEngine(model, _PLAIN)
    try:
        assert all(isinstance(m.__dict__.get("forward"), FusedLayerForward) for m in model.model.layers)
        assert reference_greedy(model, prompt, NEW) == ref
    finally:
        eng.close()


def test_two_engines_share_the_forwards_and_the_last_close_removes_them():
    model = build_model("llama")
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8))
    a, b = LLMEngine(model, cfg), LLMEngine(model, cfg)
    layers = a.patches.fused_layers
    assert layers is not None and b.patches.fused_layers is layers
    assert "fused decoder layers: 2 of 2" in layers.report()
    a.close()
    assert all(m.__dict__.get("forward") is f for m, f in layers.installed)
    b.close()
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "_hf_contbatch_fused_layers" not in model.__dict__


def test_no_fused_layers_without_fuse_model_ops_or_under_compile_model():
    model = build_model("llama")
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8), fuse_model_ops=False))
    try:
        assert eng.patches.fused_layers is None
        assert not any("forward" in m.__dict__ for m in model.model.layers)
    finally:
        eng.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tokens_equal_the_layers_own_forward(dtype, monkeypatch):
    # generate's bfloat16 tokens may differ from any paged attention's; the layer's own forward in
    # the same engine (same attention kernels, same pool) is the reference for the fused step.
    _dtype_or_skip(dtype)
    model = build_model("llama").to(dtype)
    prompts = random_prompts([3, 17, 40, 60], seed=2)
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    try:
        tokens = {}
        for mode in ("own", "fused"):
            if mode == "own":
                monkeypatch.setattr(FusedLayerForward, "fits", lambda self, *args: None)
            else:
                monkeypatch.undo()
            handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
            tokens[mode] = [h.result(timeout=600).output_token_ids for h in handles]
        assert eng.patches.fused_layers is not None and len(eng.patches.fused_layers.installed) == 2
    finally:
        eng.close()
    assert tokens["fused"] == tokens["own"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
def test_unchecked_kernels_give_the_checked_functions_bits(dtype, rows):
    """The fused layer's unchecked entries (``UncheckedKernels``) on the layouts it passes them
    (column slices of one fused GEMM output, q and k rotated in one call) equal the checked
    functions, which the tests above hold to transformers' eager ops."""
    _dtype_or_skip(dtype)
    g = torch.Generator().manual_seed(11)
    kernels = unchecked_kernels(dtype)
    d, heads, kv_heads, width = 16, 4, 2, 96
    qkv = torch.randn(1, rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k = qkv[..., : heads * d], qkv[..., heads * d : (heads + kv_heads) * d]
    cos, sin = (torch.randn(1, rows, d, generator=g).to(dtype) for _ in range(2))
    want_q, want_k = rotary(q[0], cos[0], sin[0], d), rotary(k[0], cos[0], sin[0], d)
    assert torch.equal(kernels.rotary(q, rows, heads, d, q.stride(1), cos, sin), want_q)
    assert torch.equal(kernels.rotary(k, rows, kv_heads, d, k.stride(1), cos, sin), want_k)
    if rows == 1:  # one call over q and the k after it, as the layer makes at a one-row decode
        both = kernels.rotary(q, 1, heads + kv_heads, d, 0, cos, sin)
        assert torch.equal(both[:, :heads], want_q) and torch.equal(both[:, heads:], want_k)
    x = torch.randn(1, rows, width, generator=g).to(dtype)
    residual = torch.randn(1, rows, width, generator=g).to(dtype)
    scale = torch.randn(width, generator=g)
    for round_first in (True, False):
        assert torch.equal(kernels.rms_norm(x, scale, 1e-5, round_first), rms_norm(x, scale, 1e-5, round_first))
        got, want = (
            kernels.add_rms_norm(x, residual, scale, 1e-5, round_first),
            add_rms_norm(x, residual, scale, 1e-5, round_first),
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gate_up = torch.randn(1, rows, 2 * width, generator=g).to(dtype)
    gate, up = gate_up[..., :width], gate_up[..., width:]
    assert torch.equal(kernels.silu_mul(gate, up, gate.stride(1), up.stride(1)), silu_mul(gate, up))
    alone = up.contiguous()
    assert torch.equal(kernels.silu_mul(gate, alone, gate.stride(1), width), silu_mul(gate, alone))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["llama", "llama-mqa"])
def test_one_request_decodes_with_one_rotary_call_per_layer_and_generates_tokens(family, monkeypatch):
    """A one-request decode step is one row: q and k (adjacent columns of the fused q/k/v GEMM's
    output) are rotated in one C call; each fused group's outputs come from one call; and the
    tokens stay transformers' generate's."""
    model = build_model(family)
    prompt = random_prompts([9], seed=8)[0]
    ref = reference_greedy(model, prompt, NEW)
    calls = []
    real = UncheckedKernels.rotary

    def counted(self, x, rows, heads, *args):
        calls.append((rows, heads))
        return real(self, x, rows, heads, *args)

    monkeypatch.setattr(UncheckedKernels, "rotary", counted)
    grouped = []
    real_outputs = FusedGroup.outputs_verified

    def counted_outputs(self, x):
        out = real_outputs(self, x)
        grouped.append(out is not None and len(out))
        return out

    monkeypatch.setattr(FusedGroup, "outputs_verified", counted_outputs)
    outs, stats, fused, served = _serve(model, [prompt], _PLAIN, monkeypatch)
    assert outs == [ref]
    n, cfg = model.config.num_hidden_layers, model.config
    # Every forward (the prefill and each decode) takes q/k/v and gate/up from one group call a layer.
    assert sorted(grouped) == sorted([3, 2] * n * NEW)
    both = cfg.num_attention_heads + cfg.num_key_value_heads
    # The prefill's 9 rows: q and k apart (2 calls a layer); every decode step's one row: one call.
    assert calls.count((1, both)) == n * (NEW - 1)
    assert len(calls) == 2 * n + n * (NEW - 1)
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
