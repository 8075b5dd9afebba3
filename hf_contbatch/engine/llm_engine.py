"""The engine: continuous batching over a paged KV cache for one transformers causal LM.

Callers ``submit()`` token ids and get a ``RequestHandle`` back; they wait on events (never spin:
on 2 cores a spinning waiter slows the model's OpenMP threads by an order of magnitude). Errors in
an iteration fail the affected requests' handles with the exception and the engine keeps serving;
``close()`` stops the thread, frees the KV pool and restores the model's attention.

This file holds the iteration (``LLMEngine.step``: reap -> budget -> admit -> preempt -> decode)
and a request's life in the engine. Around it: ``pool_sizing`` (how many blocks), ``driver`` (which
thread runs iterations), ``stats`` (counters and ``EngineStats``), ``handles`` (``RequestHandle``),
``attention_switch`` (the model's attention implementation), ``stopping`` (when a request ends).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from ..config import EngineConfig, is_int, resolve_compile_model
from ..core.block_manager import BlockManager
from ..core.phases import PhaseTimer
from ..core.scheduler import Scheduler, SchedulerOutput
from ..kernels.attention import resolve_backend
from ..kernels.linears import fuse_siblings, pack_linears
from ..kernels.paged_cache import PagedKVCache, kv_bytes_per_block
from ..request import Request, RequestIdCounter, RequestStatus, SamplingParams
from .attention_switch import restore_attention, switch_to_paged_attention
from .driver import EngineDriver
from .handles import EngineError, RequestHandle, RequestOutput
from .pool_sizing import KVPoolSizing, available_host_memory, layer_devices, text_config
from .reliability import check_request, execute_isolating_failures
from .runner import ModelRunner
from .sampler import Sampler
from .stats import EngineCounters, EngineStats
from .stopping import finish_status

logger = logging.getLogger(__name__)

__all__ = ["EngineError", "EngineStats", "LLMEngine", "RequestHandle", "RequestOutput", "SUPPORTED_MODEL_TYPES"]

# Families whose attention goes through transformers' AttentionInterface and whose layers call
# ``cache.update(...)`` right before attention (tests/test_engine_equivalence.py checks greedy equality).
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


class LLMEngine(KVPoolSizing, EngineDriver):
    """Continuous batching over a paged KV cache for one transformers causal LM.

    Args:
        model: a ``PreTrainedModel`` of a supported family (``SUPPORTED_MODEL_TYPES``).
        config: engine configuration.

    Raises:
        ValueError: unsupported model family, or a pool that does not fit in memory.
    """

    def __init__(self, model, config: Optional[EngineConfig] = None) -> None:
        self.config = config or EngineConfig()
        self.model = model
        text_cfg = text_config(model)
        model_type = getattr(text_cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES or not getattr(model, "_supports_attention_backend", True):
            raise ValueError(
                f"model type {model_type!r} is not supported by hf_contbatch; supported families: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.num_layers = text_cfg.num_hidden_layers
        self.num_kv_heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
        self.head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        self.max_model_len = getattr(text_cfg, "max_position_embeddings", None)
        self.device = model.get_input_embeddings().weight.device
        self.vocab_size = model.get_input_embeddings().weight.shape[0]  # ids at submit must index it
        cache_cfg = self.config.cache
        dtype = getattr(torch, cache_cfg.dtype) if cache_cfg.dtype else next(model.parameters()).dtype
        self.backend = resolve_backend(
            self.config.attention_backend,
            self.device,
            dtype=dtype,
            head_dim=self.head_dim,
            num_heads=text_cfg.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            block_size=cache_cfg.block_size,
        )
        devices = layer_devices(model, self.num_layers)
        block_bytes = kv_bytes_per_block(self.num_layers, cache_cfg.block_size, self.num_kv_heads, self.head_dim, dtype)
        self.pool_sizing: dict[str, str] = {}  # pool -> why it has its size (logged, shown by the dashboard)
        num_blocks = cache_cfg.num_blocks or self._blocks_from_memory(block_bytes, devices, dtype)
        swap_blocks = self._swap_blocks(block_bytes, num_blocks)
        self._log_pool_sizes(num_blocks, swap_blocks, block_bytes)
        self.cache = PagedKVCache(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            num_blocks,
            cache_cfg.block_size,
            dtype,
            devices,
            num_swap_blocks=swap_blocks,
            attention_backend=self.backend,
        )
        self.block_manager = BlockManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.host_block_manager = BlockManager(swap_blocks, cache_cfg.block_size)
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.block_manager,
            host_block_manager=self.host_block_manager,
            swap_cost_per_block=self._estimate_swap_cost_per_block(block_bytes),
        )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(self.config.seed if self.config.seed is not None else int.from_bytes(os.urandom(4), "little"))
        self.sampler = Sampler(gen)
        self.runner = ModelRunner(model, self.cache, self.block_manager, self.device, self.sampler)

        # Before anything changes the model: a bad HF_CONTBATCH_COMPILE raises with the model untouched.
        compile_model = resolve_compile_model(self.config.compile_model)
        # Before the attention switch: a forced backend that cannot pack raises with nothing changed.
        self.packed_linears = pack_linears(model, self.config.linear_backend, available_host_memory)
        if self.config.fuse_linears:
            fuse_siblings(model, self.packed_linears)
        try:
            self._previous_attn = switch_to_paged_attention(model)
        except BaseException:
            if self.packed_linears is not None:
                self.packed_linears.restore()
            raise
        model.eval()
        self.compiled_forward = None
        if compile_model:
            from ..kernels.compiled_forward import CompiledForward

            self.compiled_forward = CompiledForward(model, self.cache, self.runner._cache_arg, self.packed_linears)
            self.runner.model = self.compiled_forward
        else:  # eager steps check the packed linears once a step (a compiled forward refreshes them itself)
            self.runner.packed_linears = self.packed_linears

        self._ids = RequestIdCounter()
        self._handles: dict[int, RequestHandle] = {}
        self._closed = False
        # Guards the scheduler's and block managers' state: held by the driving thread while it
        # changes them (not during the forward), and by ``stats()`` for one consistent snapshot.
        self._state_lock = threading.RLock()
        self.counters = EngineCounters(record_phases=self.config.record_phases)
        self._init_driver()

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

    # --- public API ----------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        stop_checker: Optional[Callable[[Request], bool]] = None,
        num_return_sequences: Optional[int] = None,
    ) -> "RequestHandle | list[RequestHandle]":
        """Queue a request; returns at once.

        Args:
            prompt_token_ids: the prompt as a non-empty sequence of ints.
            sampling: its sampling parameters.
            priority: lower is served first.
            stop_checker: called after each new token (engine thread); True finishes with "stop".
            num_return_sequences: None for one sequence (returns a handle); an int n >= 1 returns a
                list of n handles. The n sequences share the prompt's KV: the first one prefills
                it, the others are forked off it before the last prompt token (full blocks shared
                by ref count, the partial block copied), so each samples its own first token. With
                ``sampling.seed`` set, sequence k uses seed ``seed + k``. A fork that finds no room
                degrades to independent requests (they recompute the prompt, or hit the prefix cache).

        Returns:
            a ``RequestHandle``, or a list of them when ``num_return_sequences`` is given.

        Raises:
            ValueError: empty prompt, a token id outside the model's input embedding (the message
                names the id, its position and the vocabulary size), a sampling value out of range,
                a request that can never fit (prompt + 1 token beyond the model's context, or
                prompt + max_new_tokens beyond the whole KV pool), or ``num_return_sequences`` not
                a positive int. Nothing enters the engine then.
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        num_sequences = 1 if num_return_sequences is None else num_return_sequences
        if not is_int(num_sequences) or num_sequences < 1:
            raise ValueError(f"`num_return_sequences` must be an int >= 1 or None, got {num_return_sequences!r}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        if not all(is_int(t) for t in ids):
            raise ValueError("`prompt_token_ids` must be a sequence of ints")
        if not is_int(priority):
            raise ValueError(f"`priority` must be an int (lower runs first), got {priority!r}")
        if sampling.prompt_lookup_num_tokens is None and self.config.prompt_lookup_num_tokens:
            sampling = dataclasses.replace(sampling, prompt_lookup_num_tokens=self.config.prompt_lookup_num_tokens)
        check_request(ids, sampling, self.vocab_size)
        n = len(ids)
        # A one-token scoring request (prompt log-probs) never feeds its sampled token, so its prompt
        # may fill the whole context (lm-eval scores windows of exactly the model's length).
        scoring = bool(sampling.prompt_logprobs) and sampling.max_new_tokens == 1
        if self.max_model_len is not None and n + (0 if scoring else 1) > self.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens + 1 new token exceeds the model's context of {self.max_model_len} tokens"
            )
        worst = n + sampling.max_new_tokens
        if self.max_model_len is not None:
            worst = min(worst, self.max_model_len)
        if worst > self.capacity_tokens:
            raise ValueError(
                f"request needs up to {worst} tokens of KV (prompt {n} + max_new_tokens {sampling.max_new_tokens}) "
                f"but the whole pool holds {self.capacity_tokens} tokens ({self.block_manager.num_blocks} blocks "
                f"of {self.block_manager.block_size}); lower max_new_tokens or enlarge the cache"
            )
        req = Request(
            request_id=self._ids(),
            prompt_token_ids=ids,
            sampling=sampling,
            priority=priority,
            stop_checker=stop_checker,
            max_total_tokens=self.max_model_len,
        )
        for k in range(1, num_sequences):
            sampling_k = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + k)
            req.pending_forks.append(
                Request(
                    request_id=self._ids(),
                    prompt_token_ids=list(ids),
                    sampling=sampling_k,
                    priority=priority,
                    arrival_time=req.arrival_time,
                    stop_checker=stop_checker,
                    max_total_tokens=self.max_model_len,
                    parent_id=req.request_id,
                )
            )
        handles = [RequestHandle(self, r) for r in [req, *req.pending_forks]]
        for h in handles:
            self._handles[h.request_id] = h
        self._enqueue(("add", req))
        return handles[0] if num_return_sequences is None else handles

    def cancel(self, request_id: int) -> None:
        """Ask the engine to stop request ``request_id``; it is freed at the next reap step with
        finish reason "cancelled" (tokens so far kept). Unknown or finished ids are ignored; never
        raises, and returns at once."""
        self._enqueue(("cancel", request_id))

    def stats(self) -> EngineStats:
        """An immutable snapshot of the pool, the queues, the counters and the phase timings (see
        ``EngineStats`` for fields and units), taken between two changes of the scheduler's state.
        Never raises; callable from any thread, also after ``close()``."""
        with self._state_lock:
            return self.counters.snapshot(self.scheduler, self.block_manager, self.host_block_manager)

    def close(self) -> None:
        """Stop the thread, fail what is still queued, free the pool, restore the model's attention."""
        if self._closed:
            return
        self._closed = True
        self._stop_worker()
        err = RuntimeError("the engine was closed before the request finished")
        with self._state_lock:
            for req in self.scheduler.all_requests():
                self._fail(req, err, status=RequestStatus.FINISHED_CANCELLED)
            for kind, item in list(self._inbox):
                if kind == "add":
                    for req in [item, *item.pending_forks]:
                        self._fail(req, err, status=RequestStatus.FINISHED_CANCELLED)
            self._inbox.clear()
            for q in (self.scheduler.running, self.scheduler.waiting, self.scheduler.swapped):
                q.clear()  # the last stats() (the dashboard's final frame) shows nothing in flight
        if self.compiled_forward is not None:
            self.compiled_forward.close()
        self.cache.release()
        if self.packed_linears is not None:
            self.packed_linears.restore()
        restore_attention(self.model, self._previous_attn)

    # --- the iteration ---------------------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        """One iteration, the five steps in order (each one's seconds recorded under its name):

        1. reap: finished and cancelled requests leave, their blocks are freed, handles complete;
        2. budget: free blocks minus this step's reservations minus the watermark;
        3. admit: forks, swap-ins, then waiting requests by rank (a priority preemption for an
           admission counts as "preempt");
        4. preempt: until the running requests' blocks fit, then every planned request gets its
           blocks (``Scheduler._allocate_slots``);
        5. decode: swap/copy the planned blocks, one batched forward, sample, append tokens and
           decide who finished (``hf_contbatch.engine.stopping.finish_status``).

        Returns the iteration's ``SchedulerOutput``.
        """
        sched = self.scheduler
        t0 = time.monotonic()
        timer = PhaseTimer()
        with self._state_lock:
            out = sched.begin_iteration()
            out.reaped = sched.reap()
        for req in out.reaped:
            self._complete(req)
        timer.charge("reap")
        with self._state_lock:
            budget = sched.budget(out)
            timer.charge("budget")
            sched.admit(out, budget, timer)
            timer.charge("admit")
            sched.preempt(out, budget)
            timer.charge("preempt")
            sched.finish_plan(out, budget)
        t_move = time.monotonic()
        self._move_blocks(out)
        swap_seconds = time.monotonic() - t_move
        # A failing forward is narrowed down to the requests that fail alone; the others advance.
        sampled, failed = execute_isolating_failures(self.runner.execute, out)
        with self._state_lock:
            for s, exc in failed:
                self._fail_in_step(s.request, exc)
            now = time.monotonic()
            sched.update_from_output(out, sampled, on_token=lambda req: self._on_new_token(req, now))
            timer.charge("decode")
            out.phases = list(timer.as_tuple())
            self.counters.record_iteration(out, self.block_manager.num_used_blocks, time.monotonic() - t0, swap_seconds)
        # Finished requests are released by the next reap; the driver makes sure there is one.
        return out

    def _move_blocks(self, out: SchedulerOutput) -> None:
        """Execute the plan's KV moves before the forward, in the order the scheduler relies on:
        swap in (its host blocks may be reused by this step's swap-outs), swap out (its device
        blocks may be reused as this step's copy targets), then copy-on-write of forked blocks."""
        if out.blocks_to_swap_in:
            self.cache.swap_in(out.blocks_to_swap_in)
        if out.blocks_to_swap_out:
            self.cache.swap_out(out.blocks_to_swap_out)
        if out.blocks_to_copy:
            self.cache.copy_blocks(out.blocks_to_copy)

    def _on_new_token(self, req: Request, now: float) -> bool:
        """Count, stream and stop-check the token just appended to ``req`` (one at a time, also for
        accepted drafts); True when ``req`` finished. An error here (a stop checker, a streamer)
        fails ``req`` alone."""
        try:
            self.counters.record_token(req, now)
            handle = self._handles.get(req.request_id)
            if handle is not None:
                handle._push([req.output_token_ids[-1]])
            status = finish_status(req)
            if status is None and req.sampling.stopping_criteria and self.sampler.should_stop(req):
                status = RequestStatus.FINISHED_STOPPED  # the call's stopping_criteria, on its own ids
        except Exception as exc:  # noqa: BLE001 - a stop checker or stream of one request
            self._fail_in_step(req, exc)
            return True
        if status is not None:
            req.status = status
        return status is not None

    def _fail_in_step(self, req: Request, exc: Exception) -> None:
        """Fail one request during a step: it keeps its tokens, the next reap frees its blocks and
        finishes its handle (its pending forks with it); the other requests are untouched."""
        logger.error("request %s failed after %d generated tokens: %r", req.request_id, len(req.output_token_ids), exc)
        req.error = exc
        req.status = RequestStatus.FINISHED_ERROR
        for child in req.pending_forks:
            child.error = exc

    def _apply_cancel(self, request_id: int) -> None:
        handle = self._handles.get(request_id)
        if handle is not None and not handle.request.status.is_finished:
            handle.request.cancel_requested = True

    def _complete(self, req: Request) -> None:
        req.finish_time = time.monotonic()
        self.sampler.forget(req.request_id)
        with self._state_lock:
            self.counters.num_finished += 1
        handle = self._handles.pop(req.request_id, None)
        if handle is not None:
            handle._finish()

    def _fail(self, req: Request, exc: BaseException, status=RequestStatus.FINISHED_ERROR) -> None:
        req.error = exc
        req.status = status
        self.block_manager.free(req.request_id)
        self.host_block_manager.free(req.request_id)
        self._complete(req)

    def _fail_all(self, exc: BaseException) -> None:
        """An error in a step fails every request in flight; the engine then serves new ones."""
        with self._state_lock:
            for req in self.scheduler.all_requests():
                self._fail(req, exc)
            self.scheduler.running.clear()
            self.scheduler.waiting.clear()
            self.scheduler.swapped.clear()
            self.cache.metadata = None
