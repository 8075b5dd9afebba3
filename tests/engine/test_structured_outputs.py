"""Structured outputs inside the continuous batch (issue 24), on the embedded model.

Expected values never come from the code under test: sampled outputs are checked with ``json.loads``
+ ``jsonschema`` or ``re.fullmatch``; greedy outputs equal transformers' ``generate`` with xgrammar's
own transformers processor (``xgrammar.contrib.hf.LogitsProcessor``), one prompt at a time."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM
from xgrammar.contrib.hf import LogitsProcessor as XgrammarProcessor

import hf_contbatch
from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from hf_contbatch.default_model import default_model_path

from conftest import validate_json

# Bounded everywhere, so that a sampled output always ends well inside max_new_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer", "maximum": 99999}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
# For greedy equality with the reference: no length-bounded strings (the engine rewrites those as a
# pattern to avoid an xgrammar bug; the reference compiles the schema as given).
GREEDY_SCHEMA = {
    "type": "object",
    "properties": {
        "role": {"enum": ["admin", "user", "guest"]},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "maximum": 999}}, "required": ["id"]},
    },
    "required": ["role", "level", "flags", "owner"],
}
REGEX = r"[A-Z][a-z]{1,6}-\d{2,3}"
CHOICES = ["positive", "negative", "neutral"]
EBNF = 'root ::= "let " name " = " num ";"\nname ::= [a-z] [a-z0-9_]{0,5}\nnum ::= [1-9] [0-9]{0,3}'
EBNF_RE = r"let [a-z][a-z0-9_]{0,5} = [1-9][0-9]{0,3};"
PROMPTS = [
    "The for statement",
    "A class is",
    "Exceptions are",
    "The import system",
    "Lambda expressions",
    "A dictionary",
    "The while statement",
    "Generators",
    "The with statement",
    "A module",
    "Decorators",
    "Strings are",
]


@pytest.fixture(scope="module")
def pipe():
    p = hf_contbatch.pipeline("text-generation", dtype=torch.float32, cache_config=CacheConfig(num_blocks=256))
    yield p
    p.close()


@pytest.fixture(scope="module")
def compiler(tok):
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=4096)  # the embedded model's LM-head rows
    return xgr.GrammarCompiler(info)


def reference(ref_model, tok, compiled, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy ``generate`` under xgrammar's own transformers processor (a new one per call)."""
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = ref_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            logits_processor=[XgrammarProcessor(compiled)],
        )
    return out[0, ids.shape[1] :].tolist()


def token_ids(handle) -> list[list[int]]:
    handle.result()
    return [h.request.output_token_ids for h in handle.handles]


def assert_nothing_left(engine):
    assert engine.wait_idle(timeout=150)
    assert engine.grammars.num_tracked == 0, "a grammar matcher outlived its request"
    assert engine.sampler._states == {}
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "a KV block leaked"


def texts(records) -> list[str]:
    return [r["generated_text"] for recs in records for r in recs]


# --- sampled batches: every output satisfies its constraint ---------------------------------------------
@pytest.mark.timeout(1500)
def test_sampled_json_schema_outputs_parse_and_validate(pipe):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = pipe(
        PROMPTS,
        do_sample=True,
        temperature=1.0,
        max_new_tokens=120,
        seed=3,
        response_format=fmt,
        return_full_text=False,
    )
    for text in texts(out):
        validate_json(json.loads(text), PERSON)
    assert_nothing_left(pipe.engine)


@pytest.mark.timeout(1500)
def test_sampled_regex_choice_json_object_and_grammar_outputs_match(pipe):
    kw = dict(do_sample=True, temperature=1.0, max_new_tokens=60, seed=5, return_full_text=False)
    for text in texts(pipe(PROMPTS, structured_outputs={"regex": REGEX}, **kw)):
        assert re.fullmatch(REGEX, text), text
    got = texts(pipe(PROMPTS, structured_outputs={"choice": CHOICES}, **kw))
    assert set(got) <= set(CHOICES)
    for text in texts(pipe(PROMPTS, structured_outputs={"grammar": EBNF}, **kw)):
        assert re.fullmatch(EBNF_RE, text), text
    # Any object: keys and strings are unbounded, so some samples may run to max_new_tokens; every
    # one the grammar ended ("stop") parses as an object, and most end.
    handles = [
        pipe.submit(p, response_format={"type": "json_object"}, **{**kw, "max_new_tokens": 300}) for p in PROMPTS
    ]
    results = [h.result()[0]["generated_text"] for h in handles]
    ended = [text for h, text in zip(handles, results) if h.finish_reasons() == ["stop"]]
    assert len(ended) >= len(PROMPTS) // 2
    for prompt_and_text in ended:
        assert isinstance(json.loads(prompt_and_text[prompt_and_text.index("{") :]), dict)
    assert_nothing_left(pipe.engine)


