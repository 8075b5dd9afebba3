"""Generation parity with transformers' ``generate``: every logits-processor setting (built by
transformers itself per request), custom processors and stopping criteria, seeded sampling, and
the scores ``generate(output_scores=True)`` returns. Expected values come from ``generate`` on a
separate copy of the embedded model (float32, CPU); each setting is first shown to change the
output, and all settings run batched together in one engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, WatermarkingConfig
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

from hf_contbatch import CacheConfig, ContinuousBatchingPipeline, EngineConfig, SchedulerConfig
from hf_contbatch.default_model import default_model_path
from hf_contbatch.engine.logits_processors import TokenHistory, fast_warp_params, warp_batched

PATH = default_model_path()
PROMPTS = ["The for statement", "A class is a", "Exceptions are raised when"]
NEW = 24


@pytest.fixture(scope="module")
def pipe():
    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)
    p = ContinuousBatchingPipeline(
        model,
        PATH,
        engine_config=EngineConfig(
            cache=CacheConfig(block_size=8, num_blocks=256),
            scheduler=SchedulerConfig(max_num_batched_tokens=64),
        ),
    )
    yield p
    p.close()


def _generate(model, tok, prompt, **kw):
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return out[0, ids.shape[1] :].tolist()


def _ours(handle):
    rec = handle.result(600)[0]
    return rec["generated_token_ids"][len(handle.handles[0].request.prompt_token_ids) :]


class _BoostByLength(LogitsProcessor):
    """A user processor whose effect depends on the request's own history length."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 100 + input_ids.shape[1] % 50] += 20.0
        return scores


class _StopAfterToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _greedy_cases(plain: dict) -> list:
    """(prompt, kwargs, changes_output) per setting; token choices come from the plain outputs."""
    _, p1, p2 = (plain[p] for p in PROMPTS)
    even_only = lambda batch_id, ids: list(range(2, 4096, 2))  # noqa: E731
    return [
        (PROMPTS[0], {"no_repeat_ngram_size": 1}, True),
        (PROMPTS[1], {"repetition_penalty": 1.5}, True),
        (PROMPTS[2], {"encoder_repetition_penalty": 2.0}, True),
        (PROMPTS[0], {"encoder_no_repeat_ngram_size": 1}, True),
        (PROMPTS[1], {"bad_words_ids": [[p1[3]]]}, True),
        (PROMPTS[2], {"sequence_bias": {(p2[2],): -50.0}}, True),
        (PROMPTS[2], {"suppress_tokens": [p2[4]]}, True),
        (PROMPTS[1], {"begin_suppress_tokens": [p1[0]]}, True),
        (PROMPTS[0], {"forced_eos_token_id": 7}, True),  # its plain output runs to max_new_tokens
        (PROMPTS[0], {"exponential_decay_length_penalty": (2, 1.6)}, True),
        (PROMPTS[1], {"prefix_allowed_tokens_fn": even_only}, True),
        (PROMPTS[2], {"logits_processor": LogitsProcessorList([_BoostByLength()])}, True),
        (PROMPTS[0], {"watermarking_config": WatermarkingConfig(bias=8.0)}, True),
        (PROMPTS[2], {"min_length": 30}, True),  # its plain output ends with EOS
        # Settings that cannot change a greedy decoder-only output (forced BOS acts at length 1,
        # renormalising and inf/nan removal keep the argmax): equal to generate all the same.
        (PROMPTS[2], {"forced_bos_token_id": 7}, False),
        (PROMPTS[0], {"renormalize_logits": True, "remove_invalid_values": True}, False),
    ]


@pytest.mark.timeout(1500)
def test_every_greedy_setting_equals_generate_batched_with_the_others(pipe, ref_model, tok):
    plain = {p: _generate(ref_model, tok, p, do_sample=False, max_new_tokens=NEW) for p in PROMPTS}
    cases = _greedy_cases(plain)
    # All submitted before any finishes: one continuous batch mixing every setting and plain rows.
    handles = [pipe.submit(p, do_sample=False, max_new_tokens=NEW, return_tensors=True, **kw) for p, kw, _ in cases]
    plain_handles = [pipe.submit(p, do_sample=False, max_new_tokens=NEW, return_tensors=True) for p in PROMPTS]
    for (prompt, kw, changes), h in zip(cases, handles):
        expected = _generate(ref_model, tok, prompt, do_sample=False, max_new_tokens=NEW, **kw)
        assert (expected != plain[prompt]) == changes, (kw, expected, plain[prompt])
        assert _ours(h) == expected, kw
    for prompt, h in zip(PROMPTS, plain_handles):
        assert _ours(h) == plain[prompt]
    pipe.engine.wait_idle(10)
    assert pipe.stats().num_free_blocks == pipe.stats().num_blocks


