"""What the registered attention function accepts from a model inside an engine step, and what it
refuses in one line rather than attend wrongly: checked on the call itself (a stand-in module and
the K/V a step's ``update`` stored), no model needed."""

from __future__ import annotations

import pytest
import torch

from hf_contbatch.kernels.attention import _check_served_call, _head_maps

from conftest import load_family_sweep


class _Attention(torch.nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx


class _Step:
    """The step view's questions the check asks: no layer shares another's K/V, none is latent, and
    the one mask it serves is its own ``index_mask`` (the causal mask over its contexts a model with
    a sparse-attention indexer passes on)."""

    def __init__(self) -> None:
        self.index_mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)

    def shares_kv(self, layer_idx) -> bool:
        return False

    def is_latent(self, layer_idx) -> bool:
        return False

    def is_index_mask(self, mask) -> bool:
        return mask is self.index_mask

    def serves_position_bias(self, position_bias) -> bool:
        # As a step of one request with 3 query rows over a context of 3 tokens.
        return tuple(position_bias.shape) == (1, 4, 3, 3)

    def one_request_rows(self):
        return 3, 3

    def key_bias_call(self, layer_idx, attention_mask):
        return None  # no layer stored a per-key bias (Doge's) this step


STEP = _Step()


def _kv(heads=4, tokens=3, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, tokens, dim, generator=g), torch.randn(1, heads, tokens, dim, generator=g)


def test_stored_kv_attend_as_stored_layer_without_maps():
    key, value = _kv()
    assert _check_served_call(_Attention(2), key, value, None, (STEP, 2, key, value), {}, STEP, False) == (2, None)
    # One module attending as another cache layer over what it stored there (HRM's recurrent cycles).
    assert _check_served_call(_Attention(0), key, value, None, (STEP, 6, key, value), {}, STEP, False) == (6, None)


def test_heads_picked_from_the_stored_kv_become_head_maps():
    key, value = _kv()
    # DiffLlama: K as stored, each half of V tiled back to 4 heads.
    first, second = (v.repeat(1, 2, 1, 1) for v in torch.chunk(value, 2, dim=1))
    assert _head_maps(key, value, key, first) == ((0, 1, 2, 3), (0, 1, 0, 1))
    assert _head_maps(key, value, key, second) == ((0, 1, 2, 3), (2, 3, 2, 3))
    # JetMoE: K and V repeated for 2 experts.
    maps = _head_maps(key, value, key.repeat(1, 2, 1, 1), value.repeat(1, 2, 1, 1))
    assert maps == ((0, 1, 2, 3, 0, 1, 2, 3),) * 2
    assert _check_served_call(_Attention(1), key, first, None, (STEP, 1, key, value), {}, STEP, False) == (
        1,
        ((0, 1, 2, 3), (0, 1, 0, 1)),
    )


def test_the_steps_own_index_mask_is_served_and_an_equal_mask_is_not():
    key, value = _kv()
    stored = (STEP, 1, key, value)
    assert _check_served_call(_Attention(1), key, value, STEP.index_mask, stored, {}, STEP, False) == (1, None)
    # Equal values are not enough: only the mask the step built says which keys are each request's.
    with pytest.raises(ValueError, match="adds its own attention mask"):
        _check_served_call(_Attention(1), key, value, STEP.index_mask.clone(), stored, {}, STEP, False)
    # A compiled forward's op takes no mask at all.
    with pytest.raises(ValueError, match="adds its own attention mask"):
        _check_served_call(_Attention(1), key, value, STEP.index_mask, stored, {}, STEP, True)


@pytest.mark.parametrize(
    "case, what",
    [
        ("mask", "adds its own attention mask or bias"),
        ("scaled_key", "changes K/V between cache.update and attention"),
        ("twin_heads", "changes K/V between cache.update and attention"),
        ("other_layer", "attends as layer 3 without storing its K/V through cache.update right before"),
    ],
)
def test_calls_the_kernels_cannot_serve_are_refused_in_one_line(case, what):
    key, value = _kv()
    module, mask, given_key, stored = _Attention(1), None, key, (STEP, 1, key, value)
    if case == "mask":
        mask = torch.zeros(1, 1, 3, 3)
    elif case == "scaled_key":
        given_key = key * 2  # K/V changed after the update, not picked from it
    elif case == "twin_heads":
        # Two stored heads equal on this step's rows: which one holds a picked head's past is unknown.
        key[:, 1] = key[:, 0]
        given_key = key[:, [1, 1, 2, 3]]
    else:
        module, given_key = _Attention(3), key * 2
    with pytest.raises(ValueError) as err:
        _check_served_call(module, given_key, value, mask, stored, {}, STEP, False)
    assert what in str(err.value) and "\n" not in str(err.value)