@pytest.mark.timeout(1500)
def test_forks_each_follow_the_grammar_with_their_own_matcher(pipe):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = pipe(
        PROMPTS[:3],
        do_sample=True,
        temperature=1.0,
        num_return_sequences=3,
        max_new_tokens=120,
        seed=11,
        response_format=fmt,
    )
    assert [len(recs) for recs in out] == [3, 3, 3]
    prompts = PROMPTS[:3]
    for prompt, recs in zip(prompts, out):
        for rec in recs:
            validate_json(json.loads(rec["generated_text"][len(prompt) :]), PERSON)
    assert_nothing_left(pipe.engine)


# --- greedy: equal to generate under xgrammar's own processor -------------------------------------------
@pytest.mark.timeout(1500)
def test_greedy_outputs_equal_generate_with_xgrammars_processor(pipe, ref_model, tok, compiler):
    cases = [
        ({"json": GREEDY_SCHEMA}, compiler.compile_json_schema(json.dumps(GREEDY_SCHEMA), any_whitespace=False)),
        ({"regex": REGEX}, compiler.compile_regex(REGEX)),
        ({"grammar": EBNF}, compiler.compile_grammar(EBNF)),
    ]
    for constraint, compiled in cases:
        handles = [
            pipe.submit(p, do_sample=False, max_new_tokens=48, structured_outputs=constraint) for p in PROMPTS[:4]
        ]
        for prompt, h in zip(PROMPTS[:4], handles):
            assert token_ids(h) == [reference(ref_model, tok, compiled, prompt, 48)], (constraint, prompt)
    assert_nothing_left(pipe.engine)


@pytest.mark.timeout(1500)
def test_unconstrained_request_batched_with_constrained_ones_equals_generate(pipe, ref_model, tok, compiler):
    compiled = compiler.compile_json_schema(json.dumps(GREEDY_SCHEMA), any_whitespace=False)
    constrained = [
        pipe.submit(p, do_sample=False, max_new_tokens=40, structured_outputs={"json": GREEDY_SCHEMA})
        for p in PROMPTS[:3]
    ]
    free = pipe.submit(PROMPTS[3], do_sample=False, max_new_tokens=40)
    with torch.no_grad():
        ids = tok(PROMPTS[3], return_tensors="pt")["input_ids"]
        want = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    assert token_ids(free) == [want[0, ids.shape[1] :].tolist()]
    for prompt, h in zip(PROMPTS[:3], constrained):
        assert token_ids(h) == [reference(ref_model, tok, compiled, prompt, 40)]
    assert_nothing_left(pipe.engine)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_preemption_and_prefix_caching_equals_generate(ref_model, tok, compiler, mode):
    compiled = compiler.compile_json_schema(json.dumps(GREEDY_SCHEMA), any_whitespace=False)
    cfg = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=40, enable_prefix_caching=True),
        scheduler=SchedulerConfig(preemption_mode=mode, max_num_batched_tokens=64),
    )
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)  # this engine's own
    engine = LLMEngine(model, cfg, tokenizer=tok)
    try:
        prompts = [PROMPTS[i % 4] + " and more" * (i % 3) for i in range(8)]  # shared prefixes
        sp = SamplingParams(max_new_tokens=40, eos_token_ids=(0,), structured_outputs={"json": GREEDY_SCHEMA})
        handles = [engine.submit(tok(p)["input_ids"], sp) for p in prompts]
        outs = [h.result(timeout=1200).output_token_ids for h in handles]
        stats = engine.stats()
        assert stats.num_preemptions > 0, "the pool was meant to force preemptions"
        for prompt, got in zip(prompts, outs):
            assert got == reference(ref_model, tok, compiled, prompt, 40), prompt
        assert_nothing_left(engine)
    finally:
        engine.close()


@pytest.mark.timeout(1500)
def test_constrained_greedy_requests_draft_and_keep_generates_tokens(ref_model, tok, compiler):
    schema = {
        "type": "object",
        "properties": {"name": {"enum": ["alpha", "beta_value", "gamma_delta"]}, "size": {"type": "integer"}},
        "required": ["name", "size"],
    }
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    pipe = hf_contbatch.pipeline("text-generation", dtype=torch.float32, prompt_lookup_num_tokens=4)
    try:
        prompts = [
            f'Record: {{"name": "{n}", "size": {s}}}\nAgain: '
            for n, s in (("beta_value", 12), ("gamma_delta", 7), ("alpha", 345))
        ]
        handles = [
            pipe.submit(p, do_sample=False, max_new_tokens=30, structured_outputs={"json": schema}) for p in prompts
        ]
        for prompt, h in zip(prompts, handles):
            assert token_ids(h) == [reference(ref_model, tok, compiled, prompt, 30)], prompt
        assert pipe.stats().num_draft_tokens > 0, "constrained greedy requests were meant to draft"
        assert_nothing_left(pipe.engine)
    finally:
        pipe.close()


