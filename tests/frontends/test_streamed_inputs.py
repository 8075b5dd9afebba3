"""Inputs of any size (frontends/streamed_call.py): generators, ``datasets`` columns, ``KeyDataset``
and other map-style datasets are pulled lazily with a bounded number of prompts in flight, records
come back in input order, and leaving early or a bad element leaves no request running and no block
held. Expected records come from transformers' own text-generation pipeline (float32, greedy)."""

from __future__ import annotations

import types

import datasets
import pytest
import torch
import transformers
from transformers.pipelines.pt_utils import KeyDataset

import hf_contbatch
from hf_contbatch import CacheConfig, SchedulerConfig
from hf_contbatch.default_model import default_model_path

from conftest import ROOT

PROMPTS = ["The for statement", "A class is a", "Exceptions are raised when", "import"]
GREEDY = dict(do_sample=False, max_new_tokens=5, progress_bar=False)
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def hf_pipe():
    return transformers.pipeline("text-generation", model=default_model_path(), dtype=torch.float32)


@pytest.fixture(scope="module")
def expected(hf_pipe):
    kw = {k: v for k, v in GREEDY.items() if k != "progress_bar"}
    return [hf_pipe(p, **kw) for p in PROMPTS]


@pytest.fixture(scope="module")
def pipe():
    p = hf_contbatch.pipeline(
        "text-generation",
        model=default_model_path(),
        dtype=torch.float32,
        cache_config=CacheConfig(block_size=8, num_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=64),
    )
    yield p
    p.close()


def assert_all_free(pipe):
    """Every block free and nothing queued or running (the call leaked nothing)."""
    assert pipe.engine.wait_idle(10)
    stats = pipe.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0


