"""``hf-contbatch generate``'s job: every row of ``--input`` through the engine, one output record
per row written and flushed as the row finishes, an interrupted job resumable.

The loop (``run_job``): rows are pulled lazily (``job_inputs``) and built into requests in chunks of
rows that share their call arguments (``CallRequestBuilder.prepare``, which resolves a generation
config per chunk), at most ``in_flight`` rows queued or running at once; the thread drives the
engine (``EngineDriver.drive``) until some row finishes, and writes its record at once. A row that
cannot run (bad JSON, a prompt the engine refuses, a failure in the engine) gets an error record
and the job goes on.

``--output`` (``JobOutput``): one JSON object per line, in completion order while the job runs;
once every row has its record the file is rewritten in input order (atomically, ``os.replace``).
``--resume`` reads the file first: a torn last line (a kill mid-write) is cut off, the rows with a
record are skipped (their ids must match the input's), and the job appends the others.

Records: ``{"index", "id", "prompt", "generated_text"}`` (``"adapter"`` with ``--adapter``), or
``{"index", "id", "error"}``; for an OpenAI batch request file, OpenAI's batch output records
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` plus ``"index"``.
"""

from __future__ import annotations

import array
import itertools
import json
import os
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ..request import LatencySamples, RequestMetrics
from .cli_checks import UsageError, as_response_format
from .job_inputs import Row

EXIT_ROWS_FAILED = 3  # some rows have error records; the others ran (0: all ran, 2: a usage error)


@dataclass
class JobResult:
    """What a job did: rows run now, rows skipped (already in the output), rows with an error record
    in the final output (this run's and a resumed file's), generated tokens, seconds, and the
    TTFT and ITL of every sequence run now (``latency``)."""

    ran: int = 0
    skipped: int = 0
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    errors: list = field(default_factory=list)  # the first few error messages, for the summary
    latency: LatencySamples = field(default_factory=LatencySamples)


def latency_line(latency: LatencySamples) -> Optional[str]:
    """The end-of-job line of what a user waits for: time to first token (TTFT) and inter-token
    latency (ITL, milliseconds per output token after the first), medians and 90th percentiles
    over the sequences; a job of one sequence gets its own figures (and its decode rate). None
    when no sequence produced a token."""
    figures = latency.summary()
    if figures["ttft_s"] is None:
        return None

    def ms(seconds: Optional[float]) -> str:
        return "—" if seconds is None else f"{seconds * 1e3:,.1f} ms"

    if len(latency.ttfts) == 1:
        itl = figures["itl_s"]
        rate = f" ({1 / itl:,.1f} tok/s after the first)" if itl else ""
        return f"latency: TTFT {ms(figures['ttft_s'])}; ITL {ms(itl)} per output token{rate}"
    return (
        f"latency over {len(latency.ttfts):,} sequences: TTFT median {ms(figures['ttft_s'])}, "
        f"p90 {ms(figures['ttft_p90_s'])}; ITL median {ms(figures['itl_s'])}, p90 {ms(figures['itl_p90_s'])} "
        "per output token"
    )


