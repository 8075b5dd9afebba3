"""The engine: continuous batching over a paged KV cache for one transformers causal LM.

Callers ``submit()`` token ids and get a ``RequestHandle`` back; they wait on events, never spin (a
spinning waiter takes the cores the model's OpenMP threads run on). Errors in an iteration fail the
affected requests' handles with the exception and the engine keeps serving; ``close()`` stops the
thread, frees the KV pool and restores the model's attention.

This file holds the iteration (``LLMEngine.step``: reap -> budget -> admit -> preempt -> decode)
and a request's life in the engine. The engine holds objects with one job each: ``KVPools`` (the
cache and its block bookkeeping, sized by ``pool_sizing.KVPoolSizer``), ``ModelPatches`` (what it
changes on the model, undone by ``close``), a ``RequestFactory`` (the one place requests are
validated), a ``HandleRegistry`` (the handles it streams to and finishes), and an ``EngineDriver``
(which thread runs iterations; it calls the engine back through ``driver.DrivenEngine``). Around
them: ``stats`` (counters and ``EngineStats``), ``stopping`` (when a request ends), and
``structured.GrammarMatchers`` (the grammars of requests with structured outputs: compiled in a
worker thread, one matcher per request, advanced on the tokens it keeps).

A request's path: ``build_request`` (validate, no side effect) -> ``enqueue`` (register handles,
put into the driver's inbox) -> ``take_inbox`` (to the scheduler) -> ``step`` -> ``_complete``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Callable, Optional, Sequence

import torch

from ..config import EngineConfig
from ..core.phases import PhaseTimer
from ..core.plan import StepResult
from ..core.scheduler import Scheduler
from ..request import Request, RequestStatus, SamplingParams
from .driver import Cancel, EngineDriver, InboxItem
from .handles import EngineError, HandleRegistry, RequestHandle, RequestOutput
from .kv_pools import KVPools, move_blocks
from .lora_adapters import LoraAdapters, is_peft_model
from .model_patches import ModelPatches
from .pool_sizing import text_config
from .reliability import execute_isolating_failures
from .request_factory import RequestFactory
from .runner import ModelRunner
from .sampler import Sampler
from .stats import EngineCounters, EngineStats
from .stopping import finish_status
from .structured import GrammarCompilation, GrammarMatchers

logger = logging.getLogger(__name__)

__all__ = ["EngineError", "EngineStats", "LLMEngine", "RequestHandle", "RequestOutput", "SUPPORTED_MODEL_TYPES"]

# Families whose attention goes through transformers' AttentionInterface and whose layers call
# ``cache.update(...)`` right before attention (tests/engine/test_engine_equivalence.py checks greedy equality).
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "phi3",
    "granite",
    "olmo2",
    "smollm3",
)


def check_supported_model(model) -> None:
    """Raise ``ValueError`` naming the supported families unless ``model`` is one of them and its
    attention goes through transformers' ``AttentionInterface``."""
    model_type = getattr(text_config(model), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not getattr(model, "_supports_attention_backend", True):
        raise ValueError(
            f"model type {model_type!r} is not supported by hf_contbatch; supported families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def vocab_widths(model) -> tuple[int, int]:
    """(input embedding rows: every prompt id must index them; logits width: the LM head's rows, which
    may exceed the tokenizer's vocabulary and are what a grammar's bitmask must cover)."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return vocab_size, head.weight.shape[0] if getattr(head, "weight", None) is not None else vocab_size


def register_close_at_exit(engine: "LLMEngine") -> Callable[[], None]:
    """Register (and return, for ``atexit.unregister``) a hook that closes ``engine`` at interpreter
    exit if it is still alive. Why: a script that ends with requests in flight and no ``close()``
    would otherwise leave the engine's daemon thread inside torch's kernels while the interpreter
    tears down, and the process aborts. The hook holds a weak reference: it keeps nothing alive."""
    engine_ref = weakref.ref(engine)

    def close() -> None:
        alive = engine_ref()
        if alive is not None:
            alive.close()

    atexit.register(close)
    return close


def seeded_generator(seed: Optional[int]) -> torch.Generator:
    """The engine's CPU sampling generator, seeded with ``seed`` (None: from ``os.urandom``)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return gen


def _fail_in_step(req: Request, exc: Exception) -> None:
    """Fail one request during a step: it keeps its tokens, the next reap frees its blocks and
    finishes its handle (its pending forks with it); the other requests are untouched."""
    logger.error("request %s failed after %d generated tokens: %r", req.request_id, len(req.output_token_ids), exc)
    req.error = exc
    req.status = RequestStatus.FINISHED_ERROR
    for child in req.pending_forks:
        child.error = exc


class LLMEngine:
    """Continuous batching over a paged KV cache for one transformers causal LM.

    Args:
        model: a ``PreTrainedModel`` of a supported family (``SUPPORTED_MODEL_TYPES``), or a
            ``peft.PeftModel`` over one, whose LoRA adapters requests choose per request
            (``SamplingParams.adapter_name``).
        config: engine configuration.
        tokenizer: the model's Hugging Face tokenizer; needed only by requests with
            ``SamplingParams.structured_outputs`` (their grammars are compiled against it).

    Raises:
        ValueError: unsupported model family, a pool that does not fit in memory, or a PEFT
            feature per-request adapters cannot serve (named in the message).
    """

    def __init__(self, model, config: Optional[EngineConfig] = None, tokenizer=None) -> None:
        self.config = cfg = config or EngineConfig()
        self.model = model
        # A peft.PeftModel runs as its inner model, its LoRA adapters per row (lora_adapters).
        self.adapters = LoraAdapters(model) if is_peft_model(model) else None
        model = model if self.adapters is None else self.adapters.model
        check_supported_model(model)
        pools = KVPools.for_model(model, cfg)
        g, sizes = pools.geometry, pools.sizes
        self.num_layers, self.num_kv_heads, self.head_dim = g.num_layers, g.num_kv_heads, g.head_dim
        self.max_model_len, self.device, self.backend = g.max_model_len, pools.device, pools.backend
        self.vocab_size, logits_width = vocab_widths(model)
        self.pool_sizing: dict[str, str] = dict(sizes.reasons)  # pool -> why it has its size (dashboard)
        self.cache, bm, host_bm = pools.cache, pools.block_manager, pools.host_block_manager
        self.block_manager, self.host_block_manager = bm, host_bm
        self.grammars = GrammarMatchers(GrammarCompilation(tokenizer, logits_width))
        self.scheduler = Scheduler(
            cfg.scheduler,
            bm,
            host_block_manager=host_bm,
            swap_cost_per_block=sizes.swap_cost_per_block,
            draft_filter=self.grammars.draft_prefix,
        )
        self.sampler = Sampler(seeded_generator(cfg.seed), self.grammars)
        self.runner = ModelRunner(
            model, self.cache, self.device, self.sampler, bm.block_size, cfg.scheduler.max_num_batched_tokens
        )
        self.patches = ModelPatches(model, cfg, self.cache, self.runner)  # linears, attention, compiled forward
        self.packed_linears, self.compiled_forward = self.patches.packed_linears, self.patches.compiled_forward
        self.request_factory = RequestFactory(
            self.vocab_size, g.max_model_len, bm, cfg.prompt_lookup_num_tokens, self.adapters, self.grammars.compilation
        )
        self._handles = HandleRegistry(self)
        self._closed = False
        # Guards the scheduler's and block managers' state: held by the driving thread while it
        # changes them (not during the forward), and by ``stats()`` for one consistent snapshot.
        self._state_lock = threading.RLock()
        self.counters = EngineCounters(record_phases=cfg.record_phases, per_adapter=self.adapters is not None)
        self.driver = EngineDriver(self, drive_in_caller=cfg.drive_in_caller, num_threads=cfg.num_threads)
        self._close_at_exit = register_close_at_exit(self)  # a script that ends without close()

    @property
    def phase_log(self):
        """``(iteration, ((phase, seconds), ...))`` of recent iterations, oldest first (a deque)."""
        return self.counters.phase_log

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: submits raise, the pool is released."""
        return self._closed

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole device pool holds (blocks x block size)."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    # --- requests in -----------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        stop_checker: Optional[Callable[[Request], bool]] = None,
        num_return_sequences: Optional[int] = None,
    ) -> "RequestHandle | list[RequestHandle]":
        """Queue a request (``build_request`` then ``enqueue``); returns its ``RequestHandle`` at once,
        or a list of them when ``num_return_sequences`` is given.

        Args:
            prompt_token_ids: the prompt as a non-empty sequence of ints.
            sampling: its sampling parameters.
            priority: lower is served first.
            stop_checker: called after each new token (engine thread); True finishes with "stop".
            num_return_sequences: None for one sequence (returns a handle); an int n >= 1 returns a
                list of n handles, sequences that share the prompt's KV (``RequestFactory.build``).

        Raises:
            ValueError: empty prompt, a token id outside the model's input embedding (the message
                names the id, its position and the vocabulary size), a sampling value out of range,
                a request that can never fit (prompt + 1 token beyond the model's context, or
                prompt + max_new_tokens beyond the whole KV pool), ``num_return_sequences`` not a
                positive int, an unknown ``sampling.adapter_name`` (the message lists the loaded
                adapters), or a ``structured_outputs`` the grammar library refuses (the message
                names the problem). Nothing enters the engine then.
            ImportError: ``structured_outputs`` without xgrammar installed (names the extra).
            RuntimeError: the engine is closed.
        """
        req = self.build_request(prompt_token_ids, sampling, priority, stop_checker, num_return_sequences)
        handles = self.enqueue([req])[0]
        return handles[0] if num_return_sequences is None else handles

    def build_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        stop_checker: Optional[Callable[[Request], bool]] = None,
        num_return_sequences: Optional[int] = None,
    ) -> Request:
        """Validate and build a request without queueing it (arguments and errors as ``submit``),
        so that a caller with many prompts can check them all before queueing any (``enqueue``)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        return self.request_factory.build(prompt_token_ids, sampling, priority, stop_checker, num_return_sequences)

    def enqueue(self, requests: Sequence[Request]) -> list[list[RequestHandle]]:
        """Queue requests from ``build_request``, all at once; returns at once. A request arrives
        (``arrival_time``, from which TTFT counts) when it is queued (``EngineDriver.add``).

        Returns:
            per request, the handles of its sequences: its own, then its forks'.

        Raises:
            RuntimeError: the engine is closed; nothing is queued then.
        """
        handles = self._handles.open(requests)  # before the requests can run: they stream to them
        try:
            self.driver.add(requests)
        except RuntimeError:  # closed
            self._handles.discard(handles)
            raise
        return handles

    def cancel(self, request_id: int) -> None:
        """Ask the engine to stop request ``request_id`` (freed at the next reap, finish reason
        "cancelled", tokens so far kept). Unknown or finished ids are ignored; never raises."""
        self.driver.cancel(request_id)

    def cancel_now(self, handles: Sequence[RequestHandle]) -> None:
        """Cancel these requests and release them before returning (see ``EngineDriver.cancel_now``)."""
        self.driver.cancel_now(handles)

    def drive(self, until: Callable[[], bool], after_iteration: Optional[Callable[[], None]] = None) -> None:
        """Run iterations in the calling thread until ``until()`` is true (see ``EngineDriver.drive``)."""
        self.driver.drive(until, after_iteration)

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until idle or ``timeout`` seconds passed; True if idle (see ``EngineDriver.wait_idle``)."""
        return self.driver.wait_idle(timeout)

    def add_live_view(self, view) -> None:
        """Register a live view (see ``EngineDriver.add_live_view``)."""
        self.driver.add_live_view(view)

    @property
    def blocking_calls_drive(self) -> bool:
        """Whether blocking calls run iterations in their own thread (see ``EngineDriver``)."""
        return self.driver.blocking_calls_drive

    drives_callers = blocking_calls_drive  # the former name

    def in_iteration(self) -> bool:
        """True when called from inside an iteration (e.g. from a request's done-callback)."""
        return self.driver.in_iteration()

    def stats(self) -> EngineStats:
        """An immutable snapshot of the pool, the queues, the counters and the phase timings (see
        ``EngineStats`` for fields and units), taken between two changes of the scheduler's state.
        Never raises; callable from any thread, also after ``close()``."""
        with self._state_lock:
            return self.counters.snapshot(self.scheduler, self.block_manager, self.host_block_manager)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (as vLLM's ``LLM.reset_prefix_cache``), e.g. between
        benchmark passes over the same prompts. False, changing nothing, while requests hold blocks."""
        with self._state_lock:
            return self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Stop the thread, fail what is still queued, free the pool, restore the model's attention."""
        if self._closed:
            return
        self._closed = True
        not_taken = [item for item in self.driver.stop() if isinstance(item, Request)]
        err = RuntimeError("the engine was closed before the request finished")
        self.fail_all(err, not_taken, status=RequestStatus.FINISHED_CANCELLED)
        self.grammars.compilation.close()
        self.patches.undo()
        self.cache.release()
        atexit.unregister(self._close_at_exit)

    # --- the iteration ---------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One iteration, the five steps in order, each one's seconds recorded under its name: reap
        (finished and cancelled requests leave, their blocks freed, handles completed); budget (free
        blocks minus reservations minus the watermark); admit (forks, swap-ins, waiting requests by
        rank whose grammar is ready, then drafts); preempt (until the running requests' blocks fit,
        then ``Scheduler.allocate_slots``); decode (swap/copy blocks, one batched forward, sample,
        append, ``stopping.finish_status``). Returns the iteration's plan and report. Raises
        ``RuntimeError`` outside the engine's driver (two threads must never iterate at once; to
        iterate in the calling thread use ``drive``)."""
        self.driver.check_in_iteration("LLMEngine.step()")
        sched, t0, timer = self.scheduler, time.monotonic(), PhaseTimer()
        with self._state_lock:
            result = sched.begin_iteration()
            result.report.reaped = sched.reap()
        for req in result.report.reaped:
            self._complete(req)
        timer.charge("reap")
        with self._state_lock:
            for req, exc in self.grammars.poll():  # grammars compiled since: admissible (or failed)
                _fail_in_step(req, exc)
            sched.plan(result, timer)  # budget, admit, preempt
        plan = result.plan
        if plan.is_empty and self.grammars.has_waiting:
            self.grammars.wait(timeout=0.05)  # nothing else to run: wait for a compile, not spin
        t_move = time.monotonic()
        move_blocks(self.cache, plan)
        swap_seconds = time.monotonic() - t_move
        # A failing forward is narrowed down to the requests that fail alone; the others advance.
        output, failed = execute_isolating_failures(self.runner.execute, plan)
        with self._state_lock:
            for s, exc in failed:
                _fail_in_step(s.request, exc)
            now = time.monotonic()
            sched.update_from_output(plan, output, on_token=lambda req: self._on_new_token(req, now))
            timer.charge("decode")
            result.report.phases = list(timer.as_tuple())
            used = self.block_manager.num_used_blocks
            self.counters.record_iteration(result, used, time.monotonic() - t0, swap_seconds)
        # Finished requests are released by the next reap; the driver makes sure there is one.
        return result

    def _on_new_token(self, req: Request, now: float) -> bool:
        """Count, stream, advance the grammar and stop-check the token just appended to ``req`` (one
        at a time, also for accepted drafts); True when ``req`` finished (the grammar's end finishes
        it as "stop"). An error here (a stop checker, a streamer, a grammar) fails ``req`` alone."""
        try:
            self.counters.record_token(req, now)
            self._handles.push_token(req)
            grammar_done = self.grammars.accept(req)
            status = finish_status(req) or (RequestStatus.FINISHED_STOPPED if grammar_done else None)
            if status is None and req.sampling.stopping_criteria and self.sampler.should_stop(req):
                status = RequestStatus.FINISHED_STOPPED  # the call's stopping_criteria, on its own ids
        except Exception as exc:  # noqa: BLE001 - a stop checker or stream of one request
            _fail_in_step(req, exc)
            return True
        if status is not None:
            req.status = status
        return status is not None

    def _complete(self, req: Request) -> None:
        req.finish_time = time.monotonic()
        self.sampler.forget(req.request_id)
        self.grammars.forget(req.request_id)
        with self._state_lock:
            self.counters.num_finished += 1
        self._handles.finish(req)

    # --- what the driver calls (``DrivenEngine``) ------------------------------------------------
    def has_requests(self) -> bool:
        """True while the scheduler holds requests (waiting, running or swapped)."""
        return self.scheduler.has_work

    def take_inbox(self, items: Sequence[InboxItem]) -> None:
        """Hand new requests and cancellations to the scheduler, in arrival order."""
        with self._state_lock:
            for item in items:
                if isinstance(item, Cancel):
                    self._handles.request_cancel(item.request_id)
                else:
                    self.grammars.track(item)  # its grammar compiles meanwhile; admission waits for it
                    self.scheduler.add_request(item)

    def release_finished(self) -> None:
        """A reap outside an iteration: free finished and cancelled requests, finish their handles."""
        with self._state_lock:
            reaped = self.scheduler.reap()
        for req in reaped:
            self._complete(req)

    def fail_all(
        self, exc: BaseException, not_taken: Sequence[Request] = (), status=RequestStatus.FINISHED_ERROR
    ) -> None:
        """Fail every request in flight (and ``not_taken``, requests still in the inbox) with ``exc``:
        the scheduler drops them, so the next ``stats()`` (the dashboard's last frame after
        ``close``) shows nothing in flight. After a failed step the engine then serves new ones."""
        with self._state_lock:
            for req in self.scheduler.drop_all_requests() + [r for q in not_taken for r in (q, *q.pending_forks)]:
                req.error = exc
                req.status = status
                self._complete(req)
