"""A request's ``structured_outputs`` checked and parsed into the grammar it must follow.

``GrammarSpec.parse`` is the check at submit: a ``StructuredOutputsParams`` (or a dict of its
fields) becomes the library's ``Grammar`` (parsing needs no tokenizer and is fast), or a
``ValueError`` naming the field and the problem; the slow part, compiling the grammar against the
tokenizer, happens later in the engine's worker thread (``compiler.GrammarCompilation``).

JSON is generated compactly (``", "`` and ``": "``, no other whitespace: a small model given free
whitespace can emit it until ``max_new_tokens``), and in xgrammar's strict mode (properties and
items not in the schema are not generated). xgrammar 0.2 lowers a string with
``minLength``/``maxLength`` to a bare character class that admits raw control characters (which
``json.loads`` rejects) and no escapes (xgrammar issue #800); such a string is rewritten to the
equivalent anchored ``pattern``, which xgrammar compiles JSON-string aware: no raw control
characters (escapes stay out of reach in a length-bounded string, as before).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, MutableMapping, Optional

from ...request import StructuredOutputsParams

EXTRA = 'pip install "hf_contbatch[structured]"'
PARSED_CACHE_SIZE = 64
"""Parsed grammars a ``GrammarSpec.parse`` cache keeps."""
JSON_SEPARATORS = (", ", ": ")
# xgrammar's errors start with "[time] /path/file.cc:line: "; the rest is the message.
_LIBRARY_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def import_xgrammar():
    """The ``xgrammar`` module; ``ImportError`` naming the extra to install when it is missing."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(f"structured outputs need the grammar library xgrammar: {EXTRA}") from exc
    return xgrammar


def as_structured_outputs_params(value) -> StructuredOutputsParams:
    """``value`` (a ``StructuredOutputsParams`` or a dict of its fields) checked for shape.

    Raises:
        ValueError: not one of those, an unknown key, or not exactly one field set.
    """
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(StructuredOutputsParams.FIELDS))
        if unknown:
            raise ValueError(
                f"`structured_outputs` has unknown key(s) {unknown}; allowed: {', '.join(StructuredOutputsParams.FIELDS)}"
            )
        value = StructuredOutputsParams(**value)
    if not isinstance(value, StructuredOutputsParams):
        raise ValueError(
            "`structured_outputs` must be a StructuredOutputsParams or a dict with one of "
            f"{', '.join(StructuredOutputsParams.FIELDS)}, got {type(value).__name__}"
        )
    if value.kind is None:
        given = [name for name in value.FIELDS if getattr(value, name) not in (None, False)]
        raise ValueError(
            f"`structured_outputs` must set exactly one of {', '.join(value.FIELDS)}; got "
            f"{', '.join(given) if given else 'none'}"
        )
    return value