# --- literals that must come out exactly as written (issue 33) -----------------------------------------
ODD_LITERALS = ["crlf\r\nend", "nul\x00byte", "tab\t\x0ae", 'q"uote\\', "é 日本 😀", "a.b*c+?[](){}|^$"]


@pytest.mark.timeout(1500)
def test_choice_and_json_literals_with_control_and_non_ascii_characters_come_out_exactly(pipe):
    # The expected value is the literal itself: one choice leaves the model nothing to pick, so the
    # output must be it, byte for byte (it once came out as 'crlf\r\u00aend' and 'nul\x0byte').
    for literal in ODD_LITERALS:
        for sampled in (dict(do_sample=False), dict(do_sample=True, seed=1)):
            out = pipe(
                "The answer is",
                structured_outputs={"choice": [literal]},
                max_new_tokens=20,
                return_full_text=False,
                **sampled,
            )
            assert out[0]["generated_text"] == literal, (literal, sampled)
    # a JSON schema with such property names, enum and const values: json.loads gives them back
    schema = {
        "type": "object",
        "properties": {
            ODD_LITERALS[0]: {"enum": [ODD_LITERALS[1]]},
            ODD_LITERALS[2]: {"const": ODD_LITERALS[3]},
            ODD_LITERALS[4]: {"enum": [ODD_LITERALS[5]]},
        },
        "required": ODD_LITERALS[0:5:2],
    }
    out = pipe("The answer is", structured_outputs={"json": schema}, max_new_tokens=200, return_full_text=False)
    assert json.loads(out[0]["generated_text"]) == {
        ODD_LITERALS[0]: ODD_LITERALS[1],
        ODD_LITERALS[2]: ODD_LITERALS[3],
        ODD_LITERALS[4]: ODD_LITERALS[5],
    }
    assert_nothing_left(pipe.engine)


