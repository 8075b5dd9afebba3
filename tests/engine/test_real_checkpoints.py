"""Checkpoints as users load them, not models built in memory: half-precision weights saved with
``save_pretrained`` and loaded with ``dtype="auto"``, a ``trust_remote_code`` model whose modeling
file uses ``AttentionInterface``, and a GPTQ checkpoint.

What is exact and what is not, for a float16 or bfloat16 checkpoint:

- in float32 after loading (``.float()``: every half value is a float32 value, so the model is the
  checkpoint's weights, widened without rounding) the engine's greedy tokens equal ``generate``'s
  token for token, as for any float32 model;
- in its own dtype the engine and ``generate`` both round each op's result to 8 (bfloat16) or 11
  (float16) bits of mantissa, but in different places (the engine's GEMMs and attention
  accumulate in float32 and round once; transformers' ops round as torch's half kernels do), so a
  near tie may go either way: each greedy token is checked to be the argmax of the model's own
  forward in that dtype or within that dtype's rounding of it (the tolerance test of
  ``tests/kernels/test_bf16.py``, against the loaded checkpoint).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from hf_contbatch import CacheConfig, EngineConfig, SchedulerConfig

from conftest import build_model, random_prompts, reference_greedy, serve_greedy

NEW = 12
LENGTHS = (5, 23)
REMOTE_MODELING = Path(__file__).resolve().parents[1] / "data" / "modeling_walk_remote.py"


def _serve(model, prompts, num_blocks=32, block_size=16):
    """Greedy tokens of ``model`` for ``prompts``, and the engine's preemption count; checks no KV
    block leaked."""
    cfg = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks), scheduler=SchedulerConfig(max_num_seqs=4)
    )
    outs, stats = serve_greedy(model, prompts, cfg, NEW)
    return outs, stats.num_preemptions


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def half_checkpoint(request, tmp_path_factory):
    """(path, dtype): a tiny Llama saved with ``save_pretrained`` in that dtype."""
    dtype = getattr(torch, request.param)
    path = tmp_path_factory.mktemp(f"llama-{request.param}")
    build_model("llama").to(dtype).save_pretrained(path)
    return path, dtype


@pytest.mark.timeout(300)
def test_half_checkpoint_loaded_with_dtype_auto_and_widened_is_served_exactly(half_checkpoint):
    path, dtype = half_checkpoint
    assert json.loads((path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    assert loaded.dtype == dtype
    model = loaded.float()  # widening is exact: the served weights are the checkpoint's values
    prompts = random_prompts(LENGTHS)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, _ = _serve(model, prompts)
    assert outs == refs


@pytest.mark.timeout(300)
def test_half_checkpoint_in_its_own_dtype_picks_the_argmax_within_its_rounding(half_checkpoint):
    path, dtype = half_checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    assert model.dtype == dtype
    prompts = random_prompts(LENGTHS)
    outs, _ = _serve(model, prompts)
    assert all(len(o) == NEW for o in outs)
    worst = 0.0
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + out])).logits[0].float(), -1)
        for t, tok in enumerate(out):
            row = logp[len(p) - 1 + t]
            worst = max(worst, float(row.max() - row[tok]))
    # bfloat16 keeps 8 bits of mantissa: logits of order 1 move by ~1e-2 through a few layers (the
    # bound tests/kernels/test_bf16.py uses); float16 keeps 11, eight times finer.
    assert worst < (0.15 if dtype == torch.bfloat16 else 0.02), worst


@pytest.fixture(scope="module")
def remote_checkpoint(tmp_path_factory):
    """A checkpoint directory whose config.json maps AutoConfig and AutoModelForCausalLM to classes of
    its own modeling file (``tests/data/modeling_walk_remote.py``), with seeded random weights."""
    path = tmp_path_factory.mktemp("remote")
    shutil.copy(REMOTE_MODELING, path / "modeling_walk_remote.py")
    auto_map = {
        "AutoConfig": "modeling_walk_remote.WalkRemoteConfig",
        "AutoModelForCausalLM": "modeling_walk_remote.WalkRemoteForCausalLM",
    }
    (path / "config.json").write_text(
        json.dumps({"model_type": "walk_remote", "auto_map": auto_map, "architectures": ["WalkRemoteForCausalLM"]})
    )
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32)
    model.save_pretrained(path)  # weights and the full config; the modeling file stays beside them
    return path


@pytest.mark.timeout(300)
def test_trust_remote_code_model_using_the_interface_is_served_exactly(remote_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(remote_checkpoint, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("transformers_modules.")  # the checkpoint's own code
    assert type(model).__name__ == "WalkRemoteForCausalLM"
    prompts = random_prompts((5, 23, 40, 9), vocab=256)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    # 24 blocks of 4 tokens for four requests of 17-52 tokens: recompute preemption on the way.
    outs, preemptions = _serve(model, prompts, num_blocks=24, block_size=4)
    assert outs == refs
    assert preemptions > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "quantization_config, library",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}, "optimum"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}, "gptqmodel"),
    ],
)
def test_gptq_or_awq_checkpoint_without_its_kernel_library_fails_in_transformers_naming_it(
    tmp_path, quantization_config, library
):
    """A GPTQ or AWQ checkpoint (config.json's ``quantization_config``) needs optimum and gptqmodel,
    which this environment does not install (gptqmodel builds kernels of its own, a heavy install
    for CI). transformers refuses to load it, naming the library, before any weight is read: there
    is no model object for the engine to serve or refuse. (Once one loads, its quantized linears
    are not ``nn.Linear``: the engine leaves them unpacked, or refuses one that cannot run by name,
    ``tests/engine/test_quantized_models.py``.)"""
    build_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ImportError, match=f"requires {library}"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not transformers.utils.is_gptqmodel_available()