SAMPLED = [
    {"min_p": 0.2},
    {"typical_p": 0.4},
    {"epsilon_cutoff": 0.02},
    {"eta_cutoff": 0.02},
    {"top_h": 0.4},
    {"top_k": 5, "temperature": 0.8, "top_p": 0.8},  # the batched warper path
    {"repetition_penalty": 1.3, "top_k": 20, "no_repeat_ngram_size": 2},  # history + warpers
]


@pytest.mark.timeout(1500)
def test_seeded_sampling_equals_generate_with_that_seed_and_reproduces(pipe, ref_model, tok):
    base = {"do_sample": True, "temperature": 1.0, "top_k": 0, "max_new_tokens": 16}
    jobs = []
    for i, kw in enumerate(SAMPLED):
        prompt, seed = PROMPTS[i % len(PROMPTS)], 11 + i
        args = {**base, **kw}
        jobs.append((prompt, seed, args, pipe.submit(prompt, seed=seed, return_tensors=True, **args)))
    # drawn from the engine's generator (randomly seeded: EOS could come at any step)
    unseeded = pipe.submit(PROMPTS[0], return_tensors=True, ignore_eos=True, **base)
    for prompt, seed, args, h in jobs:
        torch.manual_seed(seed)
        expected = _generate(ref_model, tok, prompt, **args)
        torch.manual_seed(seed)
        without = _generate(ref_model, tok, prompt, **base)
        assert expected != without, args  # the setting changes what is drawn
        assert _ours(h) == expected, args
        again = pipe(prompt, seed=seed, return_tensors=True, **args)[0]["generated_token_ids"]
        assert again[len(h.handles[0].request.prompt_token_ids) :] == expected
    assert len(_ours(unseeded)) == 16


@pytest.mark.timeout(1500)
def test_history_processors_see_their_own_ids_under_preemption(ref_model, tok):
    model = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32)
    prompts = ["The for statement " * 3, "A class is a", "Exceptions are raised when", "import os"]
    settings = [{"no_repeat_ngram_size": 2}, {"repetition_penalty": 1.4}, {}, {"sequence_bias": {(292,): -9.0}}]
    pipe = ContinuousBatchingPipeline(
        model,
        PATH,
        engine_config=EngineConfig(
            cache=CacheConfig(block_size=4, num_blocks=24),
            scheduler=SchedulerConfig(max_num_batched_tokens=16),
        ),
    )
    try:
        handles = [
            pipe.submit(p, do_sample=False, max_new_tokens=40, return_tensors=True, ignore_eos=True, **kw)
            for p, kw in zip(prompts, settings)
        ]
        # a seeded sample with a history processor, in the same batch under preemption
        sampled_kw = {"do_sample": True, "top_k": 20, "temperature": 1.0, "repetition_penalty": 1.3}
        sampled = pipe.submit(prompts[1], max_new_tokens=40, return_tensors=True, ignore_eos=True, seed=3, **sampled_kw)
        got = [_ours(h) for h in handles]
        assert sum(h.handles[0].request.num_preemptions for h in [*handles, sampled]) > 0
        ids = tok(prompts[1], return_tensors="pt")["input_ids"]
        torch.manual_seed(3)
        with torch.no_grad():
            out = ref_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=40,
                eos_token_id=None,
                pad_token_id=0,
                **sampled_kw,
            )
        assert _ours(sampled) == out[0, ids.shape[1] :].tolist()
        for p, kw, g in zip(prompts, settings, got):
            ids = tok(p, return_tensors="pt")["input_ids"]
            # ignore_eos: generate without EOS (suppressing nothing: eos_token_id=None)
            with torch.no_grad():
                out = ref_model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=40,
                    eos_token_id=None,
                    pad_token_id=0,
                    **kw,
                )
            assert g == out[0, ids.shape[1] :].tolist(), kw
        pipe.engine.wait_idle(10)
        assert pipe.stats().num_free_blocks == pipe.stats().num_blocks
    finally:
        pipe.close()


