"""The Triton kernels over an int8 KV cache (store quantizing on write, decode and prefill attention
dequantizing each tile with its tokens' scales) against the naive float reference run on K/V
quantized and dequantized in plain torch by the scheme's definition; the ahead-of-time compile of
the int8 variants for the real GPU archs. On CPU the kernels run under Triton's interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_int8_kv, test_torch_attention
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reference_attention

pytest.importorskip("triton")

from test_int8_kv import reference_dequantized, reference_quantize  # noqa: E402
from test_torch_attention import _batch, reference_for  # noqa: E402

from hf_contbatch.kernels.attention import triton_kernels as tk  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] not in ("", "0")
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


def _stored(k_float, v_float):
    """Every slot of the float pools stored by ``tk.store_kv`` into new int8 pools with scales."""
    nb, bs, kvh, d = k_float.shape
    k_pool = torch.zeros(nb, bs, kvh, d, dtype=torch.int8, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    k_scale = torch.zeros(nb, bs, kvh, 1, device=DEVICE)
    v_scale = torch.zeros_like(k_scale)
    slots = torch.arange(nb * bs, device=DEVICE)
    key, value = k_float.reshape(-1, kvh, d).to(DEVICE), v_float.reshape(-1, kvh, d).to(DEVICE)
    tk.store_kv(key, value, k_pool, v_pool, slots, k_scale=k_scale, v_scale=v_scale)
    return k_pool, v_pool, k_scale, v_scale


@pytest.mark.timeout(1500)
def test_triton_store_quantizes_each_token_head_by_its_absmax():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 8, 2, 32, generator=g) * torch.rand(3, 8, 2, 1, generator=g) * 10
    v = torch.randn(3, 8, 2, 32, generator=g)
    k[1, 2, 0] = 0
    k_pool, v_pool, k_scale, v_scale = _stored(k, v)
    for got_q, got_s, x in ((k_pool, k_scale, k), (v_pool, v_scale, v)):
        want_q, want_s = reference_quantize(x)
        torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-6, atol=0)
        assert (got_q.cpu().int() - want_q.int()).abs().max() <= 1  # exact ties may round either way


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "decode_lens,prefill", [([1, 9, 40], []), ([3, 17], [(5, 5), (4, 30)])], ids=["decode-only", "mixed"]
)
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (7, 30.0)])
def test_triton_int8_attention_matches_the_reference_on_dequantized_kv(
    dtype, decode_lens, prefill, sliding_window, softcap
):
    query, k_float, v_float, meta = _batch(decode_lens, prefill, block_size=8, kvh=2, heads=4, dim=32, seed=1)
    k_pool, v_pool, k_scale, v_scale = _stored(k_float, v_float)
    got = tk.paged_attention(
        query.to(dtype).to(DEVICE),
        k_pool,
        v_pool,
        meta.block_tables.to(DEVICE),
        meta.seq_lens.to(DEVICE),
        meta.query_start_loc.to(DEVICE),
        meta.max_query_len,
        0.3,
        sliding_window=sliding_window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert got.dtype == dtype
    want = reference_for(
        query,
        reference_dequantized(k_float),
        reference_dequantized(v_float),
        meta,
        0.3,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    tol = dict(rtol=1e-4, atol=2e-3) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float().cpu(), want, **tol)


def test_int8_cache_arguments_are_checked_by_name():
    pools = torch.zeros(2, 8, 2, 32, dtype=torch.int8, device=DEVICE)
    key = torch.zeros(1, 2, 32, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        tk.store_kv(key, key, pools, pools.clone(), slots, k_scale=torch.zeros(2, 8, 2), v_scale=torch.zeros(2, 8, 2))
    with pytest.raises(ValueError, match="dtype"):
        tk.store_kv(key, key, pools, pools.clone(), slots)  # int8 without scales
