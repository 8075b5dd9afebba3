"""Packed linears (``EngineConfig.linear_backend``), with our GEMM ("native") and oneDNN's: same
greedy tokens as transformers' generate, forwards restored on close, weights changed in place
followed, wrapped modules skipped, a kernel that cannot be built falls back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from hf_contbatch.kernels.linears import onednn_available, pack_linears
from hf_contbatch.kernels.linears.autotune import KernelTuner

from conftest import build_model, random_prompts, reference_greedy

NEEDS_ONEDNN = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def _have_cc() -> bool:
    return bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"))


NEEDS_CC = pytest.mark.skipif(
    not _have_cc(),
    reason="no C compiler: our GEMM cannot be built (.ci/run installs gcc)",
)
#: The packing kernels.
KERNELS = [pytest.param("native", marks=NEEDS_CC), pytest.param("onednn", marks=NEEDS_ONEDNN)]

NEW = 12


def _generate(model, prompts, backend: str):
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=8, num_blocks=64), linear_backend=backend))
    try:
        return [
            eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=600).output_token_ids
            for p in prompts
        ]
    finally:
        eng.close()


def _instance_forwards(model, kind=torch.nn.Module) -> int:
    """Modules of ``kind`` with a forward of their own (packed linears; fused norms and MLPs)."""
    return sum("forward" in m.__dict__ for m in model.modules() if isinstance(m, kind))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("backend", [*KERNELS, "torch"])
def test_greedy_equals_generate_with_each_linear_backend(family, backend):
    model = build_model(family)
    prompts = random_prompts([3, 21, 40], seed=11)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    assert _generate(model, prompts, backend) == refs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", KERNELS)
def test_close_removes_the_packed_forwards_and_the_model_computes_as_before(kernel):
    model = build_model("llama")
    ids = torch.tensor([random_prompts([9], seed=2)[0]])
    with torch.no_grad():
        before = model(ids).logits
    num_linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=16), linear_backend=kernel))
    assert len(eng.packed_linears) == num_linears and eng.packed_linears.kernel_names == (kernel,)
    assert _instance_forwards(model, torch.nn.Linear) == num_linears  # (norms/MLPs may be fused too)
    eng.close()
    assert _instance_forwards(model) == 0  # every forward the engine installed is gone
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # F.linear again: bit for bit


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", KERNELS)
def test_weights_changed_in_place_while_open_are_followed(kernel):
    model, other = build_model("llama", seed=0), build_model("llama", seed=1)
    prompts = random_prompts([7, 30], seed=4)
    refs_other = [reference_greedy(other, p, NEW) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=32), linear_backend=kernel))
    try:
        eng.submit(prompts[0], SamplingParams(max_new_tokens=2)).result(timeout=300)  # packed and used
        model.load_state_dict(other.state_dict())  # in-place copies into every weight
        outs = [
            eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=300).output_token_ids
            for p in prompts
        ]
    finally:
        eng.close()
    assert outs == refs_other


@pytest.mark.parametrize("kernel", KERNELS)
def test_modules_with_hooks_or_their_own_forward_are_left_alone(kernel):
    model = build_model("llama")
    layer = model.model.layers[0]
    layer.self_attn.q_proj.register_forward_hook(lambda *a: None)
    wrapped = layer.mlp.up_proj
    original = wrapped.forward
    wrapped.forward = lambda x: original(x)  # how accelerate's hooks wrap a module
    packed = pack_linears(model, kernel)
    try:
        assert layer.self_attn.q_proj not in packed.modules and wrapped not in packed.modules
        assert len(packed) == sum(type(m) is torch.nn.Linear for m in model.modules()) - 2
    finally:
        packed.restore()
    assert "forward" in wrapped.__dict__, "restore() removed a forward it had not installed"


def test_auto_leaves_weights_unpacked_when_the_copy_would_not_fit():
    model = build_model("llama")
    assert pack_linears(model, "auto", available_bytes=lambda: 4096) is None
    assert _instance_forwards(model) == 0
    assert pack_linears(model, "torch") is None


def test_bad_linear_backend_names_the_argument_and_the_choices():
    with pytest.raises(
        ValueError, match=r"`linear_backend` must be one of \('auto', 'torch', 'native', 'onednn'\), got 'mkl'"
    ):
        EngineConfig(linear_backend="mkl")


def _probe(module, x):
    with torch.no_grad():
        return module(x), torch.nn.functional.linear(x, module.weight, module.bias)


@pytest.mark.parametrize("kernel", KERNELS)
def test_weights_given_new_storage_are_repacked_and_copies_work(kernel):
    import copy
    import pickle

    model = build_model("llama")
    packed = pack_linears(model, kernel)
    try:
        lin = model.model.layers[0].mlp.up_proj
        x = torch.randn(4, lin.in_features)
        new = torch.randn_like(lin.weight)
        lin.weight.data = new.clone()  # same Parameter, same version, new storage
        # The reference is the new weight itself: a released weight cannot be read while packed.
        with torch.no_grad():
            torch.testing.assert_close(lin(x), x @ new.T, rtol=1e-5, atol=1e-5)
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            twin_lin = twin.model.layers[0].mlp.up_proj
            with torch.no_grad():
                torch.testing.assert_close(twin_lin(x), x @ new.T, rtol=1e-5, atol=1e-5)
    finally:
        packed.restore()


@pytest.mark.parametrize("kernel", KERNELS)
def test_autograd_through_a_packed_module_falls_back_to_f_linear(kernel):
    model = build_model("llama")
    packed = pack_linears(model, kernel)
    try:
        lin = model.model.layers[0].mlp.up_proj
        lin.weight.requires_grad_(False)  # frozen base layer, trainable input (LoRA, prompt tuning)
        x = torch.randn(2, lin.in_features, requires_grad=True)
        lin(x).sum().backward()
        torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(2, -1))  # d(sum(W x))/dx = column sums
    finally:
        packed.restore()


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_failure_while_packing_leaves_the_model_untouched(monkeypatch, kernel):
    from hf_contbatch.kernels.linears import NativeGEMM, OneDNNGEMM

    model = build_model("llama")
    calls = {"n": 0}

    def failing(real):
        def pack(*args):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("out of memory (simulated)")
            return real(*args)

        return pack

    gemm = {"native": NativeGEMM, "onednn": OneDNNGEMM}[kernel]
    monkeypatch.setattr(gemm, "pack", failing(gemm.pack))
    with pytest.raises(RuntimeError, match="simulated"):
        pack_linears(model, kernel)
    assert _instance_forwards(model) == 0
    # "auto", timed so that this kernel wins every shape: when it fails, the shapes are chosen again
    # without it, and the other kernel packs them (or nothing, where it is not available).
    other = {"native": "onednn", "onednn": "native"}[kernel]
    candidates = {kernel: gemm()}
    if onednn_available() if other == "onednn" else _have_cc():
        candidates[other] = {"native": NativeGEMM, "onednn": OneDNNGEMM}[other]()
    seconds = {kernel: 1.0, other: 2.0, "torch": 3.0}
    tuner = KernelTuner(
        candidates, cache_path=None, measure=lambda i, o, d, bs: {n: dict.fromkeys(bs, t) for n, t in seconds.items()}
    )
    calls["n"] = 0
    packed = pack_linears(model, "auto", fuse=True, tuner=tuner)
    try:
        if other not in candidates:
            assert packed is None and _instance_forwards(model) == 0
        else:
            assert packed.kernel_names == (other,) and _instance_forwards(model) == len(packed)
            assert kernel not in tuner.candidates  # left out after its failure
    finally:
        if packed is not None:
            packed.restore()


@pytest.mark.timeout(600)
def test_without_a_c_compiler_native_raises_and_auto_uses_onednn(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from conftest import build_model
        from hf_contbatch.kernels.linears import onednn_available, pack_linears
        model = build_model("llama")
        try:
            pack_linears(model, "native")
        except RuntimeError as exc:
            print("native raised:", exc)
        from hf_contbatch.kernels.linears.autotune import KernelTuner
        from hf_contbatch.kernels.linears.registry import available_kernels
        kernels = available_kernels()
        print("candidates:", sorted(kernels))
        # Timed so that a packed kernel wins every shape (timings are the CPU's business, not this test's).
        tuner = KernelTuner(kernels, cache_path=None, measure=lambda i, o, d, bs: {n: dict.fromkeys(bs, 1.0 if n != "torch" else 2.0) for n in kernels | {"torch": 0}})
        packed = pack_linears(model, "auto", tuner=tuner)
        print("auto:", None if packed is None else packed.label, onednn_available())
        """
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)}
    tests_dir = str(Path(__file__).parents[1])
    out = subprocess.run(
        [sys.executable, "-c", script, tests_dir], env=env, capture_output=True, text=True, timeout=550
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "native raised:" in out.stdout and "no-such-cc" in out.stdout, out.stdout
    assert ("auto: onednn True" in out.stdout) or ("auto: None False" in out.stdout), out.stdout
    assert "candidates: ['onednn']" in out.stdout or "candidates: []" in out.stdout, out.stdout


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_wrapper_installed_over_a_packed_forward_runs_f_linear_after_restore(kernel):
    model = build_model("llama")
    packed = pack_linears(model, kernel)
    lin = model.model.layers[0].mlp.up_proj
    inner = lin.forward
    lin.forward = lambda x: inner(x)  # wrapped after packing (as accelerate's add_hook_to_module does)
    packed.restore()
    assert inner.packed is None, "restore() must free the packed copy even when it cannot unhook it"
    x = torch.randn(3, lin.in_features)
    got, want = _probe(lin, x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_inputs_and_biases_that_do_not_fit_get_torchs_own_error_and_strided_biases_work(kernel):
    lin = torch.nn.Linear(64, 48)
    model = torch.nn.Sequential(lin)
    with torch.no_grad():
        lin.bias = torch.nn.Parameter(torch.randn(48, 2)[:, 0])  # a strided bias
    packed = pack_linears(model, kernel)
    try:
        x = torch.randn(3, 64)
        got, want = _probe(lin, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            lin(torch.randn(3, 100))  # as F.linear says it, not a read past the weight
        lin.bias = torch.nn.Parameter(torch.randn(48, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError):
            with torch.no_grad():
                lin(x)
    finally:
        packed.restore()


@pytest.mark.parametrize("kernel", KERNELS)
def test_writes_through_data_are_followed_after_repack(kernel):
    model = build_model("llama")
    packed = pack_linears(model, kernel, fuse=True)
    try:
        for lin in (model.model.layers[0].self_attn.k_proj, model.model.layers[0].mlp.down_proj):
            lin.weight.data.mul_(2)  # the version counter does not see this
            packed.repack()
            x = torch.randn(4, lin.in_features)
            q = model.model.layers[0].self_attn.q_proj
            with torch.no_grad():
                if lin is not q and lin.in_features == q.in_features:
                    q(x)  # the group leader computes the fused output first, as the model calls them
                got = lin(x)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    finally:
        packed.restore()


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_bias_added_to_a_fused_member_while_open_is_followed(kernel):
    model, ref = build_model("llama"), build_model("llama")  # same seed: same weights
    prompts = random_prompts([9, 20], seed=6)
    # v, not k: a bias on the keys shifts every score of a query equally, softmax cannot see it
    bias = torch.randn(model.model.layers[0].self_attn.v_proj.out_features)
    ref.model.layers[0].self_attn.v_proj.bias = torch.nn.Parameter(bias.clone())
    refs = [reference_greedy(ref, p, NEW) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=32), linear_backend=kernel))
    try:
        eng.submit(prompts[0], SamplingParams(max_new_tokens=2)).result(timeout=300)  # packed and fused
        model.model.layers[0].self_attn.v_proj.bias = torch.nn.Parameter(bias.clone())
        outs = [
            eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)).result(timeout=300).output_token_ids
            for p in prompts
        ]
    finally:
        eng.close()
    assert outs == refs