@pytest.mark.timeout(900)
def test_custom_stopping_criteria_stop_only_their_request(pipe, ref_model, tok):
    plain = _generate(ref_model, tok, PROMPTS[0], do_sample=False, max_new_tokens=NEW)
    stop_token = plain[5]
    cases = [
        StoppingCriteriaList([_StopAfterToken(stop_token)]),
        StoppingCriteriaList([MaxLengthCriteria(max_length=len(tok(PROMPTS[0])["input_ids"]) + 3)]),
    ]
    handles = [
        pipe.submit(PROMPTS[0], do_sample=False, max_new_tokens=NEW, return_tensors=True, stopping_criteria=c)
        for c in cases
    ]
    free = pipe.submit(PROMPTS[0], do_sample=False, max_new_tokens=NEW, return_tensors=True)
    for c, h in zip(cases, handles):
        expected = _generate(ref_model, tok, PROMPTS[0], do_sample=False, max_new_tokens=NEW, stopping_criteria=c)
        assert len(expected) < len(plain)
        assert _ours(h) == expected
        assert h.finish_reasons() == ["stop"]
    assert _ours(free) == plain


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"do_sample": False, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2},
        {"do_sample": True, "temperature": 0.8, "top_k": 20},
        {"do_sample": False, "renormalize_logits": True},
    ],
    ids=["greedy+penalties", "sampled+warpers", "renormalize"],
)
def test_logprobs_equal_generate_output_scores(pipe, ref_model, tok, kwargs):
    ids = tok(PROMPTS[1], return_tensors="pt")["input_ids"]
    torch.manual_seed(5)
    with torch.no_grad():
        ref = ref_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    new = ref.sequences[0, ids.shape[1] :]
    logp = [torch.log_softmax(s[0], -1) for s in ref.scores]
    expected = torch.stack([lp[t] for lp, t in zip(logp, new)])
    rec = pipe(
        PROMPTS[1],
        max_new_tokens=12,
        seed=5,
        output_scores=True,
        return_dict_in_generate=True,
        logprobs=3,
        return_tensors=True,
        **kwargs,
    )[0]
    assert rec["generated_token_ids"][ids.shape[1] :] == new.tolist()
    torch.testing.assert_close(torch.tensor(rec["logprobs"]), expected, atol=1e-5, rtol=0)
    for lp, top in zip(logp, rec["top_logprobs"]):
        ref_top = torch.topk(lp, 3)
        assert [t for t, _ in top] == ref_top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), ref_top.values, atol=1e-5, rtol=0)
    # the same through a handle of the engine
    h = pipe.submit(PROMPTS[1], max_new_tokens=12, seed=5, output_scores=True, **kwargs)
    out = h.handles[0].result(300)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
    assert "logprobs" in h.result(300)[0] and "generated_text" in h.result(300)[0]


def _per_row(scores, t, k, p):
    procs = LogitsProcessorList()
    if t is not None:
        procs.append(TemperatureLogitsWarper(t))
    if k is not None:
        procs.append(TopKLogitsWarper(k))
    if p is not None:
        procs.append(TopPLogitsWarper(p))
    assert fast_warp_params(procs) == (t, k, p)
    return procs(None, scores)


ALL_TOP_K = [(0.7, 50, 0.9), (None, 20, 0.95), (1.3, 5, None), (0.5, 300, 0.7), (2.0, 1, 0.5), (None, 8, 0.3)]


@pytest.mark.parametrize(
    "params,tie,vocab",
    [
        (
            [
                (0.7, 50, 0.9),
                (None, None, 0.95),
                (1.3, 5, None),
                (None, None, None),
                (0.5, None, 0.7),
                (None, 4096, 0.99),
                (2.0, 1, 0.5),
                (0.9, 4096 * 2, None),
            ],
            False,
            4096,
        ),
        # every row has a top-k: top-p runs on the top-k values without a sort
        (ALL_TOP_K, False, 4096),
        (ALL_TOP_K, False, 32003),
        ([(0.7, 50, 0.9), (None, 20, 0.95)], True, 4096),  # a tie at the k-th value: the general route
    ],
    ids=["mixed", "all-top-k", "all-top-k-32003", "top-k-tie"],
)
def test_batched_warping_equals_transformers_warpers_bit_for_bit(params, tie, vocab):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(len(params), vocab, generator=g) * 3
    scores[1, :10] = 7.0  # ties among the kept values
    if tie:
        scores[0, 100:200] = scores[0].topk(50).values[-1]
    got, candidates = warp_batched(scores, params)
    for i, (t, k, p) in enumerate(params):
        ref = _per_row(scores[i : i + 1], t, k, p)
        assert torch.equal(got[i : i + 1], ref), (t, k, p)
        assert torch.equal(torch.softmax(got, -1)[i : i + 1], torch.softmax(ref, -1))
    if all(k is not None for _, k, _ in params) and not tie:
        # the candidates hold every finite score of each row (the unseeded draw runs over them)
        kept = torch.zeros_like(got, dtype=torch.bool).scatter_(1, candidates, True)
        assert not torch.isfinite(got[~kept]).any()
    else:
        assert candidates is None
    # anything else, or another order, needs the per-request path
    assert fast_warp_params(LogitsProcessorList([TopKLogitsWarper(5), TemperatureLogitsWarper(0.5)])) is None
    assert fast_warp_params(LogitsProcessorList([_BoostByLength()])) is None