class JobOutput:
    """The ``--output`` file of a job of ``num_rows`` rows (see the module docstring).

    Args:
        path: the file.
        num_rows: the input's rows.
        resume: keep the records already there (else the file is started anew).

    Raises:
        UsageError: with ``resume``, a record that is not one of this input's rows (an index out of
            range or written twice).
    """

    def __init__(self, path: str, num_rows: int, *, resume: bool) -> None:
        self.path = path
        self.num_rows = num_rows
        # Per row, where its record starts in the file and its length (-1: none yet); 16 bytes a row.
        self.offsets = array.array("q", [-1]) * num_rows
        self.lengths = array.array("q", [0]) * num_rows
        self.ids: dict[int, Any] = {}  # resumed records' ids, checked against the input's rows
        self.failed_before = 0
        if resume and os.path.exists(path):
            self._load()
            self._file = open(path, "ab")
        else:
            self._file = open(path, "wb")

    def _load(self) -> None:
        """Index the records already in the file; cut a torn last line."""
        good_end = 0
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            offset = 0
            for raw in f:
                end = offset + len(raw)
                try:
                    record = json.loads(raw) if raw.endswith(b"\n") else None
                except json.JSONDecodeError:
                    record = None
                if record is None and end == size:
                    break  # a line torn by a kill mid-write: only ever the last one; cut below
                if record is None:
                    raise UsageError(
                        f"--resume: {self.path} has a line that is not a JSON record before its last line (at "
                        f"byte {offset}); it is not a file this command wrote, or was edited"
                    )
                index = record.get("index") if isinstance(record, dict) else None
                if not isinstance(index, int) or not 0 <= index < self.num_rows or self.offsets[index] >= 0:
                    raise UsageError(
                        f"--resume: {self.path} holds a record that is not one of this input's rows (line "
                        f"{raw[:80]!r}); give the output of this input, or start anew without --resume"
                    )
                self.offsets[index], self.lengths[index] = offset, len(raw)
                self.ids[index] = record.get("custom_id") if "custom_id" in record else record.get("id")
                if record.get("error") is not None:
                    self.failed_before += 1
                offset = good_end = end
        if good_end < os.path.getsize(self.path):
            with open(self.path, "r+b") as f:
                f.truncate(good_end)

    def check_ids(self, rows) -> None:
        """Check, before anything runs, that every record kept has the id of the input's row at
        its index (``rows``: the input's rows, read once).

        Raises:
            UsageError: naming the first row whose ids differ.
        """
        if not self.ids:
            return
        for row in rows:
            if row.index in self.ids and self.ids[row.index] != row.id:
                raise UsageError(
                    f"--resume: {self.path} has row {row.index} with id {self.ids[row.index]!r} but the input's row "
                    f"{row.index} ({row.where}) has id {row.id!r}; give the output of this input, or start anew "
                    "without --resume"
                )

    def has(self, index: int) -> bool:
        return self.offsets[index] >= 0

    @property
    def num_done(self) -> int:
        return sum(1 for o in self.offsets if o >= 0)

    def write(self, index: int, record: dict) -> None:
        """Append ``record`` as one line and flush it to the OS (a kill after this keeps it)."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self.offsets[index], self.lengths[index] = self._file.tell(), len(line)
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        """Close the file; when every row has a record, rewrite it in input order. Once only."""
        if self._file.closed:
            return
        self._file.close()
        if any(o < 0 for o in self.offsets) or list(self.offsets) == sorted(self.offsets):
            return
        tmp = f"{self.path}.sorting"
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            for offset, length in zip(self.offsets, self.lengths):
                src.seek(offset)
                dst.write(src.read(length))
        os.replace(tmp, self.path)


@dataclass
class _Pending:
    row: Row
    handles: list
    output: Any  # the call's OutputOptions


def run_job(
    pipe,
    source,
    base_kwargs: dict,
    output: Optional[JobOutput],
    *,
    in_flight: int,
    show_progress: bool,
    print_texts: bool,
    model_name: str,
) -> JobResult:
    """Run every row of ``source`` not yet in ``output`` through ``pipe``; write each row's record as
    it finishes (to ``output``, else texts to stdout when ``print_texts``).

    Args:
        pipe: a ``ContinuousBatchingPipeline``.
        source: the rows (``job_inputs.InputFile`` or ``ListInput``).
        base_kwargs: the command's call arguments; a row's own override them.
        output: the ``--output`` file, or None.
        in_flight: the most rows queued or running at once.
        show_progress: a tqdm bar with ETA on stderr.
        print_texts: without ``output``, print each row's text.
        model_name: the ``model`` field of OpenAI records.

    Returns:
        the ``JobResult``. Raises KeyboardInterrupt after cancelling the rows in flight (the records
        written so far stay: ``--resume`` finishes the job).
    """
    engine = pipe.engine
    result = JobResult(failed=output.failed_before if output is not None else 0)
    done_q: "queue.SimpleQueue" = queue.SimpleQueue()
    pending: dict[int, _Pending] = {}  # by the id() of each of its handles
    rows = iter(source.rows())
    bar = None
    t0 = time.monotonic()
    created = int(time.time())
    chunk = max(1, in_flight // 4)
    counts = {"rows": 0}  # rows queued or running
    max_num_seqs = engine.config.scheduler.max_num_seqs

    def emit(row: Row, record: dict, text: Optional[str] = None) -> None:
        if record.get("error") is not None:
            result.failed += 1
            if len(result.errors) < 3:
                result.errors.append(f"row {row.index}: {message_of(record)}")
        else:
            result.ran += 1
        if output is not None:
            output.write(row.index, record)
        elif print_texts:
            print(f"--- {row.prompt!r}\n{text if text is not None else 'error: ' + str(record['error'])}\n", flush=True)
        if bar is not None:
            bar.update(1)

    def fail(row: Row, message: str) -> None:
        emit(row, error_record(row, message, source.openai))

    def submit(group: list[Row]) -> None:
        kwargs = {**base_kwargs, **group[0].kwargs}
        try:
            call = pipe._call_requests.prepare([r.prompt for r in group], kwargs)
        except ValueError as exc:
            if len(group) == 1:
                fail(group[0], f"{group[0].where}: {exc}")
                return
            for r in group:  # find the bad rows; the others run
                submit([r])
            return
        for r, handles in zip(group, engine.enqueue(call.requests)):
            p = _Pending(r, handles, call.output)
            counts["rows"] += 1
            for h in handles:
                pending[id(h)] = p
                h.add_done_callback(done_q.put)

    def finish(p: _Pending) -> None:
        from .generation_handle import records_so_far

        error = next((h.request.error for h in p.handles if h.request.error is not None), None)
        if error is not None:
            fail(p.row, f"{p.row.where}: the engine failed this request: {error}")
            return
        records = records_so_far(pipe.tokenizer, p.row.prompt, p.handles, p.output)
        result.tokens += sum(len(h.request.output_token_ids) for h in p.handles)
        result.latency.extend(RequestMetrics.of(h.request) for h in p.handles)
        emit(
            p.row,
            output_record(p.row, p.handles, records, base_kwargs, model_name, created),
            records[0]["generated_text"],
        )

    def drain() -> None:
        while True:
            try:
                h = done_q.get_nowait()
            except queue.Empty:
                return
            p = pending.get(id(h))
            if p is not None and all(x.done() for x in p.handles):
                for x in p.handles:
                    del pending[id(x)]
                counts["rows"] -= 1
                finish(p)

    try:
        if show_progress:
            from tqdm.auto import tqdm

            done_before = output.num_done if output is not None else 0
            bar = tqdm(total=source.num_rows, initial=done_before, desc="hf-contbatch", unit="row", dynamic_ncols=True)
        exhausted = False
        while True:
            want = in_flight - counts["rows"]
            # Refill a chunk at a time (building requests resolves a generation config per group of
            # rows), or sooner when the engine would run short of rows.
            if not exhausted and want > 0 and (want >= chunk or counts["rows"] < max_num_seqs):
                pulled = 0
                batch = []
                for row in itertools.islice(rows, want):
                    pulled += 1
                    if output is not None and output.has(row.index):
                        result.skipped += 1
                    elif row.error is not None or not _check_response_format(row):
                        fail(row, row.error)
                    else:
                        batch.append(row)
                exhausted = pulled < want
                for group in _groups(batch, chunk):
                    submit(group)
            if not pending:
                if exhausted:
                    break
                continue  # every row pulled was done already or bad: pull more
            if engine.driver.blocking_calls_drive:
                # Back to this loop once a few rows finished (a quarter of a chunk; fewer at the
                # tail): each return costs a hand-over with the engine's background thread, and
                # the rows still queued keep the engine busy meanwhile.
                target = max(1, min(chunk, counts["rows"]) // 4)
                engine.driver.drive(lambda target=target: done_q.qsize() >= target)
            if done_q.empty():
                try:
                    done_q.put(done_q.get(timeout=0.5))
                except queue.Empty:
                    if engine.closed:
                        raise RuntimeError("the engine was closed while the job ran") from None
            drain()
    finally:
        left = [h for h in {id(h): h for p in pending.values() for h in p.handles}.values() if not h.done()]
        if left and not engine.closed:
            engine.driver.cancel_now(left)
        if bar is not None:
            bar.close()
        result.seconds = time.monotonic() - t0
    return result


def message_of(record: dict) -> str:
    """An error record's message (a plain record's ``error``, an OpenAI record's ``error.message``)."""
    error = record["error"]
    return error["message"] if isinstance(error, dict) else str(error)


