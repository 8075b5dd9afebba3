"""Reliability: a bad request is refused at submit, a fault stays with the request that caused it,
an interrupt cancels only the interrupted call's requests, memory stays flat over many requests.

Every fault-injection test checks the same four things: the affected request gets an error naming
the cause (or its documented finish), every other request completes with exactly the tokens of
transformers' greedy ``generate``, no KV block leaks, and the next call works.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import time

import pytest
import torch

from hf_contbatch import CacheConfig, EngineConfig, EngineError, LLMEngine, SamplingParams

from conftest import build_model, enqueue_at_once, random_prompts, reference_greedy


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def _assert_at_rest(eng, num_blocks: int) -> None:
    assert eng.wait_idle(30)
    stats = eng.stats()
    assert stats.num_free_blocks == num_blocks, "a KV block leaked"
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    eng.block_manager.check_invariants()


# --- 1. everything a request brings is checked at submit ------------------------------------------
@pytest.mark.timeout(300)
def test_out_of_range_or_negative_token_id_is_refused_at_submit_naming_id_position_and_vocab(llama_model):
    eng = LLMEngine(llama_model, EngineConfig(cache=CacheConfig(num_blocks=16)))
    try:
        with pytest.raises(ValueError, match=r"token id 512 at position 2, outside the model's vocabulary of 512"):
            eng.submit([5, 6, 512], _greedy(3))
        with pytest.raises(ValueError, match=r"token id -1 at position 2"):
            eng.submit([5, 6, -1], _greedy(3))
        with pytest.raises(ValueError, match="temperature"):
            eng.submit([5, 6], SamplingParams(max_new_tokens=2, do_sample=True, temperature=0.0))
        with pytest.raises(ValueError, match="score_token_id"):
            eng.submit([5, 6], SamplingParams(max_new_tokens=1, prompt_logprobs=1, score_token_id=512))
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.submit([5, 6], SamplingParams(max_new_tokens=0))
        assert not eng.driver.has_work(), "a refused request entered the engine"  # inbox and scheduler
        ref = reference_greedy(build_model("llama"), [5, 6, 7], 4)
        assert eng.submit([5, 6, 7], _greedy(4)).result(150).output_token_ids == ref
        _assert_at_rest(eng, 16)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def embedded():
    """The package's model in float32 (the packed-linear path) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_contbatch.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.timeout(600)
def test_added_special_token_without_resize_is_refused_and_a_running_request_is_untouched(embedded):
    from hf_contbatch import ContinuousBatchingPipeline

    model, tok = embedded
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.add_tokens(["<|tool|>"], special_tokens=True)
    innocent = "The list of arguments"
    ref = reference_greedy(model, tok(innocent)["input_ids"], 64)
    pipe = ContinuousBatchingPipeline(model, tok, engine_config=EngineConfig(cache=CacheConfig(num_blocks=64)))
    try:
        bg = pipe.submit(innocent, max_new_tokens=64, do_sample=False, ignore_eos=True)
        with pytest.raises(ValueError, match=r"token id 4096 at position \d+, outside the model.s vocabulary of 4096"):
            pipe("Call <|tool|> now", max_new_tokens=8)
        with pytest.raises(ValueError, match=r"token id 4096"):  # a list: nothing of it is submitted
            pipe(["fine prompt", "Call <|tool|> now"], max_new_tokens=8)
        assert bg.handles[0].result(300).output_token_ids == ref
        _assert_at_rest(pipe.engine, 64)
    finally:
        pipe.close()


# --- 2. failures stay with the request that caused them --------------------------------------------
@pytest.mark.timeout(600)
def test_forward_raising_for_one_request_fails_it_alone_with_its_partial_output():
    """The forward raises whenever position 24 is in the batch: only the culprit (20-token prompt)
    reaches it, at its fifth decode step; the others share every batch with it until then."""
    model = build_model("llama")
    prompts = random_prompts([20, 6, 9, 12], seed=3)
    refs = [reference_greedy(model, p, 10) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64)))

    def fault(module, args, kwargs):
        if (kwargs["position_ids"] == 24).any():
            raise RuntimeError("injected fault: position 24 is poisoned")

    hook = model.register_forward_pre_hook(fault, with_kwargs=True)
    try:
        hs = [eng.submit(p, _greedy(10)) for p in prompts]
        with pytest.raises(EngineError, match="position 24 is poisoned") as info:
            hs[0].result(300)
        partial = info.value.output
        assert partial.finish_reason == "error"
        assert partial.output_token_ids == refs[0][:5], "the culprit lost the tokens it had generated"
        assert hs[0].output().output_token_ids == refs[0][:5]
        for h, ref in zip(hs[1:], refs[1:]):
            assert h.result(300).output_token_ids == ref
        _assert_at_rest(eng, 64)
        hook.remove()
        assert eng.submit(prompts[0], _greedy(10)).result(300).output_token_ids == refs[0]
    finally:
        hook.remove()
        eng.close()


