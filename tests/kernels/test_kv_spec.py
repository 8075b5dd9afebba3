"""KVCacheSpec: shapes and bytes of one block, worked out by hand."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch.kernels.kv_spec import KVCacheGroup, KVCacheSpec


def test_a_float_block_holds_k_and_v_of_every_layer():
    spec = KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    # one layer: 16 tokens x 2 heads x 64 channels x 4 bytes = 8192 bytes each for K and V
    assert spec.layer_bytes_per_block == 16384
    assert spec.bytes_per_block == 3 * 16384
    assert spec.layer_shape(10) == (10, 16, 2, 64)
    assert spec.scale_shape(10) is None and not spec.is_quantized


def test_half_precision_halves_the_bytes():
    spec = KVCacheSpec(num_layers=32, block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    # Llama-3-8B-like: 2 (K, V) x 32 layers x 16 tokens x 8 heads x 128 channels x 2 bytes = 2 MiB
    assert spec.bytes_per_block == 2 * 2**20


def test_a_quantized_layout_counts_its_scales():
    spec = KVCacheSpec(
        num_layers=2,
        block_size=16,
        num_kv_heads=4,
        head_size=128,
        dtype=torch.int8,
        scale_dtype=torch.float16,
        scales_per_token_head=1,
    )
    # per layer and tensor: 16 x 4 x 128 x 1 byte data + 16 x 4 x 1 x 2 bytes of scales = 8192 + 128
    assert spec.layer_bytes_per_block == 2 * (8192 + 128)
    assert spec.bytes_per_block == 2 * 2 * (8192 + 128)
    assert spec.scale_shape(5) == (5, 16, 4, 1) and spec.is_quantized


@pytest.mark.parametrize(
    "kwargs",
    [dict(block_size=0), dict(scale_dtype=torch.float16), dict(scales_per_token_head=2), dict(sliding_window=0)],
)
def test_inconsistent_specs_are_rejected(kwargs):
    base = dict(num_layers=1, block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    with pytest.raises(ValueError):
        KVCacheSpec(**{**base, **kwargs})


def test_the_spec_is_a_value():
    a = KVCacheSpec(2, 4, 2, 16, torch.float32)
    assert a == KVCacheSpec(2, 4, 2, 16, torch.float32) and hash(a) == hash(KVCacheSpec(2, 4, 2, 16, torch.float32))
    with pytest.raises(AttributeError):
        a.block_size = 8


def test_a_sliding_window_spec_adds_one_null_block_and_keeps_the_block_size_in_bytes():
    full = KVCacheSpec(2, 4, 2, 16, torch.float32)
    sliding = KVCacheSpec(2, 4, 2, 16, torch.float32, sliding_window=8)
    assert (full.num_null_blocks, sliding.num_null_blocks) == (0, 1)
    assert sliding.bytes_per_block == full.bytes_per_block == 2 * 2 * 4 * 2 * 16 * 4


def test_a_group_holds_as_many_layers_as_its_spec():
    spec = KVCacheSpec(2, 4, 2, 16, torch.float32, sliding_window=8)
    group = KVCacheGroup(group_id=0, layers=(0, 1), spec=spec)
    assert group.spec.sliding_window == 8
    with pytest.raises(ValueError, match="3 layers but a spec of 2"):
        KVCacheGroup(group_id=0, layers=(0, 1, 2), spec=spec)
    with pytest.raises(ValueError):
        KVCacheGroup(group_id=0, layers=(), spec=spec)