def _check_response_format(row: Row) -> bool:
    """Check a row's own ``response_format`` as the engine will (its schema parsed by the grammar
    library) and put it in OpenAI's shape; False with ``row.error`` set when it is bad."""
    value = row.kwargs.get("response_format")
    if value is None:
        return True
    import importlib.util

    if importlib.util.find_spec("xgrammar") is None:
        row.error = f'{row.where}: response_format needs the library xgrammar: pip install "hf_contbatch[structured]"'
        return False
    try:
        row.kwargs["response_format"] = as_response_format(value, row.where)
    except UsageError as exc:
        row.error = str(exc)
        return False
    return True


def _groups(batch: list[Row], size: int) -> Iterator[list[Row]]:
    """Consecutive rows with the same call arguments, at most ``size`` a group (one ``prepare`` each)."""
    for _, same in itertools.groupby(batch, key=lambda r: json.dumps(r.kwargs, sort_keys=True, default=str)):
        same = list(same)
        for i in range(0, len(same), size):
            yield same[i : i + size]


def error_record(row: Row, message: str, openai: bool) -> dict:
    """The record of a row that did not run: ``{"index", "id", "error"}``, or OpenAI's batch output
    error record (``openai``: the input is an OpenAI batch request file)."""
    if openai:
        return {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": row.id,
            "index": row.index,
            "response": None,
            "error": {"code": "invalid_request", "message": message},
        }
    return {"index": row.index, row.id_key: row.id, "error": message}


