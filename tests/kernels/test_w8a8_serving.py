"""``linear_backend="w8a8"`` (int8 weights and per-row int8 activations, ``int8_gemm.W8A8GEMM``):
served only when named, with ``quantization="int8"``; greedy tokens equal transformers' ``generate``
on a plain-torch copy whose linears quantize both their weight (per output channel) and their
input (per row) symmetrically to int8, as the kernel's scheme says."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.kernels.linears import pack_linears
from hf_contbatch.kernels.linears.registry import INT8_KERNELS, available_int8_kernels

from conftest import build_model, random_prompts, reference_greedy

pytestmark = pytest.mark.timeout(300)
NEW = 10


def _w8a8_copy(model):
    """A copy whose every nn.Linear computes ``(round(x / sx) @ Wq.T) * sx * s + b`` in float64
    (``sx = absmax(row of x) / 127``, ``s = absmax(row of W) / 127``), cast back to float32."""
    ref = copy.deepcopy(model)

    def forward(self, x):
        w = self.weight.detach()
        s = w.abs().amax(1) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        wq = (w / s[:, None]).round().clamp(-127, 127)
        x2 = x.reshape(-1, x.shape[-1])
        amax = x2.abs().amax(1, keepdim=True)
        sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        xq = torch.round(x2 / sx).clamp(-127, 127)
        y = (xq.double() @ wq.double().T) * sx.double() * s.double()
        if self.bias is not None:
            y = y + self.bias.double()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    for m in ref.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = forward.__get__(m)
    return ref


def test_w8a8_is_no_auto_candidate_and_needs_int8_weights():
    assert "w8a8" in INT8_KERNELS and "w8a8" not in available_int8_kernels()
    with pytest.raises(ValueError, match="w8a8.*needs `quantization='int8'`"):
        EngineConfig(linear_backend="w8a8")
    with pytest.raises(ValueError, match="must be one of .*'w8a8'"):
        EngineConfig(linear_backend="w8a9")
    with pytest.raises(ValueError, match="needs quantization='int8'"):
        pack_linears(build_model("llama"), "w8a8")


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
def test_w8a8_greedy_equals_generate_on_the_fake_quantized_model(family):
    model = build_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = random_prompts([1, 5, 17, 33, 9], seed=2)
    ref = _w8a8_copy(model)
    refs = [reference_greedy(ref, p, NEW) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=40),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16),  # chunked prefill, preemption
        quantization="int8",
        linear_backend="w8a8",
    )
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        outs = [h.result(timeout=120).output_token_ids for h in handles]
        assert eng.packed_linears.kernel_names == ("w8a8",)
        assert eng.wait_idle(10)
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    finally:
        eng.close()
    assert outs == refs
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