@pytest.mark.timeout(600)
def test_a_step_that_fails_once_is_retried_and_nobody_fails():
    model = build_model("llama")
    prompts = random_prompts([5, 8, 11], seed=4)
    refs = [reference_greedy(model, p, 6) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=32)))
    original = eng.runner.execute
    calls = []

    def fails_at_third_step(out):
        calls.append(len(out.scheduled))
        if len(calls) == 3:
            raise RuntimeError("injected transient fault")
        return original(out)

    eng.runner.execute = fails_at_third_step
    try:
        hs = enqueue_at_once(eng, prompts, _greedy(6))
        assert [h.result(300).output_token_ids for h in hs] == refs
        assert calls[2] == 3 and calls[3] + calls[4] == 3, "the failed step was not retried in halves"
        _assert_at_rest(eng, 32)
    finally:
        eng.close()


@pytest.mark.timeout(600)
def test_stop_checker_raising_fails_only_its_request(caplog):
    model = build_model("llama")
    prompts = random_prompts([7, 10], seed=5)
    refs = [reference_greedy(model, p, 8) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=32)))

    def broken_checker(req):
        if len(req.output_token_ids) == 3:
            raise ValueError("stop checker broke")
        return False

    try:
        bad = eng.submit(prompts[0], _greedy(8), stop_checker=broken_checker)
        good = eng.submit(prompts[1], _greedy(8))
        with caplog.at_level("ERROR", logger="hf_contbatch"):
            with pytest.raises(EngineError, match="after 3 generated tokens: .*stop checker broke") as info:
                bad.result(300)
        assert info.value.output.output_token_ids == refs[0][:3]
        # The engine's log counts the tokens the request keeps, as the handle's error does (the
        # token the checker raised on is the third, kept).
        assert f"request {bad.request_id} failed after 3 generated tokens" in caplog.text
        assert good.result(300).output_token_ids == refs[1]
        _assert_at_rest(eng, 32)
    finally:
        eng.close()


@pytest.mark.timeout(600)
def test_pool_exhausted_mid_decode_finishes_with_length_and_keeps_the_tokens():
    """At the third step everything free is taken outside the scheduler. The later request is
    preempted to make room; the earlier one runs until nothing is left to preempt, then stops at
    the pool wall with "length" and its tokens; once its blocks are back the other one finishes."""
    model = build_model("llama")
    prompts = random_prompts([6, 5], seed=7)
    refs = [reference_greedy(model, prompts[0], 30), reference_greedy(model, prompts[1], 6)]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=24)))
    original = eng.runner.execute
    steps = []
    hog = -99

    def hog_after_second_step(out):
        got = original(out)
        steps.append(1)
        if len(steps) == 2:
            eng.block_manager.allocate(hog, eng.block_manager.num_free_blocks * 4)
        return got

    eng.runner.execute = hog_after_second_step
    try:
        # Submitted one after the other, the engine could step between them on a loaded machine, and
        # the hog then walled the second request too (4 of its 6 tokens).
        first, second = enqueue_at_once(eng, prompts, [_greedy(30), _greedy(6)])
        out = first.result(300)
        assert out.finish_reason == "length"
        assert 2 <= len(out.output_token_ids) < 30
        assert out.output_token_ids == refs[0][: len(out.output_token_ids)]
        assert second.result(300).output_token_ids == refs[1]
        assert eng.scheduler.counters.num_pool_wall_stops == 1
        eng.block_manager.free(hog)
        _assert_at_rest(eng, 24)
        assert eng.submit(prompts[0], _greedy(30)).result(300).output_token_ids == refs[0]
    finally:
        eng.close()