def bounded_strings_as_patterns(schema: Any) -> Any:
    """A copy of the JSON schema in which every string schema with ``minLength``/``maxLength`` and
    no ``pattern``/``format`` carries the same bounds as an anchored ``pattern`` (any characters,
    counted as JSON Schema counts them: code points). See the module docstring for why."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{low},{'' if high is None else int(high)}}}$"
    return out


# The one code point an xgrammar string literal cannot hold: the library ends a literal at NUL
# ("a\\u0000b" matches "a"); a class of every code point but NUL matches exactly NUL.
_EBNF_NUL = "[^\\u0001-\\U0010ffff]"


def ebnf_literal(text: str) -> str:
    """An xgrammar EBNF expression that matches exactly ``text`` (UTF-8 bytes), nothing else.

    A quoted string: printable ASCII as itself (``"`` and ``\\`` backslash-escaped), every other
    code point (control characters, DEL, non-ASCII) as a fixed-width escape, ``\\uXXXX`` or
    ``\\UXXXXXXXX``. Not ``\\xNN``: xgrammar's EBNF lexer reads a ``\\x`` escape across every
    hex digit that follows, so ``"\\x0ae"`` is U+0AE, not a newline and ``e``; ``\\u`` and
    ``\\U`` take exactly 4 and 8 digits (xgrammar ``cpp/grammar_parser.h``). NUL cannot be in an
    xgrammar string, so the expression is then a sequence: ``"nul" [^\\u0001-\\U0010ffff] "byte"``.

    Raises:
        ValueError: ``text`` holds a lone surrogate (U+D800..U+DFFF), which no UTF-8 output can be.
    """
    parts, run = [], []

    def close_run() -> None:
        if run:
            parts.append('"' + "".join(run) + '"')
            run.clear()

    for ch in text:
        code = ord(ch)
        if code == 0:
            close_run()
            parts.append(_EBNF_NUL)
        elif ch in '"\\':
            run.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            run.append(ch)
        elif 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"a lone surrogate U+{code:04X} cannot be generated (it has no UTF-8 form)")
        elif code <= 0xFFFF:
            run.append(f"\\u{code:04x}")
        else:
            run.append(f"\\U{code:08x}")
    close_run()
    return " ".join(parts) if parts else '""'


def choice_as_ebnf(choices) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (literal strings).

    Raises:
        ValueError: a choice holds a lone surrogate (see ``ebnf_literal``).
    """
    return "root ::= " + " | ".join(f"({ebnf_literal(c)})" for c in choices)


def _library_message(exc: Exception) -> str:
    return _LIBRARY_PREFIX.sub("", str(exc).strip()).strip()


@dataclass(frozen=True)
class GrammarSpec:
    """A request's checked structured-output constraint.

    Attributes:
        params: what the caller gave (``StructuredOutputsParams``).
        kind: ``"json"``, ``"regex"``, ``"grammar"`` (``choice`` and ``json_object`` become a
            grammar and a JSON schema).
        source: the text compiled: the JSON schema as JSON (its key order is the properties'
            order in the output), the regex, or EBNF; it keys the engine's compiled-grammar cache.
        strict: xgrammar's strict mode (False for ``json_object``: any object).
        grammar: the library's parsed ``xgrammar.Grammar``.
    """

    params: StructuredOutputsParams
    kind: str
    source: str
    strict: bool
    grammar: Any

    @property
    def key(self) -> tuple:
        """Cache key of the parsed and the compiled grammar (one engine, so one tokenizer)."""
        return (self.kind, self.strict, self.source)

    @classmethod
    def parse(cls, value, parsed: Optional[MutableMapping] = None) -> "GrammarSpec":
        """Check ``value`` (``SamplingParams.structured_outputs``) and parse its grammar.

        Args:
            value: a ``StructuredOutputsParams``, its dict form, or a ``GrammarSpec`` (returned).
            parsed: the caller's cache of parsed grammars by ``key`` (the library takes about a
                millisecond to parse a schema; requests often repeat one), at most
                ``PARSED_CACHE_SIZE`` kept, the oldest dropped first. None: no cache.

        Raises:
            ValueError: a malformed value, or a schema, regex, choice list or grammar the library
                refuses; the message names the field and the library's reason.
            ImportError: xgrammar is not installed (the message names the extra).
        """
        if isinstance(value, GrammarSpec):
            return value
        params = as_structured_outputs_params(value)
        arg = f"`{params.argument}`"  # the argument the user wrote (response_format= or structured_outputs=)
        kind, strict = params.kind, True
        if kind == "json":
            schema = params.json
            if hasattr(schema, "model_json_schema"):  # a pydantic model class
                schema = schema.model_json_schema()
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"{arg} json: the schema is not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    f"{arg} json must be a JSON schema (a dict or its JSON text), got {type(schema).__name__}"
                )
            source = json.dumps(bounded_strings_as_patterns(schema))  # key order kept: properties come in it
        elif kind == "json_object":
            if params.json_object is not True:
                raise ValueError(f"{arg} json_object must be True, got {params.json_object!r}")
            kind, source, strict = "json", json.dumps({"type": "object"}), False
        elif kind == "choice":
            choices = params.choice
            if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
                raise ValueError(f"{arg} choice must be a non-empty list of strings, got {choices!r}")
            for i, c in enumerate(choices):  # the first bad entry, by index (a long list is hard to scan)
                if not (isinstance(c, str) and c):
                    raise ValueError(f"{arg} choice[{i}] must be a non-empty string, got {c!r}")
            try:
                kind, source = "grammar", choice_as_ebnf(choices)
            except ValueError as exc:
                raise ValueError(f"{arg} choice: {exc}") from None
        else:
            source = getattr(params, kind)
            if not isinstance(source, str) or not source:
                raise ValueError(f"{arg} {kind} must be a non-empty string, got {source!r}")
        key = (kind, strict, source)
        grammar = parsed.get(key) if parsed is not None else None
        if grammar is None:
            grammar = _parse(kind, source, strict, f"{arg} {params.kind}")
            if parsed is not None:
                parsed[key] = grammar
                while len(parsed) > PARSED_CACHE_SIZE:
                    del parsed[next(iter(parsed))]
        return cls(params, kind, source, strict, grammar)


def _parse(kind: str, source: str, strict: bool, what: str):
    """The library's ``Grammar`` for ``source`` (``ValueError`` with the library's reason)."""
    xgr = import_xgrammar()
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(
                source, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=strict
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(source)
        return xgr.Grammar.from_ebnf(source)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"{what} is refused by xgrammar: {_library_message(exc)}") from None


def spec_of(sampling) -> Optional[GrammarSpec]:
    """The ``GrammarSpec`` of a request's ``SamplingParams`` (set by ``RequestFactory``), or None."""
    spec = sampling.structured_outputs
    return spec if isinstance(spec, GrammarSpec) else None
