"""What a notebook user meets next: per-prompt max_new_tokens, leaving a stream early, Stop, and a
progress bar that states rates and its outcome. Expected texts come from transformers' pipeline."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

from hf_contbatch import CacheConfig, ContinuousBatchingPipeline, EngineConfig
from hf_contbatch.default_model import default_model_path

PROMPTS = ["The for statement", "A class is a", "Exceptions are raised when"]


@pytest.fixture(scope="module")
def pipe():
    # The background thread does every iteration, so a Stop lands in the caller's wait, not in a step.
    p = ContinuousBatchingPipeline(
        default_model_path(),
        dtype=torch.float32,
        engine_config=EngineConfig(cache=CacheConfig(num_blocks=256), drive_in_caller=False, linear_backend="torch"),
    )
    yield p
    p.close()


def _sigint_after(event: threading.Event) -> threading.Thread:
    """SIGINT to this process (what Jupyter's Stop sends the kernel) once ``event`` is set."""

    def fire():
        if event.wait(300):
            os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(900)
def test_max_new_tokens_per_prompt_equals_transformers_per_prompt(pipe):
    reference = transformers.pipeline("text-generation", model=default_model_path(), dtype=torch.float32)
    lengths = [3, 9, 5]
    got = pipe(PROMPTS, max_new_tokens=lengths, do_sample=False, progress_bar=False)
    assert got == [reference(p, max_new_tokens=n, do_sample=False) for p, n in zip(PROMPTS, lengths)]
    handle = pipe.submit(PROMPTS[0], max_new_tokens=[4], do_sample=False, ignore_eos=True)
    assert len(handle.handles[0].result(timeout=300).output_token_ids) == 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "value, message", [([3, 4], "2 entries for 3 prompts"), ([3, 0, 2], "int >= 1"), ([3, "4", 2], "int >= 1")]
)
def test_bad_per_prompt_max_new_tokens_names_the_argument_and_submits_nothing(pipe, value, message):
    before = pipe.stats().num_iterations
    with pytest.raises(ValueError, match=f"max_new_tokens.*{message}"):
        pipe(PROMPTS, max_new_tokens=value)
    stats = pipe.stats()
    assert stats.num_waiting == stats.num_running == 0 and stats.num_iterations == before


@pytest.mark.timeout(600)
def test_breaking_out_of_a_stream_nobody_holds_cancels_the_request(pipe):
    handle = pipe.submit("Exceptions are", max_new_tokens=300, ignore_eos=True, do_sample=False)
    request = handle.handles[0]
    deltas = iter(handle)
    del handle  # as in `for delta in pipe.submit(...)`: only the loop holds the handle
    assert next(deltas)
    del deltas  # `break`: the loop drops its iterator
    out = request.result(timeout=300)
    assert out.finish_reason == "cancelled" and 0 < len(out.output_token_ids) < 300
    assert pipe.engine.wait_idle(30) and pipe.stats().num_used_blocks == 0

    generated = pipe.stats().num_generated_tokens
    for _delta in pipe.submit("Lists are", max_new_tokens=300, ignore_eos=True, do_sample=False):  # the literal form
        break
    assert pipe.engine.wait_idle(60)
    assert pipe.stats().num_generated_tokens - generated < 300


@pytest.mark.timeout(600)
def test_breaking_out_of_a_stream_keeps_a_held_handle_generating(pipe):
    handle = pipe.submit("Exceptions are", max_new_tokens=40, ignore_eos=True, do_sample=False)
    for _delta in handle:
        break
    assert handle.result()[0]["generated_text"].startswith("Exceptions are")
    assert handle.finish_reasons() == ["length"]
    assert len(handle.handles[0].request.output_token_ids) == 40


@pytest.mark.timeout(600)
def test_stop_while_streaming_cancels_that_request_and_reraises(pipe, sigint_raises):
    other = pipe.submit("Lists are", max_new_tokens=60, ignore_eos=True, do_sample=False)
    handle = pipe.submit("Exceptions are", max_new_tokens=400, ignore_eos=True, do_sample=False)
    first = threading.Event()
    _sigint_after(first)
    with pytest.raises(KeyboardInterrupt, match="cancelled") as stopped:
        for _delta in handle:
            first.set()
    assert {Path(str(e.path)).name for e in stopped.traceback} <= {Path(__file__).name, "generation_handle.py"}
    assert handle.handles[0].result(timeout=300).finish_reason == "cancelled"
    assert other.result()  # the other request is not affected
    assert other.finish_reasons() == ["length"] and len(other.handles[0].request.output_token_ids) == 60


@pytest.mark.timeout(900)
def test_progress_bar_states_rates_and_closes_with_the_outcome(pipe, capsys, sigint_raises):
    pipe(PROMPTS, max_new_tokens=6, do_sample=False, progress_bar=True)
    done = capsys.readouterr().err.strip().split("\r")[-1]
    assert "3/3" in done and " req/s, " in done and " tok/s" in done and "s/req" not in done
    if hasattr(os, "getloadavg"):  # the rates depend on the machine's load: shown beside them (issue 48)
        assert re.search(r" tok/s, load \d+\.\d\d on \d+ cores?", done), done

    base = pipe.stats().num_generated_tokens
    started = threading.Event()

    def watch():  # the call is generating: its tokens show in the engine's stats
        while not started.is_set():
            if pipe.stats().num_generated_tokens > base + 8:
                started.set()
            threading.Event().wait(0.01)

    threading.Thread(target=watch, daemon=True).start()
    _sigint_after(started)
    with pytest.raises(KeyboardInterrupt, match="of this call's 12 requests cancelled") as stopped:
        pipe(PROMPTS * 4, max_new_tokens=400, ignore_eos=True, do_sample=False, progress_bar=True)
    # a short traceback: this test and the pipeline's own frames, nothing from torch or a queue wait
    assert {Path(str(e.path)).name for e in stopped.traceback} <= {Path(__file__).name, "pipeline.py", "progress.py"}
    line = capsys.readouterr().err.strip().split("\r")[-1]
    assert "hf_contbatch interrupted: " in line and "cancelled" in line and ": :" not in line, line
    # no request finished, but more than 8 tokens were generated before Stop: the rate counts them
    assert "0/12" in line and int(re.search(r"(\d+) tok/s", line).group(1)) > 0, line
    assert pipe.engine.wait_idle(60) and pipe.stats().num_used_blocks == 0


