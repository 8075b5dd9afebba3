"""``GenerationHandle``: one prompt submitted with ``ContinuousBatchingPipeline.submit``, to stream its
text, wait for its records, or cancel it (also from asyncio code)."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Iterator, Optional, Sequence

from ..engine.handles import EngineError, RequestHandle
from ..request import RequestMetrics
from .streaming import text_deltas
from .text_io import OutputOptions, TextInput, output_record, skip_special_tokens


def records_so_far(
    tokenizer, prompt: TextInput, handles: Sequence[RequestHandle], options: OutputOptions
) -> list[dict]:
    """The output records of a prompt's sequences now: a finished one's record, a failed or
    cancelled one's with the text it had generated."""
    return [output_record(tokenizer, prompt, h.output(), options) for h in handles]


def _cancel_if_abandoned(handles: list[RequestHandle], abandoned: list[bool]) -> None:
    """Finalizer of a ``GenerationHandle``: nothing can reach its requests any more; if a stream of
    it was left early, stop them (their KV blocks go to other requests)."""
    if abandoned[0]:
        for h in handles:
            if not h.done():
                h.cancel()


class GenerationHandle:
    """A prompt submitted with ``ContinuousBatchingPipeline.submit``: the pipeline ``pipe``, the
    ``prompt``, the ``handles`` of its sequences, and its ``OutputOptions``.

    Iterating yields text deltas as tokens arrive; ``result()`` returns the same records
    ``__call__`` returns for one prompt; ``cancel()`` stops it (its partial text is kept).

    Leaving an iteration early: a KeyboardInterrupt (the notebook's Stop) while the loop waits for
    tokens cancels the prompt's requests and re-raises. After a ``break`` the request is cancelled
    when nothing else holds the handle (``for delta in pipe.submit(...): ... break``: nobody could
    ever read the rest); a handle you keep (``h = pipe.submit(...)``) keeps generating, and
    ``h.result()`` or ``h.cancel()`` decide.
    """

    def __init__(self, pipe, prompt: TextInput, handles: list[RequestHandle], options: OutputOptions):
        self._pipe = pipe  # kept alive while the handle lives: closing it would fail the requests
        self.prompt = prompt
        self.handles = handles
        self._options = options
        # Set when a stream is left early; the finalizer (run when the last reference goes) reads it.
        self._abandoned = [False]
        weakref.finalize(self, _cancel_if_abandoned, handles, self._abandoned)

    def done(self) -> bool:
        """True once every sequence of the prompt finished; never blocks."""
        return all(h.done() for h in self.handles)

    def cancel(self) -> None:
        """Stop every sequence of the prompt (freed at the engine's next reap step; partial text is
        kept, finish reason "cancelled"). Never raises."""
        for h in self.handles:
            h.cancel()

    def result(self, timeout: Optional[float] = None) -> list[dict]:
        """Records ``[{"generated_text": ...}] * num_return_sequences``; raises ``EngineError`` or
        ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outs = []
        try:
            for h in self.handles:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                outs.append(h.result(left))
        except KeyboardInterrupt:
            # All sequences of this prompt, not only the one waited on.
            self._pipe.engine.driver.cancel_now(self.handles)
            raise
        except EngineError as exc:
            exc.partial_results = records_so_far(self._pipe.tokenizer, self.prompt, self.handles, self._options)
            raise
        return [output_record(self._pipe.tokenizer, self.prompt, o, self._options) for o in outs]

    def metrics(self) -> list[RequestMetrics]:
        """Per sequence, its ``RequestMetrics`` now (times so far; ``ttft``, ``itl`` in seconds);
        never blocks."""
        return [RequestMetrics.of(h.request) for h in self.handles]

    def finish_reasons(self) -> list[Optional[str]]:
        """Per sequence: "stop", "length", "cancelled", "error", or None while it runs."""
        return [h.request.finish_reason for h in self.handles]

    # --- streaming ---------------------------------------------------------------------------------
    def stream(self, index: int = 0) -> Iterator[str]:
        """Text deltas of sequence ``index`` as its tokens arrive (blocking iterator).

        Deltas never split a multi-byte character and never contain any part of a stop string: text
        that could still become one is held back, and the stream ends before the stop string (the
        final ``generated_text`` keeps it, as transformers does). Without stop strings the deltas
        concatenate to the sequence's new text. Each sequence can be streamed once.

        Leaving early: see the class docstring (Stop cancels; ``break`` cancels when nothing else
        holds this handle).

        Raises:
            EngineError: the engine failed the request.
            KeyboardInterrupt: interrupted while waiting; this sequence is cancelled first.
        """
        handle = self.handles[index]
        finished = False
        try:
            yield from text_deltas(
                handle.token_stream(),
                self._pipe.tokenizer,
                stop_strings=self._options.stop_strings,
                skip_special_tokens=skip_special_tokens(self._pipe.tokenizer, self._options),
                clean_up_tokenization_spaces=self._options.clean_up_tokenization_spaces,
            )
            finished = True
        except KeyboardInterrupt:
            self._pipe.engine.driver.cancel_now([handle])  # Stop while the stream waits: this sequence only
            # A fresh exception: its traceback ends here, not deep in a queue wait or a decoder.
            raise KeyboardInterrupt(f"streaming interrupted; request {handle.request_id} cancelled") from None
        finally:
            if not finished:
                self._abandoned[0] = True
        handle.result()  # surfaces an engine error instead of ending the stream silently

    def __iter__(self) -> Iterator[str]:
        """Text deltas of the first sequence (see ``stream``)."""
        return self.stream(0)

    async def astream(self, index: int = 0):
        """``async for delta in handle.astream()``: ``stream(index)`` for asyncio code and notebooks.

        A helper thread waits on the engine so the event loop never blocks.
        """
        loop = asyncio.get_running_loop()
        deltas: "asyncio.Queue[tuple[Optional[str], Optional[BaseException]]]" = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(deltas.put_nowait, item)
            except RuntimeError:  # the loop closed while we were still streaming
                pass

        def pump() -> None:
            try:
                for delta in self.stream(index):
                    put((delta, None))
                put((None, None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                put((None, exc))

        threading.Thread(target=pump, name="hf_contbatch-astream", daemon=True).start()
        while True:
            delta, exc = await deltas.get()
            if exc is not None:
                raise exc
            if delta is None:
                return
            yield delta

    async def aresult(self) -> list[dict]:
        """``await handle.aresult()``: ``result()`` without blocking the event loop."""
        loop = asyncio.get_running_loop()
        futures = []
        for h in self.handles:
            fut = loop.create_future()

            def done(_h, fut=fut) -> None:
                try:
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
                except RuntimeError:
                    pass

            h.add_done_callback(done)
            futures.append(fut)
        await asyncio.gather(*futures)
        return self.result()
