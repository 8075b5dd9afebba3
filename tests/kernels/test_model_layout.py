"""One walk of the model as a value (``kernels.model_layout.ModelLayout``): its attention layers'
kinds and windows are the ones transformers' own forward passes to the attention function, and an
engine walks its model once for patching, quantizing and fusing."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine
from hf_contbatch.kernels import model_layout
from hf_contbatch.kernels.model_layout import ModelLayout

from conftest import build_model


def _windows_passed_by_the_forward(model) -> dict[int, object]:
    """``{layer_idx: sliding_window}`` as the model's own forward passes them to its attention
    function (the independent reference for the layout's kinds)."""
    seen: dict[int, object] = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = kwargs.get("sliding_window")
        return query.transpose(1, 2).contiguous(), None  # the shape attention returns; values unused

    AttentionInterface.register("hf_contbatch_test_recording", recording)
    previous = model.config._attn_implementation
    model.set_attn_implementation("hf_contbatch_test_recording")
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4]]))
    finally:
        model.set_attn_implementation(previous)
    return seen


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2"])
def test_each_attention_layer_s_kind_and_window_are_what_the_forward_passes(family):
    model = build_model(family)
    layout = ModelLayout.of(model)
    passed = _windows_passed_by_the_forward(model)
    assert [a.index for a in layout.attention] == sorted(passed) == list(range(model.config.num_hidden_layers))
    for layer in layout.attention:
        window = passed[layer.index]
        assert layer.sliding_window == window, (family, layer)
        assert layer.kind == ("sliding_attention" if window is not None else "full_attention")
        assert layer.module is model.get_submodule(layer.name)
    assert layout.layer_kinds == tuple(a.kind for a in layout.attention)


def test_the_walk_lists_every_linear_and_norm_once_in_module_order():
    model = build_model("llama")
    layout = ModelLayout.of(model)
    assert [m for _, m in layout.modules] == list(model.modules())
    assert [m for _, m in layout.linears] == [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    # Llama: two norms per decoder layer and the final one.
    assert len(layout.norms) == 2 * model.config.num_hidden_layers + 1
    assert all(type(m).__name__ == "LlamaRMSNorm" for _, m in layout.norms)


def test_an_engine_walks_its_model_once_for_patching_quantizing_and_fusing(monkeypatch):
    model = build_model("llama")
    walks = []
    real = ModelLayout.of.__func__

    def counting(cls, m):
        walks.append(m)
        return real(cls, m)

    monkeypatch.setattr(model_layout.ModelLayout, "of", classmethod(counting))
    engine = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32), quantization="int8"))
    try:
        assert walks == [model] and engine.patches.layout.linears
    finally:
        engine.close()
