"""The Triton backends per layer: a layer whose pools the kernels serve runs them, a layer they lack
(V heads of another size than K heads, a head size without tiles) steps aside to the torch path on
the same pools; both against the naive reference. On CPU the kernels run under Triton's interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_torch_attention, test_int8_kv
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reference_attention

pytest.importorskip("triton")

from test_int8_kv import reference_dequantized  # noqa: E402
from test_torch_attention import _batch, reference_for  # noqa: E402

from hf_contbatch.kernels.attention.backends import (  # noqa: E402
    Int8TritonAttentionBackend,
    TritonAttentionBackend,
)

from conftest import load_family_sweep  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] not in ("", "0")
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


def _layer(v_dim, seed):
    """A small mixed decode/prefill batch with 16-channel K heads and ``v_dim``-channel V heads;
    the pools hold random float K/V at every slot, the metadata's slot mapping covers them all."""
    query, k_float, _, meta = _batch([3, 9], [(4, 4), (2, 19)], block_size=8, kvh=2, heads=4, dim=16, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    v_float = torch.randn(*k_float.shape[:3], v_dim, generator=g)
    meta.slot_mapping = torch.arange(k_float.shape[0] * k_float.shape[1])
    return query, k_float, v_float, meta


def _on_device(meta):
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return meta


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("v_dim", [16, 8])
def test_triton_backend_serves_a_layer_or_steps_aside_for_it(v_dim):
    query, k_float, v_float, meta = _layer(v_dim, seed=v_dim)
    backend = TritonAttentionBackend()
    k_pool = torch.zeros(k_float.shape, device=DEVICE)
    v_pool = torch.zeros(v_float.shape, device=DEVICE)
    dev_meta = _on_device(meta)
    kvh = k_float.shape[2]
    key = k_float.reshape(-1, kvh, 16).to(DEVICE)
    value = v_float.reshape(-1, kvh, v_dim).to(DEVICE)
    backend.store_kv(key, value, k_pool, v_pool, dev_meta)
    assert torch.equal(k_pool.cpu(), k_float) and torch.equal(v_pool.cpu(), v_float)
    # 16 and 16: the kernels' own shape; 16 and 8: the kernels read one head size, so the torch path.
    assert backend.serves_layer(16, k_pool, v_pool, 4) == (v_dim == 16)
    got = backend.attend(query.to(DEVICE), k_pool, v_pool, dev_meta, 0.25, sliding_window=6)
    want = reference_for(query, k_float, v_float, _layer(v_dim, seed=v_dim)[3], 0.25, sliding_window=6)
    assert got.shape == (query.shape[0], 4, v_dim)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(1500)
def test_int8_triton_backend_steps_aside_for_v_heads_of_their_own_size():
    query, k_float, v_float, meta = _layer(8, seed=5)
    backend = Int8TritonAttentionBackend()
    nb, bs, kvh, _ = k_float.shape
    k_pool = torch.zeros(k_float.shape, dtype=torch.int8, device=DEVICE)
    v_pool = torch.zeros(v_float.shape, dtype=torch.int8, device=DEVICE)
    k_scale = torch.zeros(nb, bs, kvh, 1, device=DEVICE)
    v_scale = torch.zeros(nb, bs, kvh, 1, device=DEVICE)
    dev_meta = _on_device(meta)
    key, value = k_float.reshape(-1, kvh, 16).to(DEVICE), v_float.reshape(-1, kvh, 8).to(DEVICE)
    backend.store_kv(key, value, k_pool, v_pool, dev_meta, k_scale=k_scale, v_scale=v_scale)
    got = backend.attend(query.to(DEVICE), k_pool, v_pool, dev_meta, 0.25, k_scale=k_scale, v_scale=v_scale)
    want = reference_for(query, reference_dequantized(k_float), reference_dequantized(v_float), _layer(8, 5)[3], 0.25)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma4_text", "mimo_v2_flash"])
def test_triton_engine_serves_latent_per_layer_and_sink_layers_exactly(model_type):
    """A Triton engine never refuses these models: latent layers store their latents (K and V of
    other sizes) through the torch path and attend over the expanded contexts, Gemma 4's 512-channel
    global layers and MiMo's sink layers step aside to the torch path; the rest run the kernels."""

    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

    from conftest import reference_greedy

    family_sweep = load_family_sweep()
    model = family_sweep.build_tiny(model_type)
    prompts = family_sweep.prompts()
    refs = [reference_greedy(model, p, 6) for p in prompts]
    cfg = EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=8),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2),
        attention_backend="triton",
    )
    eng = LLMEngine(model, cfg)
    try:
        assert eng.backend.name == "triton"
        handles = [eng.submit(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts]
        outs = [h.result(1200).output_token_ids for h in handles]
        assert eng.wait_idle(10)
        assert eng.stats().num_free_blocks == 8
    finally:
        eng.close()
    assert outs == refs


def test_triton_is_not_refused_for_a_model_whose_layers_are_all_latent():
    """DeepSeek V3's real latents (512-channel K, 64-channel V: no Triton tile has 512) are stored
    and read by the torch path in every layer, so asking for Triton checks no head size."""
    from hf_contbatch.kernels.attention.backends import select_backend
    from hf_contbatch.kernels.kv_spec import KVCacheSpec, KVLayerShape

    spec = KVCacheSpec.for_layers([KVLayerShape(1, 512, 64, latent=True)] * 3, block_size=16, dtype=torch.float32)
    backend = select_backend("triton", DEVICE, spec, num_heads=128)
    assert backend.name == "triton"
