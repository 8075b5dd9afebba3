"""``quantization="w8a8"`` (int8 weights and per-row int8 activations: ours, ``int8_gemm.W8A8GEMM``,
and torch's, ``w8a8_torch.TorchW8A8GEMM``): greedy tokens equal transformers' ``generate`` on a
plain-torch copy whose linears quantize both their weight (per output channel) and their input (per
row) symmetrically to int8, as the scheme says, whichever kernel serves."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.config import quant_scheme
from hf_contbatch.kernels.linears.registry import W8A8_KERNELS, available_quantized_kernels

from conftest import build_model, random_prompts, reference_greedy

pytestmark = pytest.mark.timeout(1500)
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


def test_w8a8_is_a_quantization_with_its_own_kernels_and_bad_names_are_refused():
    assert (
        set(available_quantized_kernels(quant_scheme("w8a8")))
        <= set(W8A8_KERNELS)
        == {"w8a8", "intmm-w8a8", "torch-w8a8", "widen-w8a8"}
    )
    assert not set(W8A8_KERNELS) & set(
        available_quantized_kernels(quant_scheme("int8"))
    )  # weight-only "auto" never rounds x
    with pytest.raises(ValueError, match=r"`quantization` must be None or one of \('int8', 'w8a8'\), got 'w8a9'"):
        EngineConfig(quantization="w8a9")
    with pytest.raises(ValueError, match="`linear_backend` must be one of"):
        EngineConfig(linear_backend="w8a8")  # a scheme, not a kernel: quantization="w8a8"
    with pytest.raises(ValueError, match="`linear_backend='onednn'` has no w8a8 kernel"):
        EngineConfig(quantization="w8a8", linear_backend="onednn")


@pytest.mark.parametrize(
    "family,backend,kernels",
    [
        ("llama", "native", ("w8a8",)),
        ("qwen2", "native", ("w8a8",)),  # qwen2: q/k/v with a bias
        ("llama", "torch", ("torch-w8a8",)),
        ("qwen2", "auto", None),  # the timed choice per shape: either or both
    ],
)
def test_w8a8_greedy_equals_generate_on_the_fake_quantized_model(family, backend, kernels):
    model = build_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = random_prompts([1, 5, 17, 33, 9], seed=2)
    ref = _w8a8_copy(model)
    refs = [reference_greedy(ref, p, NEW) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=40),
        scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16),  # chunked prefill, preemption
        quantization="w8a8",
        linear_backend=backend,
    )
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in prompts]
        outs = [h.result(timeout=1200).output_token_ids for h in handles]
        names = eng.packed_linears.kernel_names
        assert names == kernels if kernels else set(names) <= set(W8A8_KERNELS)
        assert eng.patches.weight_format == "w8a8"
        assert eng.wait_idle(10)
        stats = eng.stats()
        assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"
    finally:
        eng.close()
    assert outs == refs
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_our_w8a8_kernel_runs_in_a_compiled_graph_as_an_opaque_op():
    """Traced by torch.compile (as ``compile_model=True`` does), the C kernel is called as
    ``torch.ops.hf_contbatch.w8a8_linear`` on real tensors, never through ctypes on traced ones (that
    crashed the process): the compiled result equals the eager one bit for bit."""
    from hf_contbatch.kernels.linears.int8_gemm import W8A8GEMM

    kernel = W8A8GEMM()
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    packed = kernel.pack(w)

    def f(x):
        return kernel.linear_verified(x, packed, kernel.step_bias(b), 48) * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    for rows in (3, 7):
        x = torch.randn(rows, 40, generator=g)
        assert torch.equal(compiled(x), f(x))
