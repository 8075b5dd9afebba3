"""A pipeline call over an input of any size: prompts pulled lazily, a bounded number in flight,
records yielded in input order as soon as the head of the queue is done.

``ContinuousBatchingPipeline.__call__`` takes this path for generators, ``datasets`` columns,
``KeyDataset`` and other torch ``Dataset``s (``__getitem__`` + ``__len__``), any other iterable, and
for lists when ``batch_size`` is given. At most ``in_flight`` prompts (``in_flight_limit``) are
pulled and not yet yielded at any time: queued, running, or finished and waiting behind an earlier
one still running. So memory holds ``in_flight`` prompts and records whatever the input's size,
and a finished request's KV blocks go to the next prompt at the engine's next iteration.

Prompts are built into requests in chunks (``CallRequestBuilder.prepare`` resolves the call's
generation config once per chunk, not once per prompt) and queued with ``LLMEngine.enqueue``; the
consumer's thread drives the engine while it waits for the head (``EngineDriver.drive``).

Leaving early - the consumer stops iterating (``break``, ``close()``, the generator collected), a bad
input, an engine error, an interrupt - cancels every request of the call still in flight before the
exception propagates (``EngineDriver.cancel_now``): no request keeps running and no block stays
held, and the pipeline serves the next call.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Callable, Optional

from ..config import is_int
from ..engine.handles import EngineError, RequestHandle
from ..request import LatencySamples, RequestMetrics
from .generation_handle import records_so_far
from .text_io import OutputOptions, is_chat

# Call arguments that may hold one value per input (a list); a streamed call hands each chunk its slice.
PER_INPUT_KWARGS = ("max_new_tokens", "priority", "adapter_names", "response_format", "structured_outputs")
# Prompts in flight per running slot (``max_num_seqs``) when ``batch_size`` is not given: one batch
# running, one queued behind it so a finished request's slot is refilled at the next iteration, and
# two of slack for finished records waiting behind a long request at the head.
IN_FLIGHT_PER_SEQ = 4


def in_flight_limit(batch_size, max_num_seqs: int) -> int:
    """The most prompts of a streamed call pulled from its input and not yet yielded: ``batch_size``
    when given, else ``IN_FLIGHT_PER_SEQ * max_num_seqs``.

    Raises:
        ValueError: ``batch_size`` is not None and not an int >= 1.
    """
    if batch_size is None:
        return IN_FLIGHT_PER_SEQ * max_num_seqs
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an int >= 1 (the most prompts in flight at once), got {batch_size!r}")
    return int(batch_size)


def is_indexed_dataset(inputs) -> bool:
    """A map-style dataset (torch ``Dataset`` such as ``KeyDataset``): ``__getitem__`` and ``__len__``
    but no ``__iter__``."""
    return not isinstance(inputs, Iterable) and hasattr(inputs, "__getitem__") and hasattr(inputs, "__len__")


def _elements(inputs) -> Iterator:
    """The input's elements in order, pulled one at a time."""
    if is_indexed_dataset(inputs):
        return (inputs[i] for i in range(len(inputs)))
    return iter(inputs)


def _pull(source: Iterator, n: int) -> tuple[list, Optional[Exception]]:
    """Up to ``n`` elements of ``source``, and the exception its iteration raised, if any: the elements
    pulled before it still run and are yielded, as transformers' pipeline yields them, before the
    exception propagates (``KeyboardInterrupt`` and other non-``Exception`` errors propagate at once)."""
    batch: list = []
    try:
        for element in itertools.islice(source, n):
            batch.append(element)
    except Exception as exc:  # noqa: BLE001 - the user's iterable; re-raised after the earlier records
        return batch, exc
    return batch, None


def check_element(index: int, element) -> None:
    """Raise ``ValueError`` naming input ``index`` unless ``element`` is a prompt (a string or a chat)."""
    if isinstance(element, str) or is_chat(element):
        return
    hint = ""
    if isinstance(element, dict):
        keys = ", ".join(repr(k) for k in list(element)[:5])
        hint = (
            f" (a dataset row with the keys {keys}? pass one column: KeyDataset(ds, 'text') from "
            "transformers.pipelines.pt_utils, or ds['text'])"
        )
    raise ValueError(
        f"input {index}: must be a string or a chat (list of role/content dicts), got {type(element).__name__}{hint}"
    )


def slice_per_input(kwargs: dict, start: int, stop: int) -> dict:
    """``kwargs`` for inputs ``start:stop`` of the call: every per-input list cut to that slice.

    Raises:
        ValueError: a per-input list has fewer entries than the inputs pulled so far.
    """
    out = dict(kwargs)
    for key in PER_INPUT_KWARGS:
        value = kwargs.get(key)
        if isinstance(value, (list, tuple)):
            if len(value) < stop:
                raise ValueError(
                    f"`{key}` has {len(value)} entries but the input has more (input {len(value)} has none); "
                    "give one value, or one per input"
                )
            out[key] = list(value[start:stop])
    return out


