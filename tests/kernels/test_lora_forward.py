"""Per-row LoRA (``hf_contbatch.kernels.lora``): the step's row -> adapter groups, and one
LoRA-wrapped linear's per-row forward against PEFT's own mixed-batch forward (each row a batch
entry with its adapter, ``adapter_names`` as PEFT spells it), for plain, rslora, lora_bias and
LM-head rows; outside a step the layer runs PEFT's forward unchanged."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch.kernels.lora import AdapterRows, LoraLayers, find_lora_layers

peft = pytest.importorskip("peft")


def test_rows_are_grouped_by_adapter_as_slices_when_contiguous_and_index_tensors_otherwise():
    rows = AdapterRows.build([("a", 2), (None, 1), ("b", 3), ("a", 1)], logits_rows=[1, 5, 6, 2], device="cpu")
    assert rows.num_rows == 7 and rows.num_logits_rows == 4
    groups = dict(rows.groups)
    assert set(groups) == {"a", "b"}  # base rows (None) are in no group
    assert groups["a"].tolist() == [0, 1, 6]
    assert groups["b"] == slice(3, 6)
    logits = dict(rows.logits_groups)  # rows 1, 5, 6, 2 run a, b, a, base
    assert logits["a"].tolist() == [0, 2] and logits["b"] == slice(1, 2)
    every = AdapterRows.build([("a", 2), ("b", 1)], logits_rows=None, device="cpu")
    assert every.logits_groups == every.groups and every.num_logits_rows == 3


def _lora_model(seed=0):
    """A two-linear model wrapped by PEFT with three adapters: plain, rslora, lora_bias."""
    torch.manual_seed(seed)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 24)
            self.lm_head = torch.nn.Linear(24, 32, bias=False)

        def forward(self, x):
            return self.lm_head(self.proj(x))

        def get_output_embeddings(self):
            return self.lm_head

    base = Tiny()
    targets = ["proj", "lm_head"]
    cfg = dict(target_modules=targets, init_lora_weights=False)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, **cfg), adapter_name="sql")
    pm.add_adapter("chat", peft.LoraConfig(r=8, lora_alpha=4, use_rslora=True, **cfg))
    pm.add_adapter("poem", peft.LoraConfig(r=2, lora_bias=True, target_modules=["proj"], init_lora_weights=False))
    return pm.eval()


@pytest.mark.timeout(300)
def test_per_row_forward_equals_peft_mixed_batch_forward_per_row():
    pm = _lora_model()
    inner = pm.get_base_model()
    names = ["sql", "__base__", "chat", "chat", "poem", "sql", "__base__", "poem"]
    x = torch.randn(len(names), 16)
    with torch.no_grad():  # PEFT: each row its own batch entry, adapter per entry
        want_proj = inner.proj(x[:, None, :], adapter_names=names)[:, 0]
        want_head = inner.lm_head(want_proj[:, None, :], adapter_names=names)[:, 0]
    layers = LoraLayers(find_lora_layers(inner), inner.get_output_embeddings())
    try:
        assert {id(m) for m in layers.modules} == {id(inner.proj), id(inner.lm_head)}
        segments = [(None if n == "__base__" else n, 1) for n in names]
        head_rows = [7, 0, 2, 4]  # the LM head reads a subset of rows, in its own order
        rows = AdapterRows.build(segments, head_rows, "cpu")
        with torch.no_grad(), layers.step(rows):
            got_proj = inner.proj(x[None])[0]
            got_head = inner.lm_head(got_proj[head_rows][None])[0]
        torch.testing.assert_close(got_proj, want_proj, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_head, want_head[head_rows], rtol=1e-5, atol=1e-5)
        for name in ("sql", "chat", "poem"):  # each adapter changes its rows
            i = names.index(name)
            assert not torch.allclose(want_proj[i], inner.proj.base_layer(x[i]))
        with torch.no_grad():  # outside a step: PEFT's own forward, with the active adapter
            pm.set_adapter("chat")
            solo = inner.proj(x)
        torch.testing.assert_close(solo[2:4], want_proj[2:4], rtol=1e-5, atol=1e-5)
    finally:
        layers.restore()
        pm.set_adapter("sql")
    assert not any("forward" in m.__dict__ for m in pm.modules())


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(use_dora=True), "DoraLinearVariant"),
        (dict(target_modules=["embed"]), "LoRA on an embedding"),
        (dict(modules_to_save=["embed"]), "modules_to_save"),
    ],
)
def test_unsupported_peft_features_are_refused_by_name(config, match):
    torch.manual_seed(0)

    class WithEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.proj = torch.nn.Linear(8, 8)

    kwargs = {"target_modules": ["proj"], **config}
    pm = peft.get_peft_model(WithEmbedding(), peft.LoraConfig(r=2, **kwargs))
    with pytest.raises(ValueError, match=match):
        find_lora_layers(pm.get_base_model())


def test_merged_adapters_are_refused_until_unmerged():
    pm = _lora_model()
    pm.merge_adapter()
    with pytest.raises(ValueError, match="unmerge_adapter"):
        find_lora_layers(pm.get_base_model())
    pm.unmerge_adapter()
    assert len(find_lora_layers(pm.get_base_model())) == 2