@pytest.mark.timeout(600)
def test_loading_a_model_shows_no_notices_of_optional_quantization_libraries():
    # With torchao installed (the quant extra), transformers imports it on every load and torchao
    # logs a notice per CUDA-only extension it cannot load here: a red box in a notebook cell.
    code = "import hf_contbatch; p = hf_contbatch.pipeline(); print(p('x', max_new_tokens=1)[0]['generated_text']); p.close()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=550)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Failed to load" not in proc.stderr and "_pytree" not in proc.stderr, proc.stderr


def _decimals(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


@pytest.mark.timeout(600)
def test_stats_shown_in_a_cell_is_one_short_line_and_keeps_every_field(pipe):
    from IPython.core.formatters import PlainTextFormatter

    pipe(PROMPTS, max_new_tokens=5, do_sample=False, progress_bar=False)
    stats = pipe.stats()
    shown = PlainTextFormatter()(stats)  # what a notebook cell ending in `pipe.stats()` prints
    assert shown == repr(stats) == str(stats)
    assert "\n" not in shown and len(shown) < 400, shown  # not the 256-entry block tuples
    assert shown.startswith("EngineStats(") and "block_owner" not in shown
    for name in ("num_used_blocks", "num_blocks", "num_running", "num_waiting", "num_finished", "num_generated_tokens"):
        assert f"{name}={getattr(stats, name)}," in shown
    rate = re.search(r"throughput_tokens_per_s=([\d.]+)", shown).group(1)
    ttft = re.search(r"mean_ttft_s=([\d.e-]+)", shown).group(1)
    assert _decimals(rate) <= 4 and float(rate) == pytest.approx(stats.throughput_tokens_per_s, rel=1e-3)
    assert float(ttft) == pytest.approx(stats.mean_ttft_s, rel=1e-3)
    # the object itself is unchanged: every field, exact
    assert len(stats.block_owner) == stats.num_blocks == 256
    assert dataclasses.asdict(stats)["num_generated_tokens"] == stats.num_generated_tokens > 0


@pytest.mark.timeout(600)
def test_last_call_stats_reads_rounded_and_holds_exact_figures(pipe, capsys):
    from IPython.core.formatters import PlainTextFormatter

    pipe(PROMPTS, max_new_tokens=[3, 9, 5], do_sample=False, progress_bar=False)
    call = pipe.last_call_stats
    assert isinstance(call, dict)
    assert set(call) == {
        "num_requests",
        "generated_tokens",
        "seconds",
        "tokens_per_s",
        "preemptions",
        "ttft_s",
        "itl_s",
    }
    assert call["num_requests"] == 3 and call["generated_tokens"] == 3 + 9 + 5
    assert call["tokens_per_s"] == call["generated_tokens"] / call["seconds"]  # exact, not the rounded figures
    print(call)
    printed = capsys.readouterr().out.strip()
    assert printed == repr(call) == PlainTextFormatter()(call)
    shown = ast.literal_eval(printed)  # still reads as the dict it is
    assert set(shown) == set(call) and shown["generated_tokens"] == 17
    assert _decimals(str(shown["seconds"])) <= 3 and _decimals(str(shown["tokens_per_s"])) <= 1
    assert shown["seconds"] == pytest.approx(call["seconds"], abs=5e-4)
    assert shown["tokens_per_s"] == pytest.approx(call["tokens_per_s"], abs=0.05)


@pytest.mark.timeout(600)
def test_a_one_prompt_call_reports_its_own_ttft_and_itl_inside_the_call_clock(pipe):
    # The test's clock around the call bounds the call's figures: a first token inside the call,
    # and TTFT plus the n - 1 gaps after it no longer than the call.
    t0 = time.monotonic()
    (record,) = pipe(PROMPTS[0], max_new_tokens=10, do_sample=False, ignore_eos=True, progress_bar=False)
    wall = time.monotonic() - t0
    call = pipe.last_call_stats
    assert call["num_requests"] == 1 and call["generated_tokens"] == 10
    assert 0 < call["ttft_s"] <= call["seconds"] <= wall
    assert 0 < call["itl_s"] and call["ttft_s"] + 9 * call["itl_s"] <= call["seconds"]
    # pipe.submit: each sequence's own metrics, the same as its RequestOutput's once finished.
    handle = pipe.submit(PROMPTS[1], max_new_tokens=6, do_sample=False, ignore_eos=True)
    handle.result()
    (metrics,) = handle.metrics()
    assert metrics == handle.handles[0].result().metrics
    assert metrics.num_generated_tokens == 6 and metrics.ttft > 0 and metrics.itl > 0
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.last_token_time