def test_unseeded_draws_over_top_k_candidates_follow_the_distribution():
    # 20,000 draws of a 3-candidate distribution through the sampler's batched path: the
    # frequencies match the probabilities of the warped scores (5 sigma).
    from hf_contbatch.core.plan import NewRequestData
    from hf_contbatch.engine.input_batch import InputBatch
    from hf_contbatch.engine.sampler import Sampler
    from hf_contbatch.request import Request, SamplingParams

    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.full((1, 64), -5.0)
    logits[0, [3, 10, 40]] = torch.tensor([1.0, 0.5, 0.0])
    sp = SamplingParams(do_sample=True, top_k=3, temperature=0.8, max_new_tokens=1)
    batch = InputBatch()
    for i in range(20000):
        req = Request(request_id=i, prompt_token_ids=[1], sampling=sp)
        sampler.processors.track(req)  # the engine keeps each request's processors by id
        batch.add(NewRequestData.of(req))
    tokens, _ = sampler.sample(logits.expand(20000, -1).clone(), list(batch.rows.values()))
    tokens = torch.tensor(tokens)
    probs = torch.softmax(logits[0, [3, 10, 40]] / 0.8, -1)
    freq = torch.stack([(tokens == t).float().mean() for t in (3, 10, 40)])
    assert set(tokens.tolist()) == {3, 10, 40}
    assert torch.all((freq - probs).abs() < 5 * torch.sqrt(probs * (1 - probs) / 20000))


@pytest.mark.parametrize("vocab", [1, 7, 17, 2048, 49152])
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_tokens_pick_the_first_of_tied_maxima(vocab, threads):
    # greedy_tokens runs torch's max reduction, not argmax (faster on a CPU): on ties it must still
    # pick the first index, as generate's argmax does. Expected values: a pure-Python scan.
    from hf_contbatch.engine.sampler import greedy_tokens

    g = torch.Generator().manual_seed(vocab)
    scores = torch.randint(-2, 2, (64, vocab), generator=g).float()  # many ties per row
    scores[1] = float("-inf")  # a fully masked row: index 0
    if vocab > 3:
        scores[2, 3] = float("nan")  # a NaN wins, as in argmax
        scores[3, vocab - 1] = scores[3, vocab // 2] = 5.0  # two tied maxima far apart
    expected = []
    for row in scores.tolist():
        nans = [j for j, v in enumerate(row) if v != v]
        expected.append(nans[0] if nans else row.index(max(row)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert greedy_tokens(scores) == expected
    finally:
        torch.set_num_threads(before)


def test_token_history_grows_without_losing_tokens():
    h = TokenHistory(capacity=4, device=torch.device("cpu"))
    prompt, out = [5, 6, 7], []
    assert h.view(prompt, out).tolist() == [[5, 6, 7]]
    for t in range(10, 20):
        out.append(t)
        assert h.view(prompt, out).tolist() == [prompt + out]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logits_processor": "no"}, "logits_processor"),
        ({"prefix_allowed_tokens_fn": 3}, "prefix_allowed_tokens_fn"),
        ({"stopping_criteria": [1]}, "stopping_criteria"),
    ],
)
def test_bad_generation_objects_are_rejected_and_the_pipeline_keeps_serving(pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipe(PROMPTS[0], max_new_tokens=2, **kwargs)
    assert pipe(PROMPTS[0], max_new_tokens=2, do_sample=False)
