"""Triton paged-attention kernels against the naive reference in ``reference_attention.py``.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is
imported); with TRITON_INTERPRET=0 and a CUDA device the same tests run natively.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reference_attention
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

pytest.importorskip("triton")

from hf_contbatch.kernels.attention import triton_aot, triton_launch, triton_tiles  # noqa: E402
from hf_contbatch.kernels.attention import triton_kernels as tk  # noqa: E402

from reference_attention import reference_paged_attention, reference_store_kv  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] not in ("", "0")
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")

TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def _query_start_loc(query_lens):
    return torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0).to(torch.int32)


def make_paged_case(
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
    query_lens=None,
    seed=0,
    spare_blocks=3,
    extra_table_width=2,
):
    """Random queries and a paged cache whose block tables are shuffled and non-contiguous.

    Every cache slot a request does not own holds NaN, and every block-table padding entry points
    at a NaN block, so a kernel that reads past a sequence (or past ceil(seq_len / block_size)
    table entries) produces NaN instead of a plausible wrong number.
    """
    gen = torch.Generator().manual_seed(seed)
    query_lens = [1] * len(seq_lens) if query_lens is None else query_lens
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block, order = order[0], order[1:]
    width = max(blocks_per_seq + [1]) + extra_table_width
    block_tables = torch.full((len(seq_lens), width), nan_block, dtype=torch.int32)
    for b, (seq_len, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        blocks, order = order[:n_blocks], order[n_blocks:]
        block_tables[b, :n_blocks] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(seq_len):
            block, offset = blocks[pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return dict(
        query=query.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE),
        query_start_loc=_query_start_loc(query_lens).to(DEVICE),
        max_query_len=max(query_lens + [0]),
        scale=1.0 / math.sqrt(head_dim),
    )


def reference(case, **kwargs):
    args = {k: case[k].cpu() for k in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")}
    return reference_paged_attention(**args, scale=case["scale"], **kwargs)


def decode(case, **kwargs):
    return tk.paged_decode_attention(
        case["query"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["scale"],
        **kwargs,
    )


def prefill(case, **kwargs):
    return tk.paged_prefill_attention(
        case["query"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["query_start_loc"],
        case["max_query_len"],
        case["scale"],
        **kwargs,
    )


def assert_matches_reference(actual, expected):
    assert actual.dtype == expected.dtype
    assert torch.isfinite(actual).all(), "kernel output has NaN/inf: it read a slot it does not own"
    torch.testing.assert_close(actual.cpu(), expected, **TOLERANCE[expected.dtype])


# ------------------------------------------------------------------ the reference itself


@pytest.mark.timeout(150)
def test_reference_matches_dense_sdpa_with_causal_window_mask():
    seq_lens, query_lens = [21, 9], [6, 9]
    case = make_paged_case(seq_lens, 4, 2, 32, 8, query_lens=query_lens)
    case = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    window = 7
    expected = reference_paged_attention(
        case["query"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["query_start_loc"],
        case["scale"],
        sliding_window=window,
    )
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        slots = [int(case["block_tables"][b, p // 8]) * 8 + p % 8 for p in range(seq_len)]
        keys = case["k_cache"].flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(2, dim=0)  # [H, S, D]
        values = case["v_cache"].flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(2, dim=0)
        start = int(case["query_start_loc"][b])
        q = case["query"][start : start + q_len].transpose(0, 1)  # [H, q_len, D]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        dense = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=case["scale"])
        torch.testing.assert_close(expected[start : start + q_len], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ store_kv


@pytest.mark.timeout(150)
def test_store_kv_writes_each_token_into_its_slot_and_skips_padding_slots():
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 2, 80
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:11].to(torch.int64)
    slots[4] = -1  # a padding token
    # key / value as non-contiguous views of a fused projection, as a model would produce them
    kv = torch.randn(11, 2, kv_heads, head_dim, generator=gen)
    key, value = kv[:, 0], kv[:, 1]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_store_kv(key, value, expected_k, expected_v, slots)
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    tk.store_kv(key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
    assert torch.equal(k_dev.cpu(), expected_k)
    assert torch.equal(v_dev.cpu(), expected_v)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_store_kv_casts_to_the_cache_dtype(cache_dtype):
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.zeros(4, 32, 1, 64, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, 1, 64, generator=gen)
    value = torch.randn(5, 1, 64, generator=gen)
    slots = torch.tensor([3, 40, 127, 64, 0])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_store_kv(key, value, expected_k, expected_v, slots)
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    tk.store_kv(key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
    assert k_dev.dtype == cache_dtype
    # One unit in the last place: Triton's interpreter truncates fp32 -> bf16 instead of rounding.
    ulp = torch.finfo(cache_dtype).eps
    torch.testing.assert_close(k_dev.cpu().float(), expected_k.float(), atol=0, rtol=ulp)
    torch.testing.assert_close(v_dev.cpu().float(), expected_v.float(), atol=0, rtol=ulp)


# ------------------------------------------------------------------ decode


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "seq_lens",
    [[16, 32, 48], [17, 33, 1], [1, 1, 2]],
    ids=["multiple_of_block_size", "one_past_block_size", "single_token_context"],
)
def test_decode_single_pass_matches_reference(seq_lens):
    case = make_paged_case(seq_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    assert_matches_reference(decode(case, num_splits=1), reference(case))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("gqa_ratio", [1, 4, 8])
def test_decode_groups_query_heads_per_kv_head(gqa_ratio):
    num_kv_heads = 2 if gqa_ratio < 8 else 1
    case = make_paged_case(
        [23, 40],
        num_heads=num_kv_heads * gqa_ratio,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        block_size=16,
        seed=gqa_ratio,
    )
    assert_matches_reference(decode(case), reference(case))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sliding_window, softcap", [(8, None), (None, 5.0), (19, 2.0)], ids=["window", "softcap", "window_and_softcap"]
)
def test_decode_sliding_window_and_softcap(sliding_window, softcap):
    case = make_paged_case([70, 5, 33], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, seed=3)
    # larger scores so that the softcap actually bends them
    case["scale"] = 1.0
    expected = reference(case, sliding_window=sliding_window, softcap=softcap)
    assert_matches_reference(decode(case, sliding_window=sliding_window, softcap=softcap), expected)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sliding_window", [None, 50])
def test_split_context_decode_merges_partitions_including_empty_ones(sliding_window):
    # 4 partitions of the 320-token table width: the short request leaves three of them empty,
    # and the window leaves the first partitions of the long request empty.
    case = make_paged_case([300, 45, 129], num_heads=4, num_kv_heads=2, head_dim=64, block_size=32, seed=4)
    expected = reference(case, sliding_window=sliding_window)
    assert_matches_reference(decode(case, num_splits=4, sliding_window=sliding_window), expected)


@pytest.mark.timeout(300)
def test_split_context_decode_keeps_every_key_when_max_seq_len_is_underestimated():
    case = make_paged_case([300, 45], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, seed=13)
    assert_matches_reference(decode(case, num_splits=3, max_seq_len=64), reference(case))


@pytest.mark.timeout(300)
def test_decode_splits_long_context_of_a_small_batch_automatically():
    assert tk.decode_num_splits(1, 1, 4096, DEVICE) > 1
    assert tk.decode_num_splits(4096, 8, 4096, DEVICE) == 1
    assert tk.decode_num_splits(1, 1, 100, DEVICE) == 1
    case = make_paged_case([600], num_heads=2, num_kv_heads=1, head_dim=64, block_size=32, seed=5)
    assert tk.decode_num_splits(1, 1, case["block_tables"].shape[1] * 32, DEVICE) > 1
    assert_matches_reference(decode(case), reference(case))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_half_precision_within_tolerance(dtype, num_splits):
    case = make_paged_case([40, 97], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=6)
    out = decode(case, num_splits=num_splits)
    assert out.dtype == dtype
    assert_matches_reference(out, reference(case))


# ------------------------------------------------------------------ prefill


@pytest.mark.timeout(300)
def test_chunked_prefill_attends_to_cached_prefix_and_own_chunk_causally():
    # fresh prompt (two query tiles), a chunk after a 33-token cached prefix, a decode token,
    # a request sitting this step out (0 query tokens), and a prefix-cache hit on a block boundary
    prefixes = [0, 33, 40, 5, 32]
    query_lens = [20, 7, 1, 0, 3]
    seq_lens = [p + q for p, q in zip(prefixes, query_lens)]
    case = make_paged_case(
        seq_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, query_lens=query_lens, seed=7
    )
    assert_matches_reference(prefill(case), reference(case))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sliding_window, softcap", [(6, None), (None, 3.0), (17, 4.0)], ids=["window", "softcap", "window_and_softcap"]
)
def test_prefill_sliding_window_and_softcap_with_gqa_8(sliding_window, softcap):
    case = make_paged_case(
        [45, 30], num_heads=8, num_kv_heads=1, head_dim=64, block_size=16, query_lens=[25, 30], seed=8
    )
    case["scale"] = 0.5
    expected = reference(case, sliding_window=sliding_window, softcap=softcap)
    assert_matches_reference(prefill(case, sliding_window=sliding_window, softcap=softcap), expected)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision_within_tolerance(dtype):
    case = make_paged_case(
        [37, 12], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[15, 12], dtype=dtype, seed=9
    )
    out = prefill(case)
    assert out.dtype == dtype
    assert_matches_reference(out, reference(case))


@pytest.mark.timeout(450)
@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_match_reference(seed):
    gen = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    batch = pick([1, 2, 3, 5])
    query_lens = [pick([0, 1, 1, 2, 9, 24]) for _ in range(batch)]
    prefixes = [pick([0, 1, 15, 16, 31, 50]) for _ in range(batch)]
    seq_lens = [max(p + q, 1) for p, q in zip(prefixes, query_lens)]
    num_kv_heads, ratio = pick([1, 2]), pick([1, 2, 4])
    case = make_paged_case(
        seq_lens,
        num_heads=num_kv_heads * ratio,
        num_kv_heads=num_kv_heads,
        head_dim=pick([64, 80]),
        block_size=pick([8, 16, 32]),
        query_lens=query_lens,
        dtype=pick([torch.float32, torch.float16, torch.bfloat16]),
        seed=seed,
    )
    window, softcap = pick([None, None, 5, 20]), pick([None, 10.0])
    out = tk.paged_attention(
        case["query"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        case["query_start_loc"],
        case["max_query_len"],
        case["scale"],
        sliding_window=window,
        softcap=softcap,
    )
    assert_matches_reference(out, reference(case, sliding_window=window, softcap=softcap))


# ------------------------------------------------------------------ shapes, dispatch, errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("head_dim, block_size", [(80, 32), (96, 16), (128, 8), (256, 16), (32, 64), (16, 16)])
def test_padded_head_sizes_and_block_sizes(head_dim, block_size):
    case = make_paged_case(
        [19, 40],
        num_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=block_size,
        query_lens=[4, 1],
        seed=head_dim,
    )
    assert_matches_reference(prefill(case), reference(case))
    decode_case = make_paged_case(
        [19, 40], num_heads=2, num_kv_heads=1, head_dim=head_dim, block_size=block_size, seed=head_dim + 1
    )
    assert_matches_reference(decode(decode_case), reference(decode_case))


@pytest.mark.timeout(300)
def test_paged_attention_sends_all_decode_batches_to_the_decode_kernel(monkeypatch):
    calls = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        original = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))

    decode_case = make_paged_case([9, 30], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=10)
    mixed_case = make_paged_case(
        [9, 30], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[1, 6], seed=11
    )
    for case in (decode_case, mixed_case):
        out = tk.paged_attention(
            case["query"],
            case["k_cache"],
            case["v_cache"],
            case["block_tables"],
            case["seq_lens"],
            case["query_start_loc"],
            case["max_query_len"],
            case["scale"],
        )
        assert_matches_reference(out, reference(case))
    assert calls == ["paged_decode_attention", "paged_prefill_attention"]


@pytest.mark.timeout(300)
def test_out_argument_and_non_contiguous_query():
    case = make_paged_case([25, 8], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[5, 8], seed=12)
    expected = reference(case)
    qkv = torch.randn(case["query"].shape[0], 3, 4, 64, device=DEVICE)
    qkv[:, 0] = case["query"]
    case["query"] = qkv[:, 0]  # a strided view, as sliced out of a fused QKV projection
    out = torch.empty(case["query"].shape, device=DEVICE)
    assert prefill(case, out=out) is out
    assert_matches_reference(out, expected)


@pytest.mark.timeout(150)
def test_empty_batch_returns_empty_output_without_launching(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for an empty batch")

    for module, name in triton_aot._KERNEL_NAMES:  # each kernel where its launcher looks it up
        monkeypatch.setattr(importlib.import_module(f"hf_contbatch.kernels.attention.{module}"), name, NoLaunch())
    monkeypatch.setattr(triton_launch, "_is_interpreted", lambda: INTERPRETED)
    k_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    no_tokens = torch.empty(0, 4, 64, device=DEVICE)
    int32 = dict(dtype=torch.int32, device=DEVICE)

    out = tk.paged_decode_attention(
        no_tokens, k_cache, v_cache, torch.empty(0, 3, **int32), torch.empty(0, **int32), 0.125
    )
    assert out.shape == (0, 4, 64)
    out = tk.paged_prefill_attention(
        no_tokens,
        k_cache,
        v_cache,
        torch.empty(0, 3, **int32),
        torch.empty(0, **int32),
        torch.zeros(1, **int32),
        0,
        0.125,
    )
    assert out.shape == (0, 4, 64)
    out = tk.paged_attention(
        no_tokens,
        k_cache,
        v_cache,
        torch.zeros(2, 3, **int32),
        torch.tensor([5, 7], **int32),
        torch.zeros(3, **int32),
        0,
        0.125,
    )
    assert out.shape == (0, 4, 64) and out.dtype == torch.float32
    tk.store_kv(
        torch.empty(0, 2, 64, device=DEVICE),
        torch.empty(0, 2, 64, device=DEVICE),
        k_cache,
        v_cache,
        torch.empty(0, dtype=torch.int64, device=DEVICE),
    )


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=72), r"head_dim.*\(16, 32, 64, 80, 96, 128, 256\).*72"),
        (dict(block_size=12), r"block_size.*12"),
        (dict(num_heads=6, num_kv_heads=4), r"num_heads"),
        (dict(cache_dtype=torch.float16), r"dtype"),
        (dict(seq_lens_dtype=torch.float32), r"seq_lens"),
    ],
    ids=["head_dim", "block_size", "gqa_divisibility", "dtype_mismatch", "seq_lens_dtype"],
)
def test_unsupported_arguments_raise_value_error_naming_them(change, message):
    head_dim = change.get("head_dim", 64)
    block_size = change.get("block_size", 16)
    num_heads, num_kv_heads = change.get("num_heads", 4), change.get("num_kv_heads", 2)
    query = torch.randn(2, num_heads, head_dim, device=DEVICE)
    k_cache = torch.zeros(
        4, block_size, num_kv_heads, head_dim, dtype=change.get("cache_dtype", torch.float32), device=DEVICE
    )
    seq_lens = torch.tensor([3, 4], dtype=change.get("seq_lens_dtype", torch.int32), device=DEVICE)
    block_tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        tk.paged_decode_attention(query, k_cache, k_cache.clone(), block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match=message):
        tk.paged_attention(
            query,
            k_cache,
            k_cache.clone(),
            block_tables,
            seq_lens,
            torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
            1,
            0.125,
        )


# ------------------------------------------------------------------ tiles sized per device


def _as_on(monkeypatch, arch):
    """Make the launchers size their tiles (and check dtypes) as on compute capability ``arch``."""
    monkeypatch.setattr(triton_launch, "_device_limits", lambda device: tk.arch_limits(arch))


@pytest.mark.timeout(600)
def test_sm75_fma_tiles_with_gqa_window_and_softcap_match_reference(monkeypatch):
    # sm_75 tiles: no tensor cores, 64 KiB -> 32 prefill rows x 16 keys, 16 decode keys.
    _as_on(monkeypatch, 75)
    pre, dec = (
        triton_tiles.prefill_tile_config(128, 8, torch.float16, tk.arch_limits(75)),
        triton_tiles.decode_tile_config(128, 8, torch.float16, tk.arch_limits(75)),
    )
    assert (pre.rows, pre.block_n, pre.heads) == (32, 16, 8) and (dec.rows, dec.block_n, dec.heads) == (16, 16, 8)
    case = make_paged_case(
        [40, 23],
        num_heads=16,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        query_lens=[9, 23],
        dtype=torch.float16,
        seed=21,
    )
    expected = reference(case, sliding_window=19, softcap=4.0)
    assert_matches_reference(prefill(case, sliding_window=19, softcap=4.0), expected)
    decode_case = make_paged_case(
        [40, 23], num_heads=16, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.float16, seed=22
    )
    for num_splits in (1, 3):
        assert_matches_reference(
            decode(decode_case, sliding_window=19, softcap=4.0, num_splits=num_splits),
            reference(decode_case, sliding_window=19, softcap=4.0),
        )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", [75, 86])
def test_gqa_group_split_over_programs_matches_reference(monkeypatch, arch):
    # fp32 at head size 256 holds 16 query heads per program, so a group of 24 runs as 16 + 8
    # (the second chunk partly masked); on sm_75 also with a single pipeline stage.
    _as_on(monkeypatch, arch)
    limits = tk.arch_limits(arch)
    pre, dec = (
        triton_tiles.prefill_tile_config(256, 24, torch.float32, limits),
        triton_tiles.decode_tile_config(256, 24, torch.float32, limits),
    )
    assert (pre.heads, dec.heads) == (16, 16)
    assert (pre.num_stages, dec.num_stages) == ((1, 1) if arch == 75 else (2, 2))
    case = make_paged_case(
        [20, 7], num_heads=24, num_kv_heads=1, head_dim=256, block_size=8, query_lens=[5, 7], seed=23
    )
    assert_matches_reference(prefill(case, sliding_window=9), reference(case, sliding_window=9))
    decode_case = make_paged_case([20, 7], num_heads=24, num_kv_heads=1, head_dim=256, block_size=8, seed=24)
    assert_matches_reference(decode(decode_case, num_splits=2), reference(decode_case))


@pytest.mark.timeout(150)
def test_bf16_is_refused_below_sm80_naming_the_gpu_and_fp16(monkeypatch):
    _as_on(monkeypatch, 75)
    case = make_paged_case([5], num_heads=2, num_kv_heads=1, head_dim=32, block_size=8, dtype=torch.bfloat16)
    for run in (lambda: decode(case), lambda: prefill(case)):
        with pytest.raises(ValueError, match=r"sm_75 \(T4.*compute capability 8\.0.*torch\.float16"):
            run()
    key = torch.zeros(1, 1, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"`k_cache` is torch\.bfloat16.*sm_75"):
        tk.store_kv(key, key, case["k_cache"], case["v_cache"], torch.zeros(1, dtype=torch.int64, device=DEVICE))
    fp16 = make_paged_case([5], num_heads=2, num_kv_heads=1, head_dim=32, block_size=8, dtype=torch.float16)
    assert_matches_reference(decode(fp16), reference(fp16))  # fp16, the alternative, runs
