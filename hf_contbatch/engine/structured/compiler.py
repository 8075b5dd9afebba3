"""Compiling grammars against one engine's tokenizer, off the engine's thread, with a cache.

Compiling precomputes, for each grammar position, which vocabulary tokens may follow (xgrammar's
adaptive token mask cache): milliseconds for a small schema on a 4k vocabulary, more for large
schemas and vocabularies. It runs in a worker thread owned by the engine so that the decode steps
of other requests go on meanwhile; a request waits (``Request.waiting_for_grammar``) until its
grammar is ready, as in vLLM. Compiled grammars are cached per ``GrammarSpec.key`` (this object
belongs to one engine, so to one tokenizer): the same schema compiles once.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from .specs import GrammarSpec, import_xgrammar


class GrammarCompilation:
    """The compiled grammars of one engine.

    Args:
        tokenizer: the Hugging Face tokenizer whose token ids the model produces; None when the
            engine was built without one (structured outputs are then refused at submit).
        vocab_size: the model's logits width (LM-head rows; may exceed the tokenizer's length).
        max_cached: most compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer, vocab_size: int, max_cached: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._compiled: "OrderedDict[tuple, Future]" = OrderedDict()
        self._lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None  # started on the first compile
        self._compiler = None  # xgrammar.GrammarCompiler, built in the worker thread
        self._tokenizer_info = None
        self._closed = False

    def check_ready_for(self, spec: Optional[GrammarSpec]) -> None:
        """Raise ``ValueError`` when a request with ``spec`` could not be served (no tokenizer)."""
        if spec is not None and self.tokenizer is None:
            raise ValueError(
                "`structured_outputs` needs the tokenizer to map the grammar onto token ids: build the "
                "engine with LLMEngine(model, config, tokenizer=...)"
            )

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar of ``spec`` (done at once on a cache hit).

        Raises:
            RuntimeError: the engine is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            future = self._compiled.get(spec.key)
            if future is not None:
                self._compiled.move_to_end(spec.key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_contbatch-grammar")
            future = self._executor.submit(self._compile, spec)
            self._compiled[spec.key] = future
            while len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)
            return future

    def forget_failed(self, spec: GrammarSpec) -> None:
        """Drop a failed compile from the cache so that the next request with ``spec`` retries."""
        with self._lock:
            future = self._compiled.get(spec.key)
            if future is not None and future.done() and future.exception() is not None:
                del self._compiled[spec.key]

    @property
    def tokenizer_info(self):
        """The ``xgrammar.TokenizerInfo`` (None before the first compile finished)."""
        return self._tokenizer_info

    def _compile(self, spec: GrammarSpec):
        """In the worker thread: the compiler (once), then the grammar."""
        if self._compiler is None:
            xgr = import_xgrammar()
            self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            # Few threads: compiling shares the cores with the decode steps it must not hold up
            # (xgrammar releases the GIL while it compiles).
            self._compiler = xgr.GrammarCompiler(
                self._tokenizer_info, max_threads=max(1, (os.cpu_count() or 2) // 2 - 1)
            )
        return self._compiler.compile_grammar(spec.grammar)

    def close(self) -> None:
        """Stop the worker thread (a compile in progress finishes in the background); idempotent."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
            self._compiled.clear()
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
