"""Per-request latency metrics (``RequestOutput.metrics``, ``EngineStats``' percentiles and latest
request) against independent clocks: the test's own ``time.monotonic()`` around the call, a stop
checker noting when each token is decided, and arithmetic on hand-made times; percentiles against
numpy's."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.request import LatencySamples, RequestMetrics, percentile
from tests.conftest import random_prompts


def _metrics(arrival, scheduled, first, last, finished, n) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=first,
        last_token_time=last,
        finished_time=finished,
        num_generated_tokens=n,
    )


@pytest.mark.timeout(300)
def test_one_request_metrics_agree_with_a_clock_around_the_call_and_one_per_token(llama_model):
    new_tokens = 12
    decided: list[float] = []  # when the engine checked each token for a stop, by the test's clock

    def note_time(_request) -> bool:
        decided.append(time.monotonic())
        return False

    eng = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32)))
    try:
        req = eng.build_request(
            random_prompts([20])[0], SamplingParams(max_new_tokens=new_tokens), stop_checker=note_time
        )
        t0 = time.monotonic()
        (handle,) = eng.enqueue([req])[0]
        out = handle.result(120)
        t1 = time.monotonic()
        stats = eng.stats()
    finally:
        eng.close()
    m = out.metrics
    assert m.num_generated_tokens == len(out.output_token_ids) == new_tokens
    # The last token reaches max_new_tokens: the length stop needs no checker call.
    assert len(decided) == new_tokens - 1
    # The events, in order, inside the call as the test's clock saw it.
    assert t0 <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time <= t1
    assert 0 < m.time_in_queue <= m.ttft <= t1 - t0
    # Token k is ready (after its step's forward) before its stop check, which comes before the
    # next step's forward makes token k + 1: the checker's times and the engine's interleave.
    assert m.first_token_time <= decided[0] and decided[-1] <= m.last_token_time
    assert m.itl >= (decided[-1] - decided[0]) / (new_tokens - 1)
    # One stop check per step: their mean gap is the step's time, as the engine's ITL is.
    assert m.itl == pytest.approx((decided[-1] - decided[0]) / (new_tokens - 2), rel=0.5)
    # The definitions: TTFT plus n - 1 inter-token gaps is arrival to last token.
    assert m.ttft + (new_tokens - 1) * m.itl == pytest.approx(m.last_token_time - m.arrival_time, rel=1e-9)
    assert m.tokens_per_s == pytest.approx(new_tokens / (m.last_token_time - m.arrival_time), rel=1e-9)
    assert out.ttft == m.ttft and out.latency == m.latency == m.finished_time - m.arrival_time
    # The engine's own view of its only request: its figures, not a mix with others'.
    assert stats.latest_request_id == out.request_id and stats.latest_request == m
    assert stats.median_ttft_s == stats.p90_ttft_s == stats.mean_ttft_s == pytest.approx(m.ttft, rel=1e-9)
    assert stats.mean_itl_s == pytest.approx(m.itl, rel=1e-6)  # the mean gap telescopes to (last - first) / (n - 1)


@pytest.mark.timeout(300)
def test_a_queued_request_is_first_scheduled_after_the_one_ahead_of_it_finished(llama_model):
    # One seat (max_num_seqs=1): the second request waits until the first leaves the batch.
    eng = LLMEngine(
        llama_model,
        EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=1)),
    )
    try:
        prompts = random_prompts([10, 14], seed=3)
        reqs = [eng.build_request(p, SamplingParams(max_new_tokens=6)) for p in prompts]
        first, second = (hs[0].result(120).metrics for hs in eng.enqueue(reqs))
    finally:
        eng.close()
    assert first.arrival_time == second.arrival_time  # queued in one call
    assert second.first_scheduled_time >= first.last_token_time
    assert second.time_in_queue >= first.last_token_time - first.arrival_time
    assert second.ttft > second.time_in_queue > first.time_in_queue


def test_percentile_interpolates_between_ranks_as_numpy_does():
    rng = np.random.default_rng(0)
    for values in ([3.0], [2.0, 1.0], [5.0, 1.0, 4.0, 2.0, 3.0], rng.exponential(size=37).tolist()):
        for q in (0, 10, 50, 90, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12), (values, q)
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match=r"`q` must be in \[0, 100\], got 101"):
        percentile([1.0], 101)


def test_request_metrics_from_hand_made_times():
    m = _metrics(10.0, 10.5, 12.0, 15.0, 15.25, 7)
    assert (m.time_in_queue, m.ttft, m.latency) == (0.5, 2.0, 5.25)
    assert m.itl == 3.0 / 6 and m.tokens_per_s == 7 / 5.0
    one_token = _metrics(1.0, 1.0, 1.5, 1.5, 2.0, 1)
    assert one_token.ttft == 0.5 and one_token.itl is None  # no gap between two tokens
    waiting = _metrics(1.0, None, None, None, None, 0)
    assert (waiting.time_in_queue, waiting.ttft, waiting.itl, waiting.tokens_per_s, waiting.latency) == (None,) * 5


def test_latency_samples_give_medians_and_p90_over_requests():
    samples = LatencySamples()
    assert samples.summary() == {"ttft_s": None, "ttft_p90_s": None, "itl_s": None, "itl_p90_s": None}
    # TTFTs 1, 2, 3, 4 s; ITLs 0.1, 0.2, 0.3 s (the last request has one token: no ITL).
    samples.extend(
        [
            _metrics(0.0, 0.0, 1.0, 1.5, 1.5, 6),
            _metrics(0.0, 0.0, 2.0, 3.0, 3.0, 6),
            _metrics(0.0, 0.0, 3.0, 4.5, 4.5, 6),
            _metrics(0.0, 0.0, 4.0, 4.0, 4.0, 1),
        ]
    )
    figures = samples.summary()
    assert figures["ttft_s"] == pytest.approx(2.5) and figures["ttft_p90_s"] == pytest.approx(3.7)
    assert figures["itl_s"] == pytest.approx(0.2) and figures["itl_p90_s"] == pytest.approx(0.28)
    assert (len(samples.ttfts), len(samples.itls)) == (4, 3)
