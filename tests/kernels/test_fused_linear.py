"""Fused sibling projections (``EngineConfig.fuse_linears``): bit-identical to the separate packed
linears, any call order correct, weight changes followed, undone by restore."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_contbatch.kernels.linears import onednn_available, pack_linears

from conftest import build_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_forward_equals_separate_packed_bit_for_bit(family):
    model = build_model(family)
    ids = torch.randint(1, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    plain = _logits(model, ids)
    packed = pack_linears(model, "onednn")
    separate = _logits(model, ids)
    packed.restore()
    packed = pack_linears(model, "onednn", fuse=True)
    groups = len({id(f.group) for f in packed.forwards if f.group is not None})
    assert groups == 2 * model.config.num_hidden_layers  # q/k/v and gate/up in every layer
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    torch.ops.mkldnn._linear_pointwise = counting
    try:
        fused = _logits(model, ids)
    finally:
        torch.ops.mkldnn._linear_pointwise = real
    # Per layer: qkv, o_proj, gate/up, down_proj; plus the LM head.
    assert len(calls) == 4 * model.config.num_hidden_layers + 1
    assert torch.equal(fused, separate)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    packed.restore()
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(_logits(model, ids), plain)


@pytest.mark.timeout(600)
def test_any_call_order_and_weight_changes_are_followed():
    model = build_model("llama")
    attn = model.model.layers[0].self_attn
    packed = pack_linears(model, "onednn", fuse=True)
    x = torch.randn(5, attn.q_proj.in_features)
    y = torch.randn(5, attn.q_proj.in_features)

    def ref(m, inp):
        return torch.nn.functional.linear(inp, m.weight, m.bias)

    with torch.inference_mode():
        # A follower before its leader, and a follower on another input than the leader's.
        torch.testing.assert_close(attn.k_proj(x), ref(attn.k_proj, x))
        attn.q_proj(x)
        torch.testing.assert_close(attn.v_proj(y), ref(attn.v_proj, y))
        torch.testing.assert_close(attn.k_proj(x), ref(attn.k_proj, x))
        torch.testing.assert_close(attn.k_proj(x), ref(attn.k_proj, x))  # taken once, then computed
    with torch.no_grad():
        attn.v_proj.weight.mul_(2.0)  # in place: the fused weight must be repacked
    with torch.inference_mode():
        attn.q_proj(x)
        torch.testing.assert_close(attn.v_proj(x), ref(attn.v_proj, x))
    clone = copy.deepcopy(model)  # no opaque tensor copied; the clone repacks its own
    with torch.inference_mode():
        cattn = clone.model.layers[0].self_attn
        cattn.q_proj(x)
        torch.testing.assert_close(cattn.v_proj(x), ref(attn.v_proj, x))
    packed.restore()