def test_a_repack_that_fails_falls_back_to_f_linear_with_a_warning(monkeypatch, caplog):
    from hf_contbatch.kernels.linears import NativeGEMM

    if not _have_cc():
        pytest.skip("no C compiler: our GEMM cannot be built")
    model = build_model("llama")
    packed = pack_linears(model, "native")
    try:
        monkeypatch.setattr(NativeGEMM, "pack", lambda self, w: (_ for _ in ()).throw(RuntimeError("simulated")))
        lin = model.model.layers[0].mlp.down_proj
        with torch.no_grad():
            lin.weight.mul_(2)  # changed: the next call repacks, which fails
        x = torch.randn(3, lin.in_features)
        with caplog.at_level("WARNING", logger="hf_contbatch.kernels.linears.packed_forward"):
            got, want = _probe(lin, x)
        assert torch.equal(got, want)
        assert "runs F.linear from now on" in caplog.text
    finally:
        packed.restore()


@pytest.mark.timeout(600)
def test_cc_may_carry_arguments(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    script = "from hf_contbatch.kernels.linears import NativeGEMM; NativeGEMM(); print('built')"
    env = {**os.environ, "CC": f"{cc} -w", "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=550)
    assert out.returncode == 0 and "built" in out.stdout, out.stderr[-2000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: fused q/k/v with biases
def test_a_verified_step_computes_the_same_bits_and_other_threads_keep_their_checks(kernel, family):
    """Inside ``PackedLinears.verified_step`` (the engine's eager steps) calls skip the per-call
    weight checks: same logits bit for bit as the checked calls; another thread's calls, and calls
    after the block, still follow weights changed in place."""
    model = build_model(family)
    other = build_model(family, seed=1)
    ids = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    packed = pack_linears(model, kernel, fuse=True)
    try:
        with torch.inference_mode():
            checked = model(input_ids=ids).logits
            with packed.verified_step():
                if kernel == "native":  # the verified calls go straight to the GEMM, unchecked
                    from hf_contbatch.kernels.linears import native_gemm

                    counts = {"checked": 0}
                    real = native_gemm.native_linear

                    def counting(*args):
                        counts["checked"] += 1
                        return real(*args)

                    native_gemm.native_linear = counting
                    try:
                        verified = model(input_ids=ids).logits
                    finally:
                        native_gemm.native_linear = real
                    assert counts["checked"] == 0
                else:
                    verified = model(input_ids=ids).logits
                # An input the packed weight does not fit still gets torch's own error.
                lin = model.model.layers[0].mlp.down_proj
                with pytest.raises(RuntimeError):
                    lin(torch.randn(2, lin.in_features + 1))
                # Another thread (not the step's) changes a weight and calls: the checked path repacks.
                x = torch.randn(3, lin.in_features)
                result = {}

                def in_other_thread():
                    with torch.inference_mode():
                        lin.weight.mul_(2)
                        result["got"] = lin(x)

                t = threading.Thread(target=in_other_thread)
                t.start()
                t.join(150)
                torch.testing.assert_close(result["got"], _probe(lin, x)[1], rtol=1e-5, atol=1e-5)
            assert torch.equal(verified, checked)
            # After the block: a weight changed in place is followed by the next checked call.
            model.load_state_dict(other.state_dict())
            after = model(input_ids=ids).logits
            with packed.verified_step():  # and a step started after the change repacks first
                after_verified = model(input_ids=ids).logits
        with torch.inference_mode():
            want = other(input_ids=ids).logits  # never packed: F.linear
        torch.testing.assert_close(after, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(after_verified, after)
    finally:
        packed.restore()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_weight_no_longer_float32_is_not_packed_but_runs_f_linear(kernel, caplog):
    """A weight given float64 storage while packed (``.data = ...``) cannot be repacked (both
    kernels read float32): the module warns once and runs ``F.linear`` from then on."""
    model = build_model("llama")
    packed = pack_linears(model, kernel, fuse=True)
    try:
        attn = model.model.layers[0].self_attn
        lin = model.model.layers[0].mlp.down_proj
        attn.k_proj.weight.data = attn.k_proj.weight.data.double()  # a fused member
        lin.weight.data = lin.weight.data.double()
        with caplog.at_level("WARNING"), torch.inference_mode(), packed.verified_step():
            x = torch.randn(3, lin.in_features, dtype=torch.float64)
            got_lin = lin(x)
            h = torch.randn(3, attn.k_proj.in_features, dtype=torch.float64)
            got_k = attn.k_proj(h)
        assert "runs F.linear from now on" in caplog.text
        with torch.inference_mode():
            assert torch.equal(got_lin, torch.nn.functional.linear(x, lin.weight))
            assert torch.equal(got_k, torch.nn.functional.linear(h, attn.k_proj.weight))
    finally:
        packed.restore()


def _storage_bytes(model) -> int:
    """Bytes of distinct parameter storage (a tied weight counted once)."""
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fuse", [False, True])
@NEEDS_CC
def test_native_packing_releases_the_float_weights_and_restore_gives_them_back_bit_for_bit(fuse):
    model = build_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    linear_bytes = sum(
        m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear
    )
    resident = _storage_bytes(model)
    ids = torch.tensor([random_prompts([9], seed=3)[0]])
    with torch.no_grad():
        want = model(ids).logits
    packed = pack_linears(model, "native", fuse=fuse, release_weights=True)
    try:
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size() if tied else 0
        # Every linear weight but a tied LM head (the embedding reads it) is down to one element.
        assert resident - _storage_bytes(model) >= linear_bytes - head_bytes - 4 * len(packed)
        if tied:
            assert torch.equal(model.get_input_embeddings().weight, before["model.embed_tokens.weight"])
        with torch.no_grad():  # the model still computes (a user's own call while packed)
            torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)
    finally:
        packed.restore()
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert _storage_bytes(model) == resident


@pytest.mark.timeout(600)
@NEEDS_CC
def test_a_released_weight_given_new_values_loaded_or_needed_by_autograd_stays_correct():
    import copy

    model = build_model("llama")
    packed = pack_linears(model, "native", fuse=True, release_weights=True)
    try:
        lin = model.model.layers[0].mlp.down_proj
        q = model.model.layers[0].self_attn.q_proj
        x = torch.randn(2, lin.in_features)
        new = torch.randn(lin.out_features, lin.in_features)
        lin.weight.data = new.clone()  # new storage: repacked and released again on the next call
        with torch.no_grad():
            torch.testing.assert_close(lin(x), x @ new.T)
        up = model.model.layers[0].mlp.up_proj
        state = {"model.layers.0.mlp.up_proj.weight": torch.randn_like(up.weight)}
        model.load_state_dict(state, strict=False)  # into released weights: put back first, then repacked
        with torch.no_grad():
            torch.testing.assert_close(
                up(x[:, : up.in_features]), x[:, : up.in_features] @ state["model.layers.0.mlp.up_proj.weight"].T
            )
        twin = copy.deepcopy(model)  # a copy carries the released values in its packed copy
        with torch.no_grad():
            torch.testing.assert_close(twin.model.layers[0].mlp.down_proj(x), x @ new.T)
        q.weight.requires_grad_(True)
        xq = torch.randn(2, q.in_features, requires_grad=True)
        q(xq).sum().backward()  # autograd: the float weight comes back and takes the gradient
        assert q.weight.grad is not None and q.weight.grad.shape == q.weight.shape
        assert torch.isfinite(q.weight).all()
    finally:
        packed.restore()
    assert torch.equal(lin.weight, new)
