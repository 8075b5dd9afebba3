"""The rows of ``hf-contbatch generate --input``, read lazily: one ``Row`` per prompt, with its
position, its id and the call arguments of its own; a row that cannot run carries the reason instead.

Formats (by the file's suffix):

- ``.txt``: one prompt per non-empty line.
- ``.jsonl``: per line a string, ``{"prompt": ...}`` or ``{"messages": [...]}`` with optional
  ``"response_format"``, ``"adapter"`` and ``"id"``/``"custom_id"`` (other keys, a dataset's own
  fields, are ignored); or, when the first line is an OpenAI batch request (``"custom_id"``,
  ``"method"``, ``"url"``, ``"body"``), every line is one (``openai_row``).
- ``.parquet`` / ``.csv``: through ``datasets``; the prompt is the ``--input-column`` column (text,
  or a chat), the id the ``id`` or ``custom_id`` column where there is one.

Only what is wrong with the file as a whole (no such file, a suffix we do not read, no rows, a
missing column) raises ``UsageError`` before anything loads; a bad row becomes ``Row.error`` and
the job writes an error record for it. Standard library only (``datasets`` is imported for Parquet
and CSV files, on use).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from .cli_checks import UsageError, _checked_messages, _json_kind, prompt_from_json

SUFFIXES = (".txt", ".jsonl", ".parquet", ".csv")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
# Body fields of an OpenAI batch request that we run (the others are refused by name, so that a
# setting is never silently dropped); "model" names the model of the batch, which is --model here.
OPENAI_BODY_FIELDS = frozenset(
    (
        "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
        "n", "seed", "response_format", "user", "stream", "store", "metadata",
    )
)  # fmt: skip


@dataclass
class Row:
    """One row of the input.

    Attributes:
        index: its position among the file's rows, from 0 (blank lines of text files are not rows).
        where: how messages name it (``"line 3"``, ``"row 2"``).
        id: the row's ``"id"`` or ``"custom_id"`` (None without one).
        id_key: which of the two the input named it (its record uses the same key).
        prompt: a string or a chat; None when ``error`` is set.
        kwargs: its own pipeline call arguments (``max_new_tokens``, ``temperature``, ``response_format``,
            ``adapter_names``...), over the command's.
        openai: for an OpenAI batch request, its ``url`` (the output record's shape follows it).
        error: why it cannot run (then the job writes an error record for it).
    """

    index: int
    where: str
    id: Any = None
    id_key: str = "id"
    prompt: Any = None
    kwargs: dict = field(default_factory=dict)
    openai: Optional[str] = None
    error: Optional[str] = None


# UTF-8, less a leading byte order mark (Notepad and PowerShell write one): it belongs to no row.
TEXT_ENCODING = "utf-8-sig"


@dataclass
class InputFile:
    """``--input``: its path, its number of rows, whether it holds OpenAI batch requests, and how to
    read its rows (``rows()``, lazily, each time from the start)."""

    path: str
    num_rows: int
    openai: bool
    column: str = "prompt"

    def rows(self) -> Iterator[Row]:
        suffix = Path(self.path).suffix
        if suffix in (".parquet", ".csv"):
            yield from _table_rows(self.path, self.column)
            return
        index = 0
        with open(self.path, encoding=TEXT_ENCODING) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"line {n}"
                if suffix == ".txt":
                    yield Row(index, where, prompt=line.rstrip("\r\n"))
                elif self.openai:
                    yield openai_row(index, where, line)
                else:
                    yield _jsonl_row(index, where, line)
                index += 1


class ListInput:
    """Prompts given as a list (the command's built-in prompts), read as rows."""

    openai = False

    def __init__(self, prompts: list) -> None:
        self.prompts = prompts
        self.num_rows = len(prompts)

    def rows(self) -> Iterator[Row]:
        for index, prompt in enumerate(self.prompts):
            yield Row(index, f"prompt {index}", prompt=prompt)


def open_input(path: str, column: str = "prompt") -> InputFile:
    """Check ``--input`` as a whole and count its rows (one pass, nothing kept).

    Raises:
        UsageError: no such file, a suffix we do not read, not UTF-8, no rows, a Parquet/CSV file
            without ``column`` or without ``datasets`` installed.
    """
    p = Path(path)
    if p.suffix not in SUFFIXES:
        raise UsageError(f"--input {path}: must be a .jsonl, .txt, .parquet or .csv file")
    if not p.is_file():
        raise UsageError(f"--input {path}: no such file")
    if p.suffix in (".parquet", ".csv"):
        return InputFile(path, _table(path, column).num_rows, False, column)
    num_rows = 0
    first = None
    try:
        with open(p, encoding=TEXT_ENCODING) as f:
            for line in f:
                if line.strip():
                    num_rows += 1
                    if first is None:
                        first = line
    except UnicodeDecodeError as exc:
        raise UsageError(f"--input {path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise UsageError(f"--input {path}: cannot be read ({exc.strerror})") from None
    if not num_rows:
        raise UsageError(f"--input {path}: no prompts in the file")
    return InputFile(path, num_rows, p.suffix == ".jsonl" and _is_openai_request(first))


def _is_openai_request(line: str) -> bool:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and "custom_id" in obj and "body" in obj and "url" in obj


def _row_id(obj) -> tuple[Any, str]:
    """A .jsonl row's id and its key: ``"id"``, else ``"custom_id"``."""
    if isinstance(obj, dict) and "id" not in obj and "custom_id" in obj:
        return obj["custom_id"], "custom_id"
    return (obj.get("id") if isinstance(obj, dict) else None), "id"


def _jsonl_row(index: int, where: str, line: str) -> Row:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return Row(index, where, error=f"{where}: not valid JSON ({exc})")
    row_id, id_key = _row_id(obj)
    row = Row(index, where, id=row_id, id_key=id_key)
    try:
        row.prompt = prompt_from_json(obj, where)
    except UsageError as exc:
        row.error = str(exc)
        return row
    if isinstance(obj, dict):
        if obj.get("response_format") is not None:
            row.kwargs["response_format"] = obj["response_format"]
        if obj.get("adapter") is not None:
            row.kwargs["adapter_names"] = obj["adapter"]
    return row


def openai_row(index: int, where: str, line: str) -> Row:
    """A row from one line of an OpenAI batch request file: ``{"custom_id", "method": "POST", "url",
    "body"}``; ``body`` as the endpoint takes it (``messages`` for ``/v1/chat/completions``, a string
    ``prompt`` for ``/v1/completions``), its sampling fields as call arguments:
    ``max_tokens``/``max_completion_tokens`` -> ``max_new_tokens``; ``temperature`` (0: greedy,
    else sampling at it), ``top_p`` (sampling) and ``n`` > 1 (sampling, at temperature 1 unless
    given, as OpenAI) -> sampling; ``stop`` -> ``stop_strings``; ``seed``; ``response_format``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return Row(index, where, error=f"{where}: not valid JSON ({exc})")
    row = Row(index, where, id=obj.get("custom_id") if isinstance(obj, dict) else None)
    try:
        _fill_openai_row(row, obj)
    except UsageError as exc:
        row.error = f"{where}: {exc}"
        row.prompt = None
    return row


def _fill_openai_row(row: Row, obj) -> None:
    if not isinstance(obj, dict):
        raise UsageError(f"found {_json_kind(obj)}; each line must be an OpenAI batch request object")
    for key in ("custom_id", "url", "body"):
        if key not in obj:
            raise UsageError(f"an OpenAI batch request needs '{key}'")
    if obj.get("method", "POST") != "POST":
        raise UsageError(f"'method' must be \"POST\", found {obj['method']!r}")
    url = obj["url"]
    if url not in OPENAI_URLS:
        raise UsageError(f"'url' must be one of {', '.join(OPENAI_URLS)}, found {url!r}")
    row.openai = url
    body = obj["body"]
    if not isinstance(body, dict):
        raise UsageError(f"'body' must be an object, found {_json_kind(body)}")
    unknown = sorted(set(body) - OPENAI_BODY_FIELDS)
    if unknown:
        raise UsageError(
            f"body field {unknown[0]!r} is not supported (supported: {', '.join(sorted(OPENAI_BODY_FIELDS))})"
        )
    if body.get("stream"):
        raise UsageError("'stream' must be false in a batch request")
    if url == "/v1/chat/completions":
        if "messages" not in body:
            raise UsageError("a /v1/chat/completions body needs 'messages'")
        row.prompt = _checked_messages(body["messages"], "body")
    else:
        if not isinstance(body.get("prompt"), str):
            raise UsageError(
                f"a /v1/completions body needs 'prompt' as a string, found {_json_kind(body.get('prompt'))}"
            )
        row.prompt = body["prompt"]
    kw = row.kwargs
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise UsageError(f"'max_tokens' must be an integer >= 1, found {_json_kind(max_tokens)}")
        kw["max_new_tokens"] = max_tokens
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError(f"'n' must be an integer >= 1, found {_json_kind(n)}")
    temperature, top_p = body.get("temperature"), body.get("top_p")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise UsageError(f"'{name}' must be a number, found {_json_kind(value)}")
    if temperature == 0 and n == 1:
        kw["do_sample"] = False
    elif temperature is not None or top_p is not None or n > 1:
        kw["do_sample"] = True
        kw["temperature"] = 1.0 if temperature is None else float(temperature)
        kw["top_p"] = 1.0 if top_p is None else float(top_p)
    if n > 1:
        kw["num_return_sequences"] = n
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise UsageError(f"'stop' must be a non-empty string or an array of them, found {_json_kind(stop)}")
        if stops:
            kw["stop_strings"] = stops
    if body.get("seed") is not None:
        if not isinstance(body["seed"], int) or isinstance(body["seed"], bool):
            raise UsageError(f"'seed' must be an integer, found {_json_kind(body['seed'])}")
        kw["seed"] = body["seed"]
    if body.get("response_format") is not None:
        kw["response_format"] = body["response_format"]


def _table(path: str, column: str):
    """The Parquet or CSV file as a ``datasets.Dataset`` (memory-mapped Arrow)."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"--input {path}: Parquet and CSV inputs need datasets: pip install datasets") from None
    kind = "parquet" if path.endswith(".parquet") else "csv"
    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - pyarrow's and datasets' errors: the file is not readable
        raise UsageError(f"--input {path}: cannot be read as {kind} ({type(exc).__name__}: {exc})") from None
    if column not in ds.column_names:
        raise UsageError(
            f"--input {path}: no column {column!r} (its columns: {', '.join(ds.column_names)}); choose one with "
            "--input-column"
        )
    if ds.num_rows == 0:
        raise UsageError(f"--input {path}: no rows in the file")
    return ds


def _table_rows(path: str, column: str) -> Iterator[Row]:
    ds = _table(path, column)
    id_column = next((c for c in ("id", "custom_id") if c in ds.column_names), None)
    for index, record in enumerate(ds):
        where = f"row {index}"
        row = Row(index, where, id=record[id_column] if id_column else None, id_key=id_column or "id")
        value = record[column]
        if isinstance(value, str) and value:
            row.prompt = value
        elif isinstance(value, list) and value:
            try:
                row.prompt = _checked_messages(value, where)
            except UsageError as exc:
                row.error = str(exc)
        else:
            row.error = f"{where}: column {column!r} must hold a non-empty string or a chat, found {_json_kind(value)}"
        yield row