@pytest.mark.timeout(600)
def test_cancel_racing_finish_gives_cancelled_prefix_or_full_output_never_an_error():
    model = build_model("llama")
    prompts = random_prompts([4, 6, 8, 5, 7, 9], seed=8)
    refs = [reference_greedy(model, p, 6) for p in prompts]
    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=48)))
    try:
        hs = [eng.submit(p, _greedy(6)) for p in prompts]

        # Cancel each request from another thread as its last tokens arrive (before, at or after
        # its finish), and one of them twice after it finished.
        def canceller(h, after):
            for i, _ in enumerate(h.token_stream()):
                if i + 1 >= after:
                    h.cancel()
            h.cancel()
            h.cancel()

        threads = [threading.Thread(target=canceller, args=(h, 5 + i % 2)) for i, h in enumerate(hs)]
        for t in threads:
            t.start()
        outs = [h.result(300) for h in hs]
        for t in threads:
            t.join(150)
        for o, ref in zip(outs, refs):
            assert o.finish_reason in ("cancelled", "length")
            assert o.output_token_ids == (ref if o.finish_reason == "length" else ref[: len(o.output_token_ids)])
        _assert_at_rest(eng, 48)
        assert eng.submit(prompts[0], _greedy(6)).result(300).output_token_ids == refs[0]
    finally:
        eng.close()


@pytest.mark.timeout(900)
def test_streamer_raising_fails_its_call_and_a_background_request_is_exact(embedded):
    from hf_contbatch import ContinuousBatchingPipeline

    model, tok = embedded
    bg_text, fg_text = "The value of a key", "A module is"
    bg_ref = reference_greedy(model, tok(bg_text)["input_ids"], 40)
    fg_ref = reference_greedy(model, tok(fg_text)["input_ids"], 12)

    class BrokenStreamer:
        def __init__(self):
            self.seen = 0

        def put(self, value):
            self.seen += 1
            if self.seen == 4:  # the prompt, then three tokens
                raise OSError("the display went away")

        def end(self):
            pass

    pipe = ContinuousBatchingPipeline(model, tok, engine_config=EngineConfig(cache=CacheConfig(num_blocks=64)))
    try:
        bg = pipe.submit(bg_text, max_new_tokens=40, do_sample=False, ignore_eos=True)
        with pytest.raises(OSError, match="display went away"):
            pipe(fg_text, streamer=BrokenStreamer(), max_new_tokens=12, do_sample=False, ignore_eos=True)
        assert bg.handles[0].result(300).output_token_ids == bg_ref
        _assert_at_rest(pipe.engine, 64)
        out = pipe(fg_text, max_new_tokens=12, do_sample=False, ignore_eos=True, return_tensors=True)
        assert out[0]["generated_token_ids"][-12:] == fg_ref
    finally:
        pipe.close()


# --- 3. interrupts are local ---------------------------------------------------------------------------
def _interrupt_when(predicate, timeout: float = 300.0) -> threading.Thread:
    """Start a thread that sends a real SIGINT-style interrupt to the main thread once ``predicate()``."""

    def run():
        deadline = time.monotonic() + timeout
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.005)
        _thread.interrupt_main()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(1200)
