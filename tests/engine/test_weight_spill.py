"""Float weights under ``quantization="int8"``: spilled to a private file while the int8 copies
serve, freed from memory, put back bit for bit by ``close()``; reading one meanwhile raises an
error naming it (never placeholder values). Expected values: the model's own parameters, cloned
before the engine touched them; byte counts by arithmetic over the linears' shapes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from test_quantized_models import dequantized_copy

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from hf_contbatch.kernels.linears.weight_spill import SpilledWeight, SpilledWeightError

from conftest import build_model, random_prompts, reference_greedy

CFG = EngineConfig(quantization="int8", cache=CacheConfig(num_blocks=64, block_size=4))


def _params(model):
    """Name -> a clone of every parameter (tied ones once), with its dtype and requires_grad."""
    return {n: (p.detach().clone(), p.requires_grad, p) for n, p in model.named_parameters()}


def _storage_bytes(model, packed=None) -> int:
    """Bytes of the distinct storages the model's parameters hold, plus the packed copies'."""
    seen, total = set(), 0
    for p in model.parameters():
        st = p.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    if packed is not None:
        groups = set()
        for f in packed.forwards:
            owner = f.group if f.group is not None else f
            if id(owner) not in groups and owner.packed is not None:
                groups.add(id(owner))
                total += owner.packed.nbytes
    return total


def _assert_restored(model, before):
    now = dict(model.named_parameters())
    assert now.keys() == before.keys()
    for n, (values, requires_grad, obj) in before.items():
        assert now[n] is obj, n  # the same Parameter object
        assert type(now[n]) is torch.nn.Parameter and now[n].requires_grad == requires_grad
        assert now[n].dtype == values.dtype and torch.equal(now[n].detach(), values), n


@pytest.mark.timeout(1500)
def test_float_weights_are_freed_while_serving_and_restored_bit_for_bit():
    model = build_model("llama")
    before = _params(model)
    float_bytes = _storage_bytes(model)
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    linear_float = sum(m.weight.numel() * 4 for m in linears if id(m.weight) not in tied)
    linear_int8 = sum(m.weight.numel() + 4 * m.out_features for m in linears)  # values + float32 scales
    eng = LLMEngine(model, CFG)
    try:
        spill = eng.patches.weight_spill
        assert spill is not None and spill.num_weights > 0 and os.path.isdir(spill.dir)
        assert oct(os.stat(spill.dir).st_mode & 0o777) == "0o700"  # private
        served = _storage_bytes(model, eng.packed_linears)
        # The float linears are gone; what remains is the rest of the model plus about int8's size.
        assert served < float_bytes - linear_float + 1.3 * linear_int8, (served, float_bytes, linear_float)
        assert served < 0.5 * float_bytes
        handles = [eng.submit(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in random_prompts([5, 17])]
        outs = [h.result(timeout=600).output_token_ids for h in handles]
        spill_dir = spill.dir
    finally:
        eng.close()
    assert not os.path.exists(spill_dir)
    _assert_restored(model, before)
    ref = dequantized_copy(model)
    assert outs == [reference_greedy(ref, p, 6) for p in random_prompts([5, 17])]


@pytest.mark.timeout(1500)
def test_reading_a_spilled_weight_raises_an_error_naming_it():
    model = build_model("llama")
    eng = LLMEngine(model, CFG)
    try:
        w = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(w, SpilledWeight)
        assert w.shape == (w.shape[0], model.config.hidden_size) and w.dtype == torch.float32
        for read in (
            lambda: w.sum(),
            lambda: w + 1,
            lambda: w.tolist(),
            lambda: torch.nn.functional.linear(torch.ones(1, w.shape[1]), w),
            lambda: model.state_dict(),
            lambda: model.to(torch.float64),
            lambda: w.data,
            lambda: w.clone(),
        ):
            with pytest.raises(SpilledWeightError, match=r"layers\.0\.self_attn\.q_proj\.weight.*close\(\)"):
                read()
        assert "spilled" in repr(w)
        # The engine still serves after those errors.
        h = eng.submit(random_prompts([4])[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(h.result(timeout=600).output_token_ids) == 3
    finally:
        eng.close()
    assert type(model.model.layers[0].self_attn.q_proj.weight) is torch.nn.Parameter
    model.state_dict()  # readable again


@pytest.mark.timeout(1500)
def test_two_engines_on_two_models_side_by_side_restore_their_own_weights():
    a, b = build_model("llama"), build_model("qwen2")
    before_a, before_b = _params(a), _params(b)
    ea = LLMEngine(a, CFG)
    try:
        eb = LLMEngine(b, CFG)
        try:
            assert ea.patches.weight_spill.dir != eb.patches.weight_spill.dir
            for eng in (ea, eb):
                h = eng.submit(random_prompts([6])[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
                assert len(h.result(timeout=600).output_token_ids) == 4
        finally:
            eb.close()
        _assert_restored(b, before_b)
        assert isinstance(a.model.layers[0].mlp.up_proj.weight, SpilledWeight)  # a's engine still open
    finally:
        ea.close()
    _assert_restored(a, before_a)


@pytest.mark.timeout(1500)
def test_an_error_during_setup_leaves_the_model_intact(monkeypatch):
    import hf_contbatch.engine.model_patches as patches

    model = build_model("llama")
    before = _params(model)

    def broken(model):
        raise RuntimeError("attention switch failed (test)")

    monkeypatch.setattr(patches, "switch_to_paged_attention", broken)  # after the spill, before serving
    with pytest.raises(RuntimeError, match="attention switch failed"):
        LLMEngine(model, CFG)
    _assert_restored(model, before)
    assert not any(isinstance(p, SpilledWeight) for p in model.parameters())


def test_a_failed_write_spills_nothing(monkeypatch, tmp_path):
    import safetensors.torch

    from hf_contbatch.kernels.linears.weight_spill import WeightSpill

    model = build_model("llama")
    before = _params(model)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match="No space"):
        WeightSpill(model, [m for m in model.modules() if isinstance(m, torch.nn.Linear)])
    _assert_restored(model, before)


def test_an_engine_collected_without_close_gives_the_weights_back(monkeypatch, tmp_path):
    """``del engine; gc.collect()`` with no ``close()``: the float weights are back, bit for bit
    (clones taken before the engine), and the spill directory is gone."""
    import gc
    import weakref

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the spill directory goes
    model = build_model("llama")
    before = _params(model)
    eng = LLMEngine(model, CFG)
    assert eng.patches.weight_spill.num_weights > 0 and os.listdir(tmp_path)
    h = eng.submit(random_prompts([5])[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(h.result(timeout=120).output_token_ids) == 4
    gone = weakref.ref(eng)
    del eng, h
    gc.collect()
    assert gone() is None  # neither the engine's thread nor the finalizer kept it alive
    _assert_restored(model, before)
    assert all(torch.equal(before[n][0], v) for n, v in model.state_dict().items() if n in before)
    assert os.listdir(tmp_path) == []


_EXIT_WITHOUT_CLOSE = """
import sys
sys.path.insert(0, sys.argv[1])
from conftest import build_model, random_prompts
from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
model = build_model("llama")
engine = LLMEngine(model, EngineConfig(quantization="int8", cache=CacheConfig(num_blocks=64, block_size=4)))
assert engine.patches.weight_spill.num_weights > 0
h = engine.submit(random_prompts([5])[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
assert len(h.result(timeout=120).output_token_ids) == 4
print("served")
# No close(): the interpreter exits with the engine alive (a module global).
"""


@pytest.mark.timeout(300)
def test_interpreter_exit_without_close_leaves_no_spilled_weights_on_disk(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.path.dirname(tests)}
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, tests], env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0 and "served" in done.stdout, done.stderr[-2000:]
    assert [n for n in os.listdir(tmp_path) if n.startswith("hf_contbatch_spill_")] == []
