"""Quantization as one typed value: each user-facing name decodes once, in the config, to the
:class:`~hf_contbatch.config.QuantScheme` the patches and kernels read; bad names are refused
with the messages users see."""

from __future__ import annotations

import dataclasses

import pytest

from hf_contbatch.config import (
    KV_CACHE_DTYPES,
    KV_QUANT_SCHEMES,
    QUANTIZATIONS,
    TORCHAO_INT8,
    CacheConfig,
    EngineConfig,
    QuantScheme,
    quant_scheme,
)

# name -> (weight dtype, activation dtype, group size, quantize float weights, label). The schemes
# as documented for users (EngineConfig.quantization): "int8" is torchao's Int8WeightOnlyConfig
# (int8 weights, one scale per output channel, activations as they are), "w8a8" its
# Int8DynamicActivationInt8WeightConfig (int8 activations per row too).
TABLE = {
    "int8": ("int8", None, None, True, "int8"),
    "w8a8": ("int8", "int8", None, True, "w8a8"),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_accepted_name_decodes_to_its_fields(name):
    scheme = quant_scheme(name)
    fields = (scheme.weight_dtype, scheme.activation_dtype, scheme.group_size, scheme.quantize_float_weights)
    assert (*fields, scheme.label) == TABLE[name] and scheme.name == name
    cfg = EngineConfig(quantization=name)
    assert cfg.quantization == name and cfg.quant_scheme == scheme  # the user's name kept, decoded once
    with pytest.raises(dataclasses.FrozenInstanceError):
        scheme.activation_dtype = "int4"


def test_the_table_covers_every_user_facing_name_and_none_decodes_to_none():
    assert set(TABLE) == set(QUANTIZATIONS)
    assert quant_scheme(None) is None and EngineConfig().quant_scheme is None
    # dataclasses.replace re-decodes (the pipeline's quantization= argument takes this path)
    assert dataclasses.replace(EngineConfig(), quantization="w8a8").quant_scheme == quant_scheme("w8a8")


def test_a_torchao_model_s_own_int8_linears_are_weight_only_int8_without_quantizing_floats():
    assert TORCHAO_INT8.label == "int8" and TORCHAO_INT8.activation_dtype is None
    assert not TORCHAO_INT8.quantize_float_weights and TORCHAO_INT8.name not in QUANTIZATIONS


@pytest.mark.parametrize("bad", ["int3", "W8A8", "", 8, QuantScheme("int8")])
def test_bad_names_are_refused_with_the_allowed_ones(bad):
    with pytest.raises(ValueError, match=r"^`quantization` must be None or one of \('int8', 'w8a8'\), got "):
        EngineConfig(quantization=bad)
    with pytest.raises(ValueError, match=r"^`quantization` must be one of \('int8', 'w8a8'\), got None$"):
        quant_scheme(None, allow_none=False)
    with pytest.raises(ValueError, match=r"^`linear_backend='onednn'` has no int8 kernel"):
        EngineConfig(quantization="int8", linear_backend="onednn")


def test_a_quantized_kv_cache_dtype_decodes_to_its_layout_and_float_ones_to_none():
    # CacheConfig.dtype="int8" as documented: int8 K/V, one float32 scale per token and KV head each.
    kv = CacheConfig(dtype="int8").kv_quant
    assert (kv.name, kv.dtype, kv.scale_dtype, kv.scales_per_token_head) == ("int8", "int8", "float32", 1)
    assert set(KV_QUANT_SCHEMES) == {d for d in KV_CACHE_DTYPES if d and not d.startswith(("float", "bfloat"))}
    for dtype in (None, "float32", "float16", "bfloat16"):
        assert CacheConfig(dtype=dtype).kv_quant is None
    with pytest.raises(ValueError, match=r"^`dtype` must be one of \(None, 'float32', 'float16', 'bfloat16', 'int8'\)"):
        CacheConfig(dtype="int4")
