"""Streaming: text deltas that never split a character, never show a stop string, cost O(length),
and an asyncio interface; expected texts come from the tokenizer's full decode and from
transformers' own pipeline/streamers."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

from hf_contbatch import CacheConfig, ContinuousBatchingPipeline, EngineConfig
from hf_contbatch.default_model import default_model_path
from hf_contbatch.frontends.streaming import (
    DecodeStreamDetokenizer,
    IncrementalDetokenizer,
    StopStringHoldback,
    make_detokenizer,
    text_deltas,
)

MULTIBYTE = "def 函数(): return '🐍✨'  # 中文注释, émoji 👩\u200d💻 naïve — ok"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def pipe():
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    p = ContinuousBatchingPipeline(
        model, default_model_path(), engine_config=EngineConfig(cache=CacheConfig(num_blocks=256))
    )
    yield p
    p.close()


@pytest.fixture(scope="module")
def reference_pipe():
    import transformers

    return transformers.pipeline("text-generation", model=default_model_path(), dtype=torch.float32)


@pytest.mark.timeout(300)
def test_byte_level_tokenizer_splits_characters_across_tokens(tokenizer):
    # The premise of the multi-byte tests: single tokens decode to U+FFFD for CJK and emoji.
    ids = tokenizer(MULTIBYTE, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.timeout(300)
def test_deltas_of_multibyte_text_have_no_replacement_char_and_concatenate_to_full_decode(tokenizer):
    ids = tokenizer(MULTIBYTE, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [d for d in (detok.add([i]) for i in ids) if d] + [detok.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE


@pytest.mark.timeout(300)
def test_fast_tokenizers_stream_through_the_tokenizers_decode_stream(tokenizer):
    assert tokenizer.is_fast
    detok = make_detokenizer(tokenizer)
    assert isinstance(detok, DecodeStreamDetokenizer)
    ids = tokenizer(MULTIBYTE, add_special_tokens=False)["input_ids"]
    deltas = [d for d in (detok.add([i]) for i in ids) if d] + [detok.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE
    # DecodeStream does not clean up tokenization spaces: that case keeps our windowed decoder.
    assert isinstance(make_detokenizer(tokenizer, clean_up_tokenization_spaces=True), IncrementalDetokenizer)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_deltas_are_independent_of_how_tokens_are_batched(tokenizer, chunk):
    ids = tokenizer(MULTIBYTE * 2, add_special_tokens=False)["input_ids"]
    batches = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    deltas = list(text_deltas(batches, tokenizer))
    assert "".join(deltas) == MULTIBYTE * 2
    assert all(d and "\ufffd" not in d for d in deltas)


@pytest.mark.timeout(300)
def test_incremental_detokenization_decodes_a_bounded_window_per_token(tokenizer):
    # O(n): the tokens decoded over a whole stream grow linearly, not quadratically, with its length.
    class CountingTokenizer:
        def __init__(self, tok):
            self.tok, self.decoded = tok, 0

        def decode(self, ids, **kw):
            self.decoded += len(ids)
            return self.tok.decode(ids, **kw)

    ids = tokenizer((MULTIBYTE + " The for statement iterates over a sequence.\n") * 20, add_special_tokens=False)[
        "input_ids"
    ]
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    for i in ids:
        detok.add([i])
    per_token_before_finish = counting.decoded / len(ids)
    assert per_token_before_finish < 12, per_token_before_finish  # a full re-decode would be ~len(ids)/2 = hundreds
    assert detok.text + detok.finish() == tokenizer.decode(ids)


@pytest.mark.timeout(300)
def test_holdback_never_releases_any_part_of_a_stop_string():
    text = "value = a + b\nSTOP here; STOP again"
    stop = ["STOP", "\n\n"]
    expected = text[: text.find("STOP")]
    # every way of cutting the text into three chunks
    for i, j in itertools.combinations(range(1, len(text)), 2):
        hold = StopStringHoldback(stop)
        released = ""
        for piece in (text[:i], text[i:j], text[j:]):
            released += hold.feed(piece)
            assert expected.startswith(released)  # never a character of the stop string or past it
        released += hold.flush()
        assert released == expected


@pytest.mark.timeout(300)
def test_holdback_releases_a_stop_string_prefix_that_did_not_become_one():
    hold = StopStringHoldback(["STOP"])
    assert hold.feed("a ST") == "a "
    assert hold.feed("O") == ""
    assert hold.feed("P") == ""  # "STOP" complete: stopped, nothing of it released
    assert hold.stopped
    hold = StopStringHoldback(["STOP"])
    assert hold.feed("a STO") == "a "
    assert hold.feed("RM") == "STORM"
    hold = StopStringHoldback(["STOP"])
    assert hold.feed("x ST") == "x "
    assert hold.flush() == "ST"  # ended by EOS/length: the held text was never a stop string


@pytest.mark.timeout(600)
def test_stream_without_stop_strings_concatenates_to_generated_text(pipe):
    handle = pipe.submit("The for statement", max_new_tokens=48, do_sample=False, return_full_text=False)
    deltas = list(handle)
    assert "".join(deltas) == handle.result()[0]["generated_text"]
    assert all(deltas)


@pytest.mark.timeout(900)
def test_stream_stops_before_the_stop_string_and_generated_text_keeps_it_like_transformers(pipe, reference_pipe):
    # A stop string the greedy continuation is known to produce, first seen after some text.
    for prompt in ("A class is", "The for statement", "Exceptions are", "A dictionary"):
        free = reference_pipe(prompt, max_new_tokens=40, do_sample=False, return_full_text=False)[0]["generated_text"]
        starts = [i for i in range(2, len(free) - 1) if free.find(free[i : i + 2]) == i]
        if starts:
            stop = free[starts[0] : starts[0] + 2]
            break
    else:
        pytest.fail("no greedy continuation with a usable stop string")
    # transformers' pipeline takes stop strings as stop_sequence (its stop_strings needs a tokenizer it lacks)
    expected = reference_pipe(prompt, max_new_tokens=40, do_sample=False, stop_sequence=stop, return_full_text=False)
    handle = pipe.submit(prompt, max_new_tokens=40, do_sample=False, stop_strings=[stop], return_full_text=False)
    streamed = "".join(handle)
    records = handle.result()
    assert records == expected  # transformers keeps the stop string in generated_text
    text = records[0]["generated_text"]
    assert stop in text
    assert streamed == text[: text.find(stop)] == free[: starts[0]]
    assert handle.finish_reasons() == ["stop"]


@pytest.mark.timeout(600)
def test_astream_yields_the_same_deltas_as_the_blocking_stream(pipe):
    kwargs = dict(max_new_tokens=32, do_sample=False, return_full_text=False)
    sync = list(pipe.submit("The with statement", **kwargs))

    async def collect():
        handle = pipe.submit("The with statement", **kwargs)
        deltas = [d async for d in handle.astream()]
        return deltas, await handle.aresult()

    deltas, records = asyncio.run(collect())
    assert deltas == sync
    assert "".join(deltas) == records[0]["generated_text"]


@pytest.mark.timeout(600)
def test_leaving_pipe_astream_early_cancels_the_request(pipe):
    async def first_delta():
        gen = pipe.astream("Exceptions are", max_new_tokens=200, ignore_eos=True, do_sample=False)
        first = await gen.__anext__()
        await gen.aclose()
        return first

    assert asyncio.run(first_delta())
    assert pipe.engine.wait_idle(60)  # the cancelled request left the engine
    assert pipe.stats().num_used_blocks == 0


@pytest.mark.timeout(600)
def test_astream_does_not_block_the_event_loop(pipe):
    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        text = "".join(
            [d async for d in pipe.astream("The import system", max_new_tokens=48, ignore_eos=True, do_sample=False)]
        )
        stop.set()
        await task
        return ticks, text

    ticks, text = asyncio.run(main())
    assert text and ticks > 1


@pytest.mark.timeout(900)
def test_text_iterator_streamer_receives_what_transformers_pipeline_sends_it(pipe, reference_pipe, tokenizer):
    def run(p):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=300)
        result = {}
        worker = threading.Thread(
            target=lambda: result.setdefault(
                "r", p("Lambda expressions", max_new_tokens=32, do_sample=False, streamer=streamer)
            )
        )
        worker.start()
        text = "".join(streamer)
        worker.join(300)
        return text, result["r"]

    ours_text, ours_records = run(pipe)
    ref_text, ref_records = run(reference_pipe)
    assert ours_text == ref_text
    assert ours_records == ref_records


@pytest.mark.timeout(300)
def test_streamer_with_several_prompts_is_rejected_as_in_generate(pipe, tokenizer):
    with pytest.raises(ValueError, match="single prompt"):
        pipe(["a", "b"], max_new_tokens=4, streamer=TextIteratorStreamer(tokenizer))
