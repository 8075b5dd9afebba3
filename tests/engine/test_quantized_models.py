"""Quantized serving: ``EngineConfig(quantization="int8")`` gives transformers' greedy tokens on
the same weights quantized and dequantized in plain torch, and models quantized by transformers'
own ``TorchAoConfig`` are served (never a crash) with the tokens of their own ``generate``."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig
from hf_contbatch.kernels.linears.registry import INT8_KERNELS

from conftest import build_model, random_prompts, reference_greedy, serve_greedy

NEW = 12
LENGTHS = [1, 5, 17, 33, 40, 9]


def dequantized_copy(model):
    """A copy whose every nn.Linear weight is replaced by ``Wq * s`` (plain torch, per output
    channel, symmetric, s = absmax / 127): the reference the int8 engine must equal. A tied LM head
    is untied first so the embedding keeps its float values."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                w = m.weight.detach()
                s = w.abs().amax(1, keepdim=True) / 127
                q = torch.where(s > 0, w / s, 0.0)  # a zero row (a padding token's embedding) stays zero
                m.weight = torch.nn.Parameter(q.round().clamp(-127, 127) * s)
    return ref


def _serve(model, prompts, cfg):
    """Greedy tokens (no block leaked), the packed linears (collection, count, modules) and the weight format."""
    seen = {}

    def read_linears(engine):
        packed = engine.packed_linears
        # (modules and count read while open: close() empties the collection)
        seen["info"] = None if packed is None else (packed, len(packed), list(packed.modules))
        seen["format"] = engine.patches.weight_format

    outs, _ = serve_greedy(model, prompts, cfg, NEW, check=read_linears, timeout=600)
    return outs, seen["info"], seen["format"]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("family,backend", [("llama", "auto"), ("qwen2", "native"), ("gemma", "torch")])
def test_int8_greedy_equals_generate_on_dequantized_weights(family, backend):
    model = build_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = random_prompts(LENGTHS)
    ref = dequantized_copy(model)
    refs = [reference_greedy(ref, p, NEW) for p in prompts]
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64), quantization="int8", linear_backend=backend)
    outs, (packed, count, _), fmt = _serve(model, prompts, cfg)
    assert outs == refs
    assert fmt == "int8" and packed.quantization == "int8"
    assert set(packed.kernel_names) <= set(INT8_KERNELS)  # int8 kernels only, never a float one
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert count == n_linear  # every decoder linear and the LM head
    # close() restored the model exactly (the tied embedding included).
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.timeout(1500)
def test_int8_under_preemption_and_chunked_prefill():
    model = build_model("llama")
    prompts = random_prompts(LENGTHS + [64], seed=3)
    refs = [reference_greedy(dequantized_copy(model), p, NEW) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=22),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),
        quantization="int8",
    )
    outs, _, _ = _serve(model, prompts, cfg)
    assert outs == refs


def test_bad_quantization_names_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"`quantization` must be None or one of \('int8', 'w8a8'\), got 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="onednn"):
        EngineConfig(quantization="int8", linear_backend="onednn")


def test_int8_on_cuda_is_refused_by_name():
    from hf_contbatch.engine.model_patches import check_quantization_device

    int8 = EngineConfig(quantization="int8").quant_scheme
    with pytest.raises(ValueError, match=r"quantization='int8'.*CPU models only.*cuda"):
        check_quantization_device(int8, "cuda")
    check_quantization_device(None, "cuda")  # a torchao model on CUDA runs its own kernels
    check_quantization_device(int8, "cpu")


class _Broken(torch.Tensor):
    """A quantizer's weight type whose own linear cannot run."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            raise NotImplementedError("no CPU kernel for this format")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.timeout(600)
def test_a_quantized_weight_that_cannot_run_is_refused_by_name_at_construction():
    model = build_model("llama")
    proj = model.model.layers[0].mlp.down_proj
    original = proj.weight
    proj.weight = torch.nn.Parameter(original.detach().clone().as_subclass(_Broken), requires_grad=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj.*_Broken"):
        LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=16)))
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing changed


torchao = pytest.importorskip("torchao", reason="the quant extra (torchao) is not installed")


def _torchao_model(tmp_path, config):
    import transformers

    build_model("llama").save_pretrained(tmp_path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        dtype=torch.float32,
        device_map="cpu",
        quantization_config=transformers.TorchAoConfig(config),
    )


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_torchao_int8_weight_only_model_is_served_as_its_own_generate(tmp_path, backend):
    from torchao.quantization import Int8WeightOnlyConfig

    model = _torchao_model(tmp_path, Int8WeightOnlyConfig())
    prompts = random_prompts(LENGTHS)
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, packed, fmt = _serve(
        model, prompts, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64), linear_backend=backend)
    )
    assert outs == refs
    assert fmt == "torchao Int8Tensor"
    if backend == "torch":
        assert packed is None  # their own F.linear
    else:  # repacked exactly into our int8 kernels
        assert packed is not None and packed[0].quantization == "int8"
        assert any(type(m.weight).__name__ == "Int8Tensor" for m in packed[2])


@pytest.mark.timeout(1500)
def test_torchao_int8_dynamic_activation_model_runs_its_own_linear(tmp_path):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    model = _torchao_model(tmp_path, Int8DynamicActivationInt8WeightConfig())
    prompts = random_prompts(LENGTHS[:3])
    refs = [reference_greedy(model, p, NEW) for p in prompts]
    outs, packed, _ = _serve(model, prompts, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    assert outs == refs
    # activation-quantized weights are never repacked into a weight-only kernel
    assert packed is None or not any(type(m.weight).__name__ == "Int8Tensor" for m in packed[2])


@pytest.mark.timeout(1500)
def test_torchao_model_with_int8_quantization_repacks_exactly(tmp_path):
    from torchao.quantization import Int8WeightOnlyConfig

    model = _torchao_model(tmp_path, Int8WeightOnlyConfig())
    # The reference: torchao's linears as they are, the ones it left float (the LM head)
    # quantized and dequantized in plain torch.
    ref = _torchao_model(tmp_path, Int8WeightOnlyConfig())
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear) and type(m.weight) is torch.nn.Parameter:
                w = m.weight.detach()
                s = w.abs().amax(1, keepdim=True) / 127
                m.weight = torch.nn.Parameter(torch.where(s > 0, w / s, 0.0).round().clamp(-127, 127) * s)
    prompts = random_prompts(LENGTHS[:3])
    refs = [reference_greedy(ref, p, NEW) for p in prompts]
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64), quantization="int8")
    outs, packed, _ = _serve(model, prompts, cfg)
    assert outs == refs
    assert packed[1] == sum(isinstance(m, torch.nn.Linear) for m in model.modules())


@pytest.mark.timeout(1500)
def test_pipeline_spells_quantization_as_an_argument():
    from transformers import AutoTokenizer

    from hf_contbatch import pipeline
    from hf_contbatch.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    model = build_model("llama")
    with pipeline("text-generation", model=model, tokenizer=tok, quantization="int8") as pipe:
        assert pipe.engine.patches.weight_format == "int8"
        assert pipe.engine.packed_linears.quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        pipeline("text-generation", model=model, tokenizer=tok, quantization="int3")