def test_a_position_bias_is_served_over_one_requests_context_only():
    """Inkling's ``position_bias``: passed on where the step view serves it (one request, its whole
    context), refused in one line elsewhere and under a compiled forward (whose op takes none)."""
    key, value = _kv()
    stored = (STEP, 1, key, value)
    served = {"position_bias": torch.zeros(1, 4, 3, 3)}
    assert _check_served_call(_Attention(1), key, value, None, stored, served, STEP, False) == (1, None)
    batched = {"position_bias": torch.zeros(2, 4, 1, 3)}  # a [B, 1] batch of decodes: no one request's positions
    with pytest.raises(ValueError, match="position bias") as err:
        _check_served_call(_Attention(1), key, value, None, stored, batched, STEP, False)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="compiled forward"):
        _check_served_call(_Attention(1), key, value, None, stored, served, STEP, True)


def test_per_query_sinks_are_served_over_one_requests_rows_only():
    """Inkling 2's ``sinks`` (``[1, H, T, 1]``, one logit per query row and head): passed on for the
    step's one request, refused in one line otherwise and under a compiled forward."""
    key, value = _kv()
    stored = (STEP, 1, key, value)
    served = {"sinks": torch.zeros(1, 4, 3, 1)}
    assert _check_served_call(_Attention(1), key, value, None, stored, served, STEP, False) == (1, None)
    for sinks in (torch.zeros(2, 4, 1, 1), torch.zeros(4)):  # a batch of decodes; per head only
        with pytest.raises(ValueError, match="attention sinks") as err:
            _check_served_call(_Attention(1), key, value, None, stored, {"sinks": sinks}, STEP, False)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="compiled forward"):
        _check_served_call(_Attention(1), key, value, None, stored, served, STEP, True)


@pytest.mark.parametrize(
    "seq_lens, query_rows, shape, served",
    [
        ([9], [9], (1, 4, 9, 9), True),  # a prompt
        ([9], [1], (1, 4, 1, 9), True),  # a decode over its context
        ([9], [1], (1, 4, 1, 1), False),  # a bias over the new token only (a cache reporting no past)
        ([9, 4], [1, 1], (1, 4, 2, 9), False),  # two requests
        ([9], [1], (2, 4, 1, 9), False),  # a batch dimension
    ],
)
def test_the_step_view_serves_a_position_bias_over_its_one_requests_whole_context(seq_lens, query_rows, shape, served):
    from hf_contbatch.kernels.paged_cache import AttentionMetadata, PagedCacheStep

    starts = [0]
    for n in query_rows:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), 3, dtype=torch.int32),
        num_decodes=sum(n == 1 for n in query_rows),
        max_query_len=max(query_rows),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        block_size=4,
        num_kv_heads=2,
    )
    view = PagedCacheStep.__new__(PagedCacheStep)  # the check reads the metadata alone
    view.metadata = meta
    assert view.serves_position_bias(torch.zeros(shape)) is served


@pytest.mark.timeout(120)
def test_no_record_of_stored_kv_outlives_a_step():
    """The attention calls of a step read the record of the K/V stored last (every call of a layer:
    DiffLlama attends twice); once the step's forward is done the record is gone, since it holds
    the step's view and so the pools (an engine driven on this thread and then closed would
    otherwise keep its pools alive)."""
    import gc
    import weakref

    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
    from hf_contbatch.kernels import attention

    family_sweep = load_family_sweep()
    model = family_sweep.build_tiny("diffllama")
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    pool = weakref.ref(eng.cache.key_cache[0])
    try:
        handle = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
        eng.driver.drive(handle.done)  # iterations on this thread
        assert len(handle.result(timeout=10).output_token_ids) == 3
        assert getattr(attention._STORED, "record", None) is None
    finally:
        eng.close()
    del eng, handle
    gc.collect()
    assert pool() is None
