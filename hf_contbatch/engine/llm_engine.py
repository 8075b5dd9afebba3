"""The engine: continuous batching over a paged KV cache for one transformers causal LM.

Callers ``submit()`` token ids and get a ``RequestHandle`` back; they wait on events, never spin (a
spinning waiter takes the cores the model's OpenMP threads run on). Errors in an iteration fail the
affected requests' handles with the exception and the engine keeps serving; ``close()`` stops the
thread, frees the KV pool and restores the model's attention.

This file holds the iteration (``LLMEngine.step``: reap -> budget -> admit -> preempt -> decode)
and a request's life in the engine. The engine holds objects with one job each: ``KVPools`` (the
cache and its block bookkeeping, sized by ``pool_sizing.KVPoolSizer``), ``ModelPatches`` (what it
changes on the model, undone by ``close``), a ``RequestFactory`` (the one place requests are
validated), an ``OutputProcessor`` (streaming to the handles, stop checks, the grammar's advance,
finished handles; it runs after the state lock is released), and an ``EngineDriver`` (which thread
runs iterations; it calls the engine back through ``driver.DrivenEngine``; blocking waits,
``drive``, ``cancel_now`` and live views are its methods, ``engine.driver``). Around them:
``stats`` (counters and ``EngineStats``), ``stopping`` (when a request ends), and
``structured.GrammarMatchers`` (the grammars of requests with structured outputs: compiled in a
worker thread, one matcher per request, advanced on the tokens it keeps).

A request's path: ``build_request`` (validate, no side effect) -> ``enqueue`` (register handles,
put into the driver's inbox) -> ``take_inbox`` (to the scheduler) -> ``step`` ->
``OutputProcessor.complete``.
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
from .model_support import (
    SERVED_LAYER_KINDS,
    check_supported_model,
    vocab_widths,
)
from .output_processor import OutputProcessor, log_failure
from .own_cache_runner import OwnCacheModelRunner
from .per_request_processors import RequestProcessors
from .recurrent_runner import RecurrentModelRunner
from .reliability import execute_isolating_failures
from .request_factory import RequestFactory
from .sampler import Sampler
from .serving_mode import serving_mode
from .stats import EngineCounters, EngineStats
from .structured import GrammarCompilation, GrammarMatchers

logger = logging.getLogger(__name__)

__all__ = ["EngineError", "EngineStats", "LLMEngine", "RequestHandle", "RequestOutput", "SERVED_LAYER_KINDS"]


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


class LLMEngine:
    """Continuous batching over a paged KV cache for one transformers causal LM.

    Args:
        model: a ``PreTrainedModel`` whose attention goes through transformers' ``AttentionInterface``
            and whose layers are all of a kind the paged KV cache serves
            (``engine.model_support.check_supported_model``), or a
            ``peft.PeftModel`` over one, whose LoRA adapters requests choose per request
            (``SamplingParams.adapter_name``).
        config: engine configuration.
        tokenizer: the model's Hugging Face tokenizer; needed only by requests with
            ``SamplingParams.structured_outputs`` (their grammars are compiled against it).

    Raises:
        ValueError: a model with a layer kind the engine cannot serve (one line naming the kind and
            the model type, raised before any weight is touched), a pool that does not fit in memory, or a PEFT
            feature per-request adapters cannot serve (named in the message).
    """

    def __init__(self, model, config: Optional[EngineConfig] = None, tokenizer=None) -> None:
        self.config = cfg = config or EngineConfig()
        self.model = model
        # A peft.PeftModel runs as its inner model, its LoRA adapters per row (lora_adapters).
        self.adapters = LoraAdapters(model) if is_peft_model(model) else None
        model = model if self.adapters is None else self.adapters.model
        check_supported_model(model)
        # Which runner and which scheduling rules the model's layers call for (engine.serving_mode).
        self.serving_mode = mode = serving_mode(model, cfg, has_adapters=self.adapters is not None)
        self.config = cfg = mode.config
        pools = KVPools.for_model(model, cfg, runner_class=mode.profile_runner_class)
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
        # Per-request logits processors and stopping criteria, by request id (the sampler looks
        # them up; no Request reaches the runner or the sampler).
        self.processors = RequestProcessors()
        self.sampler = Sampler(seeded_generator(cfg.seed), self.grammars, self.processors)
        runner_args = (
            model,
            self.cache,
            self.device,
            self.sampler,
            bm.block_size,
            cfg.scheduler.max_num_batched_tokens,
        )
        self.runner = mode.build_runner(*runner_args)
        self.patches = ModelPatches(model, cfg, self.cache, self.runner)  # linears, attention, compiled forward
        # Whatever ends the engine gives the model back: close() calls this, and so does garbage
        # collection of an engine nobody closed (its float weights would otherwise stay spilled
        # to a temporary directory for good). It holds the patches, never the engine. Not at
        # interpreter exit: the close-at-exit hook below closes a live engine there, stopping its
        # thread before the weights move.
        self._undo_patches = weakref.finalize(self, self.patches.undo)
        self._undo_patches.atexit = False
        self.packed_linears, self.compiled_forward = self.patches.packed_linears, self.patches.compiled_forward
        self.request_factory = RequestFactory(
            self.vocab_size,
            g.max_model_len,
            bm,
            cfg.prompt_lookup_num_tokens,
            self.adapters,
            self.grammars.compilation,
            kv_variant=None if self.patches.rotary_variants is None else self.patches.rotary_variants.prefix_key,
            whole_prefill_tokens=cfg.scheduler.max_num_batched_tokens if mode.whole_prefill_why else None,
            whole_prefill_why=mode.whole_prefill_why or "",
            drafts_served=mode.drafts_served,
        )
        self._closed = False
        # Guards the scheduler's and block managers' state: held by the driving thread while it
        # changes them (not during the forward, nor while user code runs on new tokens), and by
        # ``stats()`` for one consistent snapshot.
        self._state_lock = threading.RLock()
        self.counters = EngineCounters(
            record_phases=cfg.record_phases,
            per_adapter=self.adapters is not None,
            kv_cache_dtype=pools.spec.dtype,
            weight_format=self.patches.weight_format,
            unquantized=self.patches.unquantized,
        )
        self.driver = EngineDriver(self, drive_in_caller=cfg.drive_in_caller, num_threads=cfg.num_threads)
        self._handles = HandleRegistry(self.driver)  # handles wait, drive and cancel through the driver
        self.outputs = OutputProcessor(self._handles, self.grammars, self.sampler, self.processors)
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
            stop_checker: called for each new token before it is appended (engine thread), with a
                read-only view of the request whose output ends with it; True finishes with "stop".
            num_return_sequences: None for one sequence (returns a handle); an int n >= 1 returns a
                list of n handles, sequences that share the prompt's KV (``RequestFactory.build``).

        Raises:
            ValueError: empty prompt, a token id outside the model's input embedding (the message
                names the id, its position and the vocabulary size), a sampling value out of range,
                a request that can never fit (prompt + 1 token beyond the model's context, or
                prompt + max_new_tokens beyond the whole KV pool, unless every layer slides over a
                window the pool holds), ``num_return_sequences`` not a
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

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until no request is queued or running, or ``timeout`` seconds passed (None: no
        limit); True if idle. Waits on the background thread, never drives (``EngineDriver.wait_idle``)."""
        return self.driver.wait_idle(timeout)

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
        self._undo_patches()  # ModelPatches.undo, once (never again at garbage collection)
        self.cache.release()
        if isinstance(self.runner, OwnCacheModelRunner):
            self.runner.release()
        elif isinstance(self.runner, RecurrentModelRunner):
            self.runner.states.release()
        with self._state_lock:
            # The pool's memory is gone: no free block holds a prefix any more (stats() after
            # close, e.g. a dashboard's last frame, said N free blocks still held cached prefixes).
            self.block_manager.reset_prefix_cache()
        atexit.unregister(self._close_at_exit)

    # --- the iteration ---------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One iteration, each phase's seconds recorded under its name (``core.phases``): reap
        (finished and cancelled requests leave, their blocks freed, handles completed); budget (free
        blocks minus reservations minus the watermark); admit (forks, swap-ins, waiting requests by
        rank whose grammar is ready, then drafts); preempt (until the running requests' blocks fit,
        then ``Scheduler.allocate_slots``); wait (only when nothing can run but grammars compile);
        decode (swap/copy blocks, one batched forward, sample; the tokens each request would get);
        output (``OutputProcessor.decide``: EOS, length, grammar, stop strings and criteria on those
        tokens with the state lock released; then ``Scheduler.update_from_output`` appends the kept
        ones and sets the statuses under the lock, and ``OutputProcessor.stream`` streams them).
        Returns the iteration's plan and report. Raises ``RuntimeError`` outside the
        engine's driver (two threads must never iterate at once; to iterate in the calling thread
        use ``engine.driver.drive``)."""
        self.driver.check_in_iteration("LLMEngine.step()")
        sched, t0, timer = self.scheduler, time.monotonic(), PhaseTimer()
        with self._state_lock:
            result = sched.begin_iteration()
            result.report.reaped = sched.reap()
            self.counters.num_finished += len(result.report.reaped)
        self.outputs.complete(result.report.reaped)
        timer.charge("reap")
        with self._state_lock:
            for req, exc in self.grammars.poll():  # grammars compiled since: admissible (or failed)
                log_failure(req, exc)
                sched.fail(req, exc)
            sched.plan(result, timer)  # budget, admit, preempt
            self.counters.record_scheduled(result.report, time.monotonic())  # RequestMetrics' first_scheduled_time
            # The step's blocks are all held now; its update may release some before the end.
            self.counters.record_used_blocks(self.block_manager.num_used_blocks)
        plan = result.plan
        if plan.is_empty and self.grammars.has_waiting:
            self.grammars.wait(timeout=0.05)  # nothing else to run: wait for a compile, not spin
            timer.charge("wait")
        t_move = time.monotonic()
        move_blocks(self.cache, plan)
        swap_seconds = time.monotonic() - t_move
        # A failing forward is narrowed down to the requests that fail alone; the others advance.
        output, failed = execute_isolating_failures(self.runner.execute, plan)
        now = time.monotonic()
        with self._state_lock:
            for s, exc in failed:
                req = sched.request(s.request_id)
                if req is not None and not req.status.is_finished:
                    log_failure(req, exc)
                    sched.fail(req, exc)
            proposed = sched.proposed_tokens(plan, output)
            requests = {rid: sched.request(rid) for rid in proposed}
        timer.charge("decode")
        decisions = self.outputs.decide(proposed, requests)  # user code (stop checkers): the lock is free
        with self._state_lock:
            appended = sched.update_from_output(plan, output, decisions)
            for req, tokens in appended:
                for _ in tokens:
                    self.counters.record_token(req, now)
        self.outputs.stream(appended)
        timer.charge("output")
        with self._state_lock:
            if self.patches.rotary_variants is not None:  # LongRoPE: past the threshold, all K again
                self.patches.rotary_variants.recompute_crossed(sched)
            result.report.phases = list(timer.as_tuple())
            used = self.block_manager.num_used_blocks
            self.counters.record_iteration(result, used, time.monotonic() - t0, swap_seconds)
        # Finished requests are released by the next reap; the driver makes sure there is one.
        return result

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
                    self.processors.track(item)
                    self.scheduler.add_request(item)

    def release_finished(self) -> None:
        """A reap outside an iteration: free finished and cancelled requests, finish their handles."""
        with self._state_lock:
            reaped = self.scheduler.reap()
            self.counters.num_finished += len(reaped)
            departed = self.scheduler.departures()
        self.runner.execute(departed)  # no rows: the runner's batch lets them go now
        self.outputs.complete(reaped)

    def fail_all(
        self, exc: BaseException, not_taken: Sequence[Request] = (), status=RequestStatus.FINISHED_ERROR
    ) -> None:
        """Fail every request in flight (and ``not_taken``, requests still in the inbox) with ``exc``:
        the scheduler drops them, so the next ``stats()`` (the dashboard's last frame after
        ``close``) shows nothing in flight. After a failed step the engine then serves new ones."""
        with self._state_lock:
            dropped = self.scheduler.drop_all_requests() + [r for q in not_taken for r in (q, *q.pending_forks)]
            self.scheduler.finish_dropped(dropped, status, exc)
            self.counters.num_finished += len(dropped)
            departed = self.scheduler.departures()
        self.runner.execute(departed)  # no rows: the runner's batch lets them go now
        self.outputs.complete(dropped)