def test_interrupting_blocking_calls_twice_cancels_only_their_requests(embedded, sigint_raises):
    from hf_contbatch import ContinuousBatchingPipeline

    model, tok = embedded
    bg_text, fg_text = "The value of a key", "A module is"
    bg_ids, fg_ids = tok(bg_text)["input_ids"], tok(fg_text)["input_ids"]
    # The background request should outlive both interrupted calls (300 tokens; 80 finished before
    # the first interrupt landed on a fast day), but how far it gets depends on the machine: the
    # checks below ask only that the interrupts did not cancel it.
    bg_ref = reference_greedy(model, bg_ids, 300)
    fg_long = reference_greedy(model, fg_ids, 120)  # before the pipeline: it switches the model's attention
    pipe = ContinuousBatchingPipeline(model, tok, engine_config=EngineConfig(cache=CacheConfig(num_blocks=64)))
    eng = pipe.engine

    main_thread = threading.get_ident()

    def fg_running_with_tokens():
        # Only while the main thread runs an iteration inside the blocking call: the submitted
        # request of call 2 already decodes in the background before the main thread enters
        # ``result()``, and an interrupt landing earlier (in ``Thread.start``) escapes the test.
        return eng.driver._iterating_thread == main_thread and any(
            r.prompt_token_ids == fg_ids and len(r.output_token_ids) >= 3 for r in list(eng.scheduler.running)
        )

    try:
        bg = pipe.submit(bg_text, max_new_tokens=300, do_sample=False, ignore_eos=True)
        # 1: a blocking pipe(...) call, interrupted mid-decode.
        t = _interrupt_when(fg_running_with_tokens)
        with pytest.raises(KeyboardInterrupt):
            pipe(fg_text, max_new_tokens=120, do_sample=False, ignore_eos=True)
        t.join(25)
        assert not any(r.prompt_token_ids == fg_ids for r in eng.scheduler.all_requests()), (
            "the interrupted call's request is still in the engine"
        )
        assert not bg.done() or bg.finish_reasons() == ["length"], "the interrupt cancelled the background request"
        # 2: right after, a blocking result() on a submitted request, interrupted again.
        fg = pipe.submit(fg_text, max_new_tokens=120, do_sample=False, ignore_eos=True)
        t = _interrupt_when(fg_running_with_tokens)
        with pytest.raises(KeyboardInterrupt):
            fg.result()
        t.join(25)
        assert fg.done() and fg.finish_reasons() == ["cancelled"]
        partial = fg.handles[0].output().output_token_ids
        assert 3 <= len(partial) < 120 and partial == fg_long[: len(partial)]
        assert fg.result()[0]["generated_text"].startswith(fg_text) and len(fg.result()[0]["generated_text"]) > len(
            fg_text
        )
        # The background request runs to completion, exactly; nothing leaked; the next call works.
        assert bg.handles[0].result(600).output_token_ids == bg_ref
        _assert_at_rest(eng, 64)
        out = pipe(fg_text, max_new_tokens=10, do_sample=False, ignore_eos=True, return_tensors=True)
        assert out[0]["generated_token_ids"][-10:] == fg_long[:10]
    finally:
        pipe.close()


# --- 4. memory stays flat --------------------------------------------------------------------------
def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.timeout(600)
def test_packed_linear_memory_is_bounded_whatever_the_row_counts():
    """Every row count 1..1024 through one packed linear, as a serving engine produces them. oneDNN
    keeps a primitive per input shape (~0.6 MB measured), so unpadded this grew RSS by about
    600 MiB; padded to at most 64 shapes it must stay under 64 MiB. The outputs stay F.linear's."""
    from hf_contbatch.kernels.linears import onednn_available, pack_linears

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN packed-linear ops")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 96))
    packed = pack_linears(model, "onednn")
    try:
        with torch.inference_mode():
            model(torch.randn(1, 128))
            before = _rss_mib()
            for m in range(1, 1025):
                x = torch.randn(1, m, 128)
                y = model(x)
                if m in (1, 16, 17, 37, 100, 1000):
                    want = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
                    assert y.shape == want.shape and torch.allclose(y, want, rtol=1e-4, atol=1e-5)
            growth = _rss_mib() - before
    finally:
        packed.restore()
    assert growth <= 64, f"RSS grew {growth:.0f} MiB over 1,024 row counts"


@pytest.mark.timeout(1200)
def test_short_soak_keeps_memory_flat_and_leaves_nothing_behind(embedded):
    """Six waves of 50 soak requests (benchmarks/soak.py) on the float32 embedded model (packed
    linears): everything finishes, no block is held at rest, and after two warm-up waves the next
    four grow RSS by at most 64 MiB, what the packed linears' bounded shapes can still add (at most
    64 row counts x 5 weight shapes x ~0.6 MB, most seen in the warm-up). Measured: 39 MiB here;
    the 10,000-request soak grows 136 MiB and levels off (+7 MiB over its last 5 waves). The
    unbounded shape cache grew 64-69 MiB in these four waves and ~660 MiB over 10,000 requests,
    still rising; the test above isolates that leak."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from soak import run_soak

    from hf_contbatch import ContinuousBatchingPipeline

    model, tok = embedded
    pipe = ContinuousBatchingPipeline(model, tok, engine_config=EngineConfig(cache=CacheConfig(num_blocks=256)))
    try:
        assert pipe.engine.packed_linears is not None, "this test is about the packed-linear path"
        res = run_soak(pipe, num_requests=300, wave_size=50, seed=1)
    finally:
        pipe.close()
    assert res["unfinished"] == 0 and res["errors"] == 0
    assert res["used_blocks_at_rest"] == [0] * 6
    growth = res["rss_mb"][-1] - res["rss_mb"][1]
    assert growth <= 64, f"RSS grew {growth:.1f} MiB over four waves after warm-up: {res['rss_mb']}"