class Counting:
    """A generator of ``n`` prompts (cycling ``PROMPTS``) that counts how many were pulled."""

    def __init__(self, n: int):
        self.n = n
        self.pulled = 0

    def __iter__(self):
        for i in range(self.n):
            self.pulled += 1
            yield PROMPTS[i % len(PROMPTS)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch_size", [None, 6])
def test_a_generator_of_ten_thousand_yields_its_first_record_after_a_bounded_pull(pipe, expected, batch_size):
    source = Counting(10_000)
    kwargs = dict(GREEDY) if batch_size is None else dict(GREEDY, batch_size=batch_size)
    out = pipe(iter(source), **kwargs)
    assert isinstance(out, types.GeneratorType)
    assert source.pulled == 0  # lazy: nothing is pulled before the first record is asked for
    first = [next(out) for _ in range(len(PROMPTS))]
    assert first == expected
    bound = 4 * MAX_NUM_SEQS if batch_size is None else batch_size
    assert source.pulled <= bound + len(PROMPTS)  # at most `bound` in flight after each record taken
    out.close()  # leaving early cancels what was in flight
    assert_all_free(pipe)
    assert pipe(PROMPTS[0], **GREEDY) == expected[0]  # and the pipeline keeps serving


@pytest.mark.timeout(120)
def test_return_types_match_transformers_pipeline(pipe, hf_pipe):
    kw = dict(do_sample=False, max_new_tokens=2)
    for make in (lambda: list(PROMPTS), lambda: (p for p in PROMPTS)):
        ours, theirs = pipe(make(), progress_bar=False, **kw), hf_pipe(make(), **kw)
        assert isinstance(ours, list) == isinstance(theirs, list)
        assert list(ours) == list(theirs)
    ours = pipe(KeyDataset(datasets.Dataset.from_dict({"text": PROMPTS}), "text"), progress_bar=False, **kw)
    theirs = hf_pipe(KeyDataset(datasets.Dataset.from_dict({"text": PROMPTS}), "text"), **kw)
    assert not isinstance(ours, list) and not isinstance(theirs, list)
    assert list(ours) == list(theirs)


@pytest.mark.timeout(120)
def test_key_dataset_datasets_column_and_list_with_batch_size_give_transformers_records(pipe, expected):
    ds = datasets.Dataset.from_dict({"text": PROMPTS * 3, "id": list(range(12))})
    assert list(pipe(KeyDataset(ds, "text"), **GREEDY)) == expected * 3
    assert list(pipe(ds["text"], **GREEDY)) == expected * 3
    assert pipe(PROMPTS * 3, batch_size=2, **GREEDY) == expected * 3  # a list stays a list
    assert_all_free(pipe)


@pytest.mark.timeout(120)
def test_records_come_in_input_order_when_later_inputs_finish_first(pipe, hf_pipe):
    # The first input generates 40 tokens, the others 1: they finish long before it, and wait.
    lengths = [40] + [1] * 11
    prompts = [PROMPTS[i % 4] for i in range(len(lengths))]
    got = list(pipe(iter(prompts), do_sample=False, max_new_tokens=lengths, progress_bar=False, batch_size=8))
    assert got == [hf_pipe(p, do_sample=False, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    assert_all_free(pipe)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "bad, match",
    [
        (7, r"input 5: must be a string or a chat .* got int"),
        ({"text": "x", "id": 1}, r"input 5: .* dataset row with the keys 'text', 'id'.*KeyDataset"),
        ("word " * 2000, r"input 5: .*context"),
    ],
)
def test_a_bad_element_is_named_by_index_earlier_records_come_and_nothing_leaks(pipe, expected, bad, match):
    elements = PROMPTS + PROMPTS[:1] + [bad] + PROMPTS
    got = []
    with pytest.raises(ValueError, match=match):
        for records in pipe(iter(elements), batch_size=3, **GREEDY):
            got.append(records)
    assert got == expected + expected[:1]
    assert_all_free(pipe)
    assert list(pipe(iter(PROMPTS), **GREEDY)) == expected


@pytest.mark.parametrize("batch_size", [3, None])
def test_a_generator_that_raises_yields_the_records_of_every_input_before_and_leaks_nothing(pipe, expected, batch_size):
    # transformers' pipeline yields a record per input pulled before the input's own exception; so
    # must a streamed call, as it does for a bad element: the five inputs pulled are not lost.
    def flaky():
        yield from PROMPTS + PROMPTS[:1]
        raise KeyError("the input broke")

    got = []
    with pytest.raises(KeyError, match="the input broke"):
        for records in pipe(flaky(), batch_size=batch_size, **GREEDY):
            got.append(records)
    assert got == expected + expected[:1]
    assert_all_free(pipe)


@pytest.mark.timeout(120)
def test_per_input_lists_follow_a_streamed_input_and_wrong_lengths_are_named(pipe, hf_pipe):
    lengths = [3, 1, 2, 4, 1, 2]
    prompts = [PROMPTS[i % 4] for i in range(6)]
    got = list(pipe(iter(prompts), do_sample=False, max_new_tokens=lengths, batch_size=2, progress_bar=False))
    assert got == [hf_pipe(p, do_sample=False, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    with pytest.raises(ValueError, match="`max_new_tokens` has 2 entries"):
        list(pipe(iter(prompts), do_sample=False, max_new_tokens=[1, 2], batch_size=2, progress_bar=False))
    with pytest.raises(ValueError, match="`priority` has 7 entries for 6 inputs"):
        list(pipe(iter(prompts), priority=[0] * 7, **GREEDY))
    with pytest.raises(ValueError, match="batch_size"):
        pipe(iter(prompts), batch_size=0, **GREEDY)
    source = Counting(3)
    with pytest.raises(ValueError, match="^`temperature` must be"):  # the call's error, raised by the call
        pipe(iter(source), do_sample=True, temperature=-1.0)
    assert source.pulled == 0
    assert_all_free(pipe)


@pytest.mark.timeout(120)
def test_breaking_out_while_requests_run_cancels_them(pipe):
    out = pipe(iter(PROMPTS * 10), do_sample=False, max_new_tokens=30, progress_bar=False)
    next(out)
    del out  # collected: the generator's cleanup cancels the call's requests in flight
    assert_all_free(pipe)
    assert pipe.last_call_stats["num_requests"] == 1
    # The latency of the one sequence yielded, from its metrics (TTFT within the call's time).
    yielded = pipe.last_call_stats
    assert 0 < yielded["ttft_s"] <= yielded["seconds"] and yielded["itl_s"] > 0


@pytest.mark.timeout(120)
def test_an_input_the_engine_fails_is_named_with_its_partial_records_after_the_earlier_ones(pipe, expected):
    from transformers import StoppingCriteria

    from hf_contbatch.engine.handles import EngineError

    marker = pipe.tokenizer.encode("Exceptions are raised when", add_special_tokens=False)

    class FailsOneInput(StoppingCriteria):
        """Raises inside the engine for the input whose prompt is PROMPTS[2], at its second token."""

        def __call__(self, input_ids, scores, **kwargs):
            ids = input_ids[0].tolist()
            if ids[-len(marker) - 2 : -2] == marker:
                raise RuntimeError("criteria broke")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    got = []
    with pytest.raises(EngineError, match="input 2: .*criteria broke") as info:
        for records in pipe(iter(PROMPTS * 2), stopping_criteria=[FailsOneInput()], batch_size=3, **GREEDY):
            got.append(records)
    assert got == expected[:2]
    (partial,) = info.value.partial_results
    assert expected[2][0]["generated_text"].startswith(partial["generated_text"])
    assert_all_free(pipe)
    assert list(pipe(iter(PROMPTS), **GREEDY)) == expected


@pytest.mark.timeout(600)
def test_a_stream_abandoned_until_interpreter_exit_ends_without_a_traceback(tmp_path):
    # The generator's finally block runs at shutdown, after the modules' globals were cleared; it
    # printed "Exception ignored in: <generator ...> AttributeError: 'NoneType' object has no
    # attribute 'monotonic'" (found by a newcomer run).
    import os
    import subprocess
    import sys

    script = tmp_path / "abandon.py"
    script.write_text(
        "import hf_contbatch\n"
        "pipe = hf_contbatch.pipeline('text-generation', progress_bar=False)\n"
        "stream = pipe((f'Prompt {i}' for i in range(20)), max_new_tokens=4, do_sample=False)\n"
        "first = next(iter(stream))\n"
        "print('first', len(first))\n",
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=500, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "first 1"
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