# --- refusals, waiting for a grammar, processor factories ------------------------------------------------
@pytest.mark.timeout(600)
def test_bad_constraints_are_refused_at_submit_and_the_pipeline_keeps_serving(pipe):
    bad = [
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        dict(structured_outputs={"regex": "(unclosed"}),
        dict(structured_outputs={"grammar": "root ::= undefined_rule"}),
        dict(structured_outputs={"choice": []}),
        dict(structured_outputs={"json": {"type": "object"}, "regex": "a"}),
        dict(structured_outputs={"jsn": {}}),
        dict(response_format={"type": "xml"}),
        dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        dict(response_format=[{"type": "json_object"}], max_new_tokens=4),  # one entry for two prompts
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            pipe(["A class is", "Exceptions are"], **kwargs)
    assert pipe("A class is", do_sample=False, max_new_tokens=4, structured_outputs={"choice": ["yes", "no"]})
    assert_nothing_left(pipe.engine)


@pytest.mark.timeout(600)
def test_a_schema_repeated_over_submits_is_parsed_once_and_the_parsed_cache_is_bounded(pipe, monkeypatch):
    from hf_contbatch.engine.structured.specs import PARSED_CACHE_SIZE

    parses = []
    original = xgr.Grammar.from_json_schema

    def counting(schema, **kwargs):
        parses.append(schema)
        return original(schema, **kwargs)

    monkeypatch.setattr(xgr.Grammar, "from_json_schema", staticmethod(counting))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    handles = [  # a new dict each time, as callers building requests in a loop make them
        pipe.submit(p, do_sample=False, max_new_tokens=12, structured_outputs={"json": json.loads(json.dumps(schema))})
        for p in PROMPTS[:6]
    ]
    for h in handles:
        text = pipe.tokenizer.decode(token_ids(h)[0], skip_special_tokens=True)
        validate_json(json.loads(text), schema)
    assert len(parses) == 1
    for k in range(PARSED_CACHE_SIZE + 3):  # distinct schemas: each parsed, the oldest forgotten
        pipe.engine.build_request([1, 2], SamplingParams(max_new_tokens=1, structured_outputs={"json": {"const": k}}))
    assert len(pipe.engine.request_factory._parsed_grammars) == PARSED_CACHE_SIZE
    assert len(parses) == 1 + PARSED_CACHE_SIZE + 3
    assert_nothing_left(pipe.engine)


@pytest.mark.timeout(600)
def test_a_constraint_changed_in_place_between_submits_is_followed(pipe):
    constraint = {"choice": ["yes", "no"]}
    first = pipe.engine.submit([1, 2, 3], SamplingParams(max_new_tokens=6, structured_outputs=constraint))
    assert pipe.tokenizer.decode(first.result().output_token_ids, skip_special_tokens=True) in ("yes", "no")
    constraint["choice"] = ["maybe", "never"]  # the same dict object, new contents
    second = pipe.engine.submit([1, 2, 3], SamplingParams(max_new_tokens=6, structured_outputs=constraint))
    assert pipe.tokenizer.decode(second.result().output_token_ids, skip_special_tokens=True) in ("maybe", "never")
    assert_nothing_left(pipe.engine)


@pytest.mark.timeout(600)
def test_a_grammar_and_processors_that_refuse_every_token_fail_that_request_alone_saying_so(pipe):
    # Every token may appear once (no_repeat_ngram_size=1) but the regex needs 40 "a"s: the
    # vocabulary's few all-"a" tokens run out, and then nothing is allowed.
    dead = pipe.submit(
        "A class is", do_sample=True, no_repeat_ngram_size=1, structured_outputs={"regex": "a{40}"}, max_new_tokens=60
    )
    fine = pipe.submit(
        "A class is",
        do_sample=True,
        max_new_tokens=8,
        return_full_text=False,
        structured_outputs={"choice": ["yes", "no"]},
    )
    with pytest.raises(hf_contbatch.EngineError, match="no token is allowed next"):
        dead.result()
    assert texts([fine.result()]) in (["yes"], ["no"])
    assert_nothing_left(pipe.engine)


def test_without_xgrammar_a_constrained_call_names_the_extra(pipe, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(ImportError, match=r"hf_contbatch\[structured\]"):
        pipe("A class is", max_new_tokens=4, response_format={"type": "json_object"})
    assert pipe("A class is", do_sample=False, max_new_tokens=2)  # unconstrained calls are unaffected


@pytest.mark.timeout(600)
def test_a_compiling_grammar_holds_back_only_its_own_request(pipe):
    released = threading.Event()
    compilation = pipe.engine.grammars.compilation
    slow = compilation._compile

    def blocked(spec):
        released.wait(timeout=300)
        return slow(spec)

    compilation._compile = blocked
    try:
        waiting = pipe.submit(
            "A class is", do_sample=False, max_new_tokens=8, structured_outputs={"regex": "[a-z]{3,5} wait"}
        )
        free = pipe("Exceptions are", do_sample=False, max_new_tokens=8)  # runs while the grammar compiles
        assert free and not waiting.done()
        assert waiting.handles[0].request.waiting_for_grammar
    finally:
        compilation._compile = slow
        released.set()
    assert re.fullmatch(r"[a-z]{3,5} wait", waiting.result()[0]["generated_text"][len("A class is") :])
    assert_nothing_left(pipe.engine)


@pytest.mark.timeout(600)
def test_a_logits_processor_factory_is_called_once_per_request_and_fork(pipe):
    from transformers import LogitsProcessor

    made = []

    class RowsSeen(LogitsProcessor):
        """Stateful: remembers the length of every history it is called with."""

        def __init__(self):
            self.lengths = []

        def __call__(self, input_ids, scores):
            self.lengths.append(input_ids.shape[1])
            return scores

    def factory():
        made.append(RowsSeen())
        return [made[-1]]

    out = pipe(
        ["A class is", "Exceptions are"],
        do_sample=True,
        num_return_sequences=3,
        max_new_tokens=5,
        logits_processor=factory,
    )
    assert len(out) == 2 and len(made) == 6, "one processor list per request and per fork"
    for proc in made:  # each instance saw one sequence: one call per step, its history growing by one
        assert proc.lengths == list(range(proc.lengths[0], proc.lengths[0] + len(proc.lengths)))
    with pytest.raises(ValueError, match="logits_processor"):
        pipe("A class is", max_new_tokens=2, logits_processor=RowsSeen())  # a processor, not a list or factory


@pytest.mark.timeout(600)
def test_max_new_tokens_still_ends_a_constrained_request_as_length_and_cancel_or_failure_leaves_nothing(pipe):
    handle = pipe.submit("A class is", do_sample=False, max_new_tokens=3, structured_outputs={"json": PERSON})
    handle.result()
    assert handle.finish_reasons() == ["length"]
    assert len(handle.handles[0].request.output_token_ids) == 3

    def failing():
        def boom(input_ids, scores):
            raise RuntimeError("processor failed")

        return [boom]

    failed = pipe.submit("A class is", max_new_tokens=40, logits_processor=failing, structured_outputs={"json": PERSON})
    cancelled = pipe.submit("Exceptions are", max_new_tokens=400, structured_outputs={"json_object": True})
    cancelled.cancel()
    with pytest.raises(hf_contbatch.EngineError):
        failed.result()
    cancelled.result()
    assert cancelled.finish_reasons() == ["cancelled"]
    assert_nothing_left(pipe.engine)