def output_record(row: Row, handles, records: list[dict], kwargs: dict, model_name: str, created: int) -> dict:
    """A finished row's record (see the module docstring)."""
    if row.openai is None:
        record = {
            "index": row.index,
            "id": row.id,
            "prompt": row.prompt,
            "generated_text": records[0]["generated_text"],
        }
        adapter = {**kwargs, **row.kwargs}.get("adapter_names")
        if isinstance(adapter, str):
            record["adapter"] = adapter
        return record
    stops = {**kwargs, **row.kwargs}.get("stop_strings") or []
    choices = []
    for k, (h, rec) in enumerate(zip(handles, records)):
        text, reason = rec["generated_text"], h.request.finish_reason
        for stop in stops:  # OpenAI's text ends before the stop sequence
            if text.endswith(stop):
                text, reason = text[: -len(stop)], "stop"
                break
        reason = "length" if reason == "length" else "stop"
        if row.openai == "/v1/chat/completions":
            choices.append({"index": k, "message": {"role": "assistant", "content": text}, "finish_reason": reason})
        else:
            choices.append({"index": k, "text": text, "finish_reason": reason})
    prompt_tokens = len(handles[0].request.prompt_token_ids)
    completion_tokens = sum(len(h.request.output_token_ids) for h in handles)
    request_id = f"req_{uuid.uuid4().hex}"
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": row.id,
        "index": row.index,
        "response": {
            "status_code": 200,
            "request_id": request_id,
            "body": {
                "id": ("chatcmpl-" if row.openai == "/v1/chat/completions" else "cmpl-") + uuid.uuid4().hex,
                "object": "chat.completion" if row.openai == "/v1/chat/completions" else "text_completion",
                "created": created,
                "model": model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        },
        "error": None,
    }
