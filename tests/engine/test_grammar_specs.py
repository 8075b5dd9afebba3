"""Checking a request's ``structured_outputs`` at submit (``engine.structured.GrammarSpec``): the shapes
accepted, the errors, and the grammars it compiles, checked against the JSON and regex specifications
with xgrammar's own matcher."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from hf_contbatch.engine.structured import GrammarSpec
from hf_contbatch.engine.structured.specs import bounded_strings_as_patterns, choice_as_ebnf
from hf_contbatch.request import StructuredOutputsParams


@pytest.fixture(scope="module")
def compiler(tok):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=4096))


def accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(spec.grammar), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_bounded_strings_become_anchored_patterns_and_nothing_else_changes():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 6},
            "b": {"type": "string", "minLength": 2},
            "c": {"type": "string", "maxLength": 3, "pattern": "^x+$"},  # a pattern is kept as given
            "d": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4}},
            "e": {"type": "integer", "maximum": 4},
        },
    }
    out = bounded_strings_as_patterns(schema)
    assert out["properties"]["a"] == {"type": "string", "pattern": "^[\\s\\S]{0,6}$"}
    assert out["properties"]["b"] == {"type": "string", "pattern": "^[\\s\\S]{2,}$"}
    assert out["properties"]["c"] == schema["properties"]["c"]
    assert out["properties"]["d"]["items"] == {"type": "string", "pattern": "^[\\s\\S]{1,4}$"}
    assert out["properties"]["e"] == schema["properties"]["e"]
    assert schema["properties"]["a"] == {"type": "string", "maxLength": 6}  # the caller's schema is untouched
    for text in ["", "abc", "a\nb", "ǅ€x"]:  # the pattern counts characters as maxLength does
        assert bool(re.fullmatch(r"[\s\S]{0,6}", text)) == (len(text) <= 6)


def test_a_bounded_string_refuses_raw_control_characters_that_json_loads_refuses(compiler):
    spec = GrammarSpec.parse(
        {"json": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}}
    )
    assert accepts(compiler, spec, '{"s": "ab c"}')
    with pytest.raises(ValueError, match="control character"):
        json.loads('{"s": "a\x1bc"}', strict=True)
    assert not accepts(compiler, spec, '{"s": "a\x1bc"}')
    assert not accepts(compiler, spec, '{"s": "abcde"}')


def test_json_is_compact_in_the_schemas_key_order_and_choice_is_exact(compiler):
    spec = GrammarSpec.parse(
        StructuredOutputsParams(
            json={
                "type": "object",
                "properties": {"z": {"type": "integer"}, "a": {"type": "boolean"}},
                "required": ["z", "a"],
            }
        )
    )
    assert accepts(compiler, spec, '{"z": 1, "a": true}')
    assert not accepts(compiler, spec, '{"a": true, "z": 1}')
    assert not accepts(compiler, spec, '{"z":1,"a":true}')
    choice = GrammarSpec.parse({"choice": ['say "hi"', "back\\slash", "plain"]})
    for c in ['say "hi"', "back\\slash", "plain"]:
        assert accepts(compiler, choice, c)
    assert not accepts(compiler, choice, "plai")
    assert choice_as_ebnf(["a"]) == 'root ::= ("a")'
    any_object = GrammarSpec.parse({"json_object": True})
    assert accepts(compiler, any_object, '{"k": [1, {"x": null}]}')
    assert not accepts(compiler, any_object, "[1]")


@pytest.mark.parametrize(
    "value,message",
    [
        ({"json": {"type": "nope"}}, "json is refused by xgrammar"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": 3}, "must be a JSON schema"),
        ({"regex": "(a"}, "regex is refused by xgrammar"),
        ({"regex": ""}, "non-empty string"),
        ({"grammar": 'start ::= "a"'}, "grammar is refused by xgrammar"),
        ({"choice": "yes"}, "non-empty list of strings"),
        ({"choice": ["a", ""]}, "choice[1] must be a non-empty string, got ''"),
        ({"choice": ["a", "b", 3]}, "choice[2] must be a non-empty string, got 3"),
        ({"json_object": 1}, "must be True"),
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"schema": {}}, "unknown key"),
        ("a+", "must be a StructuredOutputsParams"),
    ],
)
def test_bad_values_are_refused_naming_the_problem(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GrammarSpec.parse(value)


# Literals that must come out exactly as written: quotes, backslashes, \r \n \t, NUL and the other
# control characters, DEL, non-ASCII (2-, 3- and 4-byte UTF-8), a hex digit right after a control
# character (xgrammar reads ``\x0a`` + ``e`` as one ``\x0ae`` escape), text that looks like an
# escape, and regex/EBNF metacharacters.
LITERALS = [
    "crlf\r\nend",
    "nul\x00byte",
    "tab\tafter",
    "\x0ae",
    "\x1b[0m\x7f",
    'say "hi"',
    "back\\slash",
    "\\x0ae \\u0041 \\n",
    "é ü ñ € 日本 😀",
    "\u2028line\u2029",
    "a.b*c+?[](){}|^$ # ::= -",
]


def accepts_tokens(compiler, tok, spec: GrammarSpec, text: str) -> bool:
    """The library's matcher fed ``text`` as the model would produce it: token by token (its
    ``accept_string`` stops at a NUL, so text with one is checked this way)."""
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text, "the tokenizer does not round-trip this text"
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(spec.grammar), terminate_without_stop_token=True)
    return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()


def test_each_choice_literal_is_accepted_exactly_as_written_and_nothing_near_it(compiler, tok):
    # Expected values from the library's own matcher: the grammar accepts the literal's exact text
    # and refuses it cut short, extended, or with its first character changed.
    for literal in LITERALS:
        spec = GrammarSpec.parse({"choice": [literal]})
        assert accepts_tokens(compiler, tok, spec, literal), repr(literal)
        assert not accepts_tokens(compiler, tok, spec, literal[:-1]), repr(literal)
        assert not accepts_tokens(compiler, tok, spec, literal + "x"), repr(literal)
        assert not accepts_tokens(compiler, tok, spec, "x" + literal[1:]), repr(literal)
    everything = GrammarSpec.parse({"choice": LITERALS})
    assert all(accepts_tokens(compiler, tok, everything, literal) for literal in LITERALS)
    # what the issue saw come out: the newline escape read across the next hex digit, and NUL
    assert not accepts_tokens(compiler, tok, everything, "crlf\r\u00aend")
    assert not accepts_tokens(compiler, tok, everything, "nul\x0byte")
    assert not accepts_tokens(compiler, tok, everything, "nul")
    assert not accepts_tokens(compiler, tok, GrammarSpec.parse({"choice": ["a\x00b"]}), "a\x01b")


def test_json_enum_const_and_property_names_with_such_literals_decode_to_themselves(compiler, tok):
    # xgrammar writes these itself; the check is that the schema's value is accepted in a JSON
    # spelling and that every accepted spelling of the two json.loads back to the literal.
    for literal in LITERALS:
        schema = {
            "type": "object",
            "properties": {literal: {"enum": [literal, "other"]}, "c": {"const": literal}},
            "required": [literal, "c"],
        }
        spec = GrammarSpec.parse({"json": schema})
        obj = {literal: literal, "c": literal}
        spellings = [json.dumps(obj, separators=(", ", ": "), ensure_ascii=flag) for flag in (False, True)]
        accepted = [s for s in spellings if accepts_tokens(compiler, tok, spec, s)]
        assert accepted, repr(literal)
        assert all(json.loads(s) == obj for s in accepted)


def test_a_choice_with_a_lone_surrogate_is_refused_naming_it():
    with pytest.raises(ValueError, match="choice: a lone surrogate U\\+D800"):
        GrammarSpec.parse({"choice": ["ok", "bad\ud800"]})