def call_level_kwargs(kwargs: dict) -> dict:
    """``kwargs`` with each per-input list replaced by its first entry (dropped when empty): what
    ``CallRequestBuilder.prepare([], ...)`` checks before a streamed call pulls its first input."""
    out = dict(kwargs)
    for key in PER_INPUT_KWARGS:
        value = kwargs.get(key)
        if isinstance(value, (list, tuple)):
            if value:
                out[key] = value[0]
            else:
                del out[key]
    return out


@dataclass
class _Entry:
    """One input in flight: its position, its prompt, its sequences' handles and output options."""

    index: int
    prompt: object
    handles: list[RequestHandle]
    output: OutputOptions

    def done(self) -> bool:
        return all(h.done() for h in self.handles)


class StreamedCall:
    """One streamed pipeline call; iterate it (once) for the records of each input in input order.

    Args:
        pipe: the ``ContinuousBatchingPipeline`` (held: closing it would fail the requests).
        inputs: the prompts: an iterable, or a map-style dataset (``is_indexed_dataset``).
        kwargs: the call's keyword arguments (per-input lists allowed: ``PER_INPUT_KWARGS``).
        in_flight: the most prompts pulled and not yet yielded (``in_flight_limit``).
        show: draw a progress bar (``tqdm.auto``; its total is ``len(inputs)`` where known).
        on_end: called once when the iteration ends (finished, left early or failed) with the call's
            figures: ``(num_requests, generated_tokens, seconds, preemptions, latency)``, ``latency``
            the ``LatencySamples`` of the sequences yielded.

    Each item is what ``pipe(prompt)`` returns for one prompt: a list of ``{"generated_text": ...}``,
    one per returned sequence.

    Raises (from iterating):
        ValueError: input ``i`` is not a prompt or its request is invalid (the message starts with
            ``input i:``), raised after the records of every input before it; nothing after it runs.
        Exception: whatever iterating ``inputs`` raised, after the records of every input pulled
            before it.
        EngineError: the engine failed input ``i``'s request (``input i:``); ``partial_results`` holds
            its records with the text generated before the failure.
        RuntimeError: the pipeline was closed meanwhile.
        KeyboardInterrupt: interrupted; the call's requests in flight are cancelled first.
    """

    def __init__(
        self,
        pipe,
        inputs,
        kwargs: dict,
        *,
        in_flight: int,
        show: bool,
        on_end: Callable[[int, int, float, int, LatencySamples], None],
    ) -> None:
        self._pipe = pipe
        self._on_end = on_end
        self._inputs = inputs
        self._kwargs = kwargs
        self.in_flight = in_flight
        self._show = show
        self.pulled = 0  # inputs taken from ``inputs`` so far

    def __iter__(self) -> Iterator[list[dict]]:
        engine = self._pipe.engine
        source = _elements(self._inputs)
        total = len(self._inputs) if isinstance(self._inputs, Sized) else None
        # Refill in chunks: building requests costs a generation-config resolution per chunk.
        chunk = max(1, self.in_flight // 8)
        max_num_seqs = engine.config.scheduler.max_num_seqs
        inflight: deque[_Entry] = deque()
        counts = {"submitted": 0, "finished": 0}  # handles; the callback runs in the iterating thread
        stats = {"requests": 0, "tokens": 0, "preemptions": 0, "latency": LatencySamples()}
        exhausted = False
        bad_input: Optional[Exception] = None  # raised once every input before it was yielded
        bar = None
        # Bound here: a generator abandoned until interpreter exit runs its finally block after the
        # modules' globals were cleared; then the engine's exit hook has closed the engine already,
        # and there is nothing left to cancel or count.
        clock, finalizing = time.monotonic, sys.is_finalizing
        t0 = clock()

        def finished(_handle) -> None:
            counts["finished"] += 1

        try:
            if self._show:
                from tqdm.auto import tqdm

                bar = tqdm(total=total, desc="hf_contbatch", unit="req")
            while True:
                room = self.in_flight - len(inflight)
                running = counts["submitted"] - counts["finished"]
                # Refill when a whole chunk fits, or sooner when the engine would run out of work.
                if not exhausted and room > 0 and (room >= chunk or running < max_num_seqs):
                    batch, input_error = _pull(source, room)
                    exhausted = len(batch) < room
                    if exhausted and input_error is None:
                        self._check_per_input_lengths(self.pulled + len(batch))
                    entries: list[_Entry] = []
                    if batch:
                        entries, bad_input = self._submit(batch)
                    if bad_input is None:  # a bad element comes before the input's own error
                        bad_input = input_error
                    exhausted = exhausted or bad_input is not None
                    for entry in entries:
                        for h in entry.handles:
                            h.add_done_callback(finished)
                        counts["submitted"] += len(entry.handles)
                        inflight.append(entry)
                if not inflight:
                    if bad_input is not None:  # every input before it was yielded
                        raise bad_input
                    break
                self._wait(engine, inflight[0].handles)
                while inflight and inflight[0].done():
                    entry = inflight.popleft()
                    records = self._records(entry, stats)
                    if bar is not None:
                        bar.update(1)
                    yield records
        finally:
            if not finalizing():
                pending = [h for entry in inflight for h in entry.handles if not h.done()]
                if pending and not engine.closed:
                    engine.driver.cancel_now(pending)
                if bar is not None:
                    bar.close()
                self._on_end(stats["requests"], stats["tokens"], clock() - t0, stats["preemptions"], stats["latency"])

    def _check_per_input_lengths(self, num_inputs: int) -> None:
        for key in PER_INPUT_KWARGS:
            value = self._kwargs.get(key)
            if isinstance(value, (list, tuple)) and len(value) != num_inputs:
                raise ValueError(
                    f"`{key}` has {len(value)} entries for {num_inputs} inputs; give one value or one per input"
                )

    def _submit(self, batch: list) -> tuple[list[_Entry], Optional[ValueError]]:
        """Build and queue the requests of the next ``len(batch)`` inputs; returns their entries and,
        when one is bad, the ``ValueError`` naming it (the inputs before it are queued, not the rest).
        """
        start = self.pulled
        self.pulled += len(batch)
        for offset, element in enumerate(batch):
            try:
                check_element(start + offset, element)
            except ValueError as exc:
                return self._submit_before(batch, offset, exc)
        builder = self._pipe._call_requests
        try:
            call = builder.prepare(batch, slice_per_input(self._kwargs, start, start + len(batch)))
        except ValueError as exc:
            # Which input? Build them one by one: the first that fails is named (none of the
            # batch's requests were queued, so nothing leaks).
            for offset, element in enumerate(batch):
                index = start + offset
                try:
                    builder.prepare([element], slice_per_input(self._kwargs, index, index + 1))
                except ValueError as one:
                    error = ValueError(f"input {index}: {one}")
                    error.__cause__ = one
                    return self._submit_before(batch, offset, error)
            raise exc
        return self._enqueue(start, call), None

    def _submit_before(self, batch: list, offset: int, error: ValueError) -> tuple[list[_Entry], ValueError]:
        """The inputs of ``batch`` before the bad one at ``offset`` queued, and ``error`` to raise once
        their records are yielded."""
        start = self.pulled - len(batch)
        if offset == 0:
            return [], error
        call = self._pipe._call_requests.prepare(batch[:offset], slice_per_input(self._kwargs, start, start + offset))
        return self._enqueue(start, call), error

    def _enqueue(self, start: int, call) -> list[_Entry]:
        submitted = self._pipe.engine.enqueue(call.requests)
        return [
            _Entry(start + offset, prompt, handles, call.output)
            for offset, (prompt, handles) in enumerate(zip(call.prompts, submitted))
        ]

    @staticmethod
    def _wait(engine, handles: list[RequestHandle]) -> None:
        """Block until every handle is done; drive the engine in this thread where it lets us."""
        if engine.driver.blocking_calls_drive:
            engine.driver.drive(lambda: all(h.done() for h in handles))
        for h in handles:  # the background thread runs them (a live dashboard), or they are done
            while not h.wait(0.5):
                if engine.closed:
                    raise RuntimeError("the pipeline was closed while this call was running")

    def _records(self, entry: _Entry, stats: dict) -> list[dict]:
        """The entry's output records; raises ``EngineError`` naming its input if the engine failed it."""
        stats["requests"] += len(entry.handles)
        stats["tokens"] += sum(len(h.request.output_token_ids) for h in entry.handles)
        stats["preemptions"] += sum(h.request.num_preemptions for h in entry.handles)
        stats["latency"].extend(RequestMetrics.of(h.request) for h in entry.handles)
        records = records_so_far(self._pipe.tokenizer, entry.prompt, entry.handles, entry.output)
        for h in entry.handles:
            if h.request.error is not None:
                try:
                    h.result()
                except EngineError as exc:
                    error = EngineError(f"input {entry.index}: {exc}", exc.output)
                    error.partial_results = records
                    raise error from exc
        return records
