"""The engine: a background thread that runs scheduler iterations over one model.

Callers ``submit()`` token ids and get a ``RequestHandle`` back; they wait on events (never spin:
on 2 cores a spinning waiter slows the model's OpenMP threads by an order of magnitude). Errors in
the engine thread fail the affected requests' handles with the exception and the engine keeps
serving; ``close()`` stops the thread, frees the KV pool and restores the model's attention.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from .attention import ATTENTION_NAME, register_attention, resolve_backend
from .config import EngineConfig
from .kv.block_manager import BlockManager
from .kv.paged_cache import PagedKVCache, kv_bytes_per_block
from .request import Request, RequestIdCounter, RequestStatus, SamplingParams
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import PHASES, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

# Families whose attention goes through transformers' AttentionInterface and whose layers call
# ``cache.update(...)`` right before attention; tested in tests/test_models.py.
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "phi3", "granite", "olmo2", "smollm3",
)


class EngineError(RuntimeError):
    """Raised from ``RequestHandle.result()`` when the engine failed the request."""


@dataclass
class RequestOutput:
    """The final state of one request.

    Attributes:
        request_id: engine-local id.
        prompt_token_ids: the prompt.
        output_token_ids: generated tokens (partial if cancelled).
        finish_reason: "stop", "length", "cancelled" or "error".
        num_preemptions: times it was preempted.
        ttft: seconds from arrival to first token (None if it produced none).
        latency: seconds from arrival to finish.
    """

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: Optional[str]
    num_preemptions: int
    ttft: Optional[float]
    latency: Optional[float]


class RequestHandle:
    """A submitted request: wait for it, stream its tokens, or cancel it."""

    def __init__(self, engine: "LLMEngine", request: Request) -> None:
        self._engine = engine
        self.request = request
        self._done = threading.Event()
        self._stream: "queue.SimpleQueue[Optional[list[int]]]" = queue.SimpleQueue()
        self._callbacks: list[Callable[["RequestHandle"], None]] = []
        self._lock = threading.Lock()

    @property
    def request_id(self) -> int:
        return self.request.request_id

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> RequestOutput:
        """Block until finished; return the output. Raises ``EngineError`` if the engine failed it,
        ``TimeoutError`` after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self.request.error is not None:
            raise EngineError(f"request {self.request_id} failed in the engine: {self.request.error!r}") from self.request.error
        r = self.request
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=list(r.prompt_token_ids),
            output_token_ids=list(r.output_token_ids),
            finish_reason=r.finish_reason,
            num_preemptions=r.num_preemptions,
            ttft=None if r.first_token_time is None else r.first_token_time - r.arrival_time,
            latency=None if r.finish_time is None else r.finish_time - r.arrival_time,
        )

    def cancel(self) -> None:
        """Ask the engine to stop this request; it is freed at the next reap step."""
        self._engine.cancel(self.request_id)

    def add_done_callback(self, fn: Callable[["RequestHandle"], None]) -> None:
        """Call ``fn(handle)`` when finished (from the engine thread; keep it short)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def token_stream(self) -> Iterator[list[int]]:
        """Yields lists of new token ids as the engine produces them, until the request finishes."""
        while True:
            item = self._stream.get()
            if item is None:
                return
            yield item

    # engine side
    def _push(self, tokens: Sequence[int]) -> None:
        self._stream.put(list(tokens))

    def _finish(self) -> None:
        with self._lock:
            self._stream.put(None)
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a user callback must not take the engine down
                logger.exception("done-callback of request %s raised", self.request_id)


@dataclass(frozen=True)
class EngineStats:
    """An immutable snapshot for dashboards and scripts (units in the names)."""

    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    peak_used_blocks: int
    capacity_tokens: int
    num_waiting: int
    num_running: int
    num_swapped: int
    num_finished: int
    num_preemptions: int
    num_generated_tokens: int
    num_iterations: int
    throughput_tokens_per_s: float
    mean_ttft_s: Optional[float]
    mean_itl_s: Optional[float]
    recent_phases: tuple = ()  # ((phase, seconds), ...) for recent iterations
    block_owner: tuple = ()  # request id (or -1) per block
    extra: dict = field(default_factory=dict)


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _layer_devices(model, num_layers: int) -> list[torch.device]:
    """Device of each decoder layer (``device_map`` models spread over several)."""
    device_map = getattr(model, "hf_device_map", None)
    default = next(model.parameters()).device
    if not device_map:
        return [default] * num_layers
    devices = []
    for i in range(num_layers):
        dev = None
        for name, d in device_map.items():
            if name.endswith(f"layers.{i}") or f"layers.{i}." in name + ".":
                dev = d
                break
        devices.append(torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}") if dev is not None else default)
    return devices


class LLMEngine:
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
        text_cfg = _text_config(model)
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
        cache_cfg = self.config.cache
        dtype = getattr(torch, cache_cfg.dtype) if cache_cfg.dtype else next(model.parameters()).dtype
        self.backend = resolve_backend(self.config.attention_backend, self.device)
        layer_devices = _layer_devices(model, self.num_layers)
        block_bytes = kv_bytes_per_block(self.num_layers, cache_cfg.block_size, self.num_kv_heads, self.head_dim, dtype)
        num_blocks = cache_cfg.num_blocks or self._blocks_from_memory(block_bytes)
        swap_blocks = 0
        if self.config.scheduler.preemption_mode in ("swap", "auto"):
            swap_blocks = int(cache_cfg.swap_space_gib * 2**30 // block_bytes)
        self.cache = PagedKVCache(
            self.num_layers, self.num_kv_heads, self.head_dim, num_blocks, cache_cfg.block_size, dtype,
            layer_devices, num_swap_blocks=swap_blocks, attention_backend=self.backend,
        )
        self.block_manager = BlockManager(num_blocks, cache_cfg.block_size)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(self.config.seed if self.config.seed is not None else int.from_bytes(os.urandom(4), "little"))
        self.sampler = Sampler(gen)
        self.runner = ModelRunner(model, self.cache, self.block_manager, self.device, self.sampler)

        self._previous_attn = getattr(model.config, "_attn_implementation", None)
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        model.eval()

        self._ids = RequestIdCounter()
        self._handles: dict[int, RequestHandle] = {}
        self._inbox: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._closed = False
        self.phase_log: collections.deque = collections.deque(maxlen=4096 if self.config.record_phases else 0)
        self._stats_lock = threading.Lock()
        self._num_finished = 0
        self._num_generated = 0
        self._peak_used = 0
        self._busy_time = 0.0
        self._ttfts: collections.deque = collections.deque(maxlen=1024)
        self._itls: collections.deque = collections.deque(maxlen=4096)
        self._thread = threading.Thread(target=self._loop, name="hf_contbatch-engine", daemon=True)
        self._thread.start()

    # --- sizing ------------------------------------------------------------------------------
    def _blocks_from_memory(self, block_bytes: int) -> int:
        cache_cfg = self.config.cache
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            _, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * cache_cfg.gpu_memory_utilization - used
            if budget <= block_bytes:
                raise ValueError(
                    f"no device memory left for the KV cache: gpu_memory_utilization="
                    f"{cache_cfg.gpu_memory_utilization} of {total / 2**30:.1f} GiB, {used / 2**30:.1f} GiB in use"
                )
            return int(budget // block_bytes)
        want = cache_cfg.cpu_cache_gib * 2**30
        available = _available_host_memory()
        if available is not None and want > available:
            raise ValueError(
                f"`cpu_cache_gib`={cache_cfg.cpu_cache_gib} exceeds the available host memory "
                f"({available / 2**30:.1f} GiB); lower it or pass `num_blocks`"
            )
        return max(1, int(want // block_bytes))

    @property
    def capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    # --- public API ----------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        stop_checker: Optional[Callable[[Request], bool]] = None,
    ) -> RequestHandle:
        """Queue a request; returns at once.

        Args:
            prompt_token_ids: the prompt as a non-empty sequence of ints.
            sampling: its sampling parameters.
            priority: lower is served first.
            stop_checker: called after each new token (engine thread); True finishes with "stop".

        Raises:
            ValueError: empty prompt, or a request that can never fit (prompt + 1 token beyond the
                model's context, or prompt + max_new_tokens beyond the whole KV pool).
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("`prompt_token_ids` must be a sequence of ints")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"`priority` must be an int (lower runs first), got {priority!r}")
        n = len(ids)
        if self.max_model_len is not None and n + 1 > self.max_model_len:
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
            request_id=self._ids(), prompt_token_ids=ids, sampling=sampling, priority=priority,
            stop_checker=stop_checker, max_total_tokens=self.max_model_len,
        )
        handle = RequestHandle(self, req)
        with self._cv:
            self._handles[req.request_id] = handle
            self._inbox.append(("add", req))
            self._idle.clear()
            self._cv.notify()
        return handle

    def cancel(self, request_id: int) -> None:
        with self._cv:
            self._inbox.append(("cancel", request_id))
            self._cv.notify()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until no request is queued or running."""
        return self._idle.wait(timeout)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        sched = self.scheduler
        with self._stats_lock:
            owners = [-1] * bm.num_blocks
            for rid, table in list(bm.block_tables.items()):
                for b in table:
                    owners[b] = rid
            itl = list(self._itls)
            ttft = list(self._ttfts)
            recent = tuple(list(self.phase_log)[-32:])
            return EngineStats(
                num_blocks=bm.num_blocks,
                block_size=bm.block_size,
                num_free_blocks=bm.num_free_blocks,
                num_used_blocks=bm.num_used_blocks,
                peak_used_blocks=self._peak_used,
                capacity_tokens=self.capacity_tokens,
                num_waiting=len(sched.waiting),
                num_running=len(sched.running),
                num_swapped=len(getattr(sched, "swapped", ())),
                num_finished=self._num_finished,
                num_preemptions=sched.num_preemptions,
                num_generated_tokens=self._num_generated,
                num_iterations=sched.iteration,
                throughput_tokens_per_s=self._num_generated / self._busy_time if self._busy_time else 0.0,
                mean_ttft_s=sum(ttft) / len(ttft) if ttft else None,
                mean_itl_s=sum(itl) / len(itl) if itl else None,
                recent_phases=recent,
                block_owner=tuple(owners),
            )

    def close(self) -> None:
        """Stop the thread, fail what is still queued, free the pool, restore the model's attention."""
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=60)
        err = RuntimeError("the engine was closed before the request finished")
        for req in self.scheduler.all_requests():
            self._fail(req, err, status=RequestStatus.FINISHED_CANCELLED)
        for kind, item in list(self._inbox):
            if kind == "add":
                self._fail(item, err, status=RequestStatus.FINISHED_CANCELLED)
        self._inbox.clear()
        self.cache.release()
        if self._previous_attn is not None and getattr(self.model.config, "_attn_implementation", None) == ATTENTION_NAME:
            try:
                self.model.set_attn_implementation(self._previous_attn)
            except Exception:  # restoring must not turn close() into an error
                logger.warning("could not restore attention implementation %r", self._previous_attn)

    # --- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not self.scheduler.has_work:
                    self._idle.set()
                    self._cv.wait()
                if self._stop:
                    return
                inbox = list(self._inbox)
                self._inbox.clear()
            for kind, item in inbox:
                if kind == "add":
                    self.scheduler.add_request(item)
                else:
                    self._apply_cancel(item)
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - every error must reach the callers
                logger.exception("engine step failed")
                self._fail_all(exc)

    def _apply_cancel(self, request_id: int) -> None:
        handle = self._handles.get(request_id)
        if handle is not None and not handle.request.status.is_finished:
            handle.request.cancel_requested = True

    def step(self) -> SchedulerOutput:
        """One iteration: the scheduler's four steps, then the batched forward (decode)."""
        t0 = time.monotonic()
        out = self.scheduler.schedule()
        for req in out.reaped:
            self._complete(req)
        for req in out.preempted:
            logger.debug("preempted request %s", req.request_id)
        t1 = time.monotonic()
        sampled = self.runner.execute(out)
        advanced = self.scheduler.update_from_output(out, sampled)
        now = time.monotonic()
        for req in advanced:
            self._on_new_token(req, now)
        t2 = time.monotonic()
        out.phases.append(("decode", t2 - t1))
        with self._stats_lock:
            self._peak_used = max(self._peak_used, self.block_manager.num_used_blocks)
            if not out.is_empty:
                self._busy_time += t2 - t0
            self.phase_log.append((out.iteration, tuple(out.phases)))
        # Finished requests are released by the next reap; make sure there is a next iteration.
        return out

    def _on_new_token(self, req: Request, now: float) -> None:
        token = req.output_token_ids[-1]
        if req.first_token_time is None:
            req.first_token_time = now
            self._ttfts.append(now - req.arrival_time)
        else:
            self._itls.append(now - getattr(req, "_last_token_time", now))
        req._last_token_time = now  # type: ignore[attr-defined]
        self._num_generated += 1
        handle = self._handles.get(req.request_id)
        if handle is not None:
            handle._push([token])
        sp = req.sampling
        if not sp.ignore_eos and token in sp.eos_token_ids and len(req.output_token_ids) >= sp.min_new_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_token_ids) >= sp.max_new_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
        elif req.max_total_tokens is not None and req.num_tokens >= req.max_total_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
        elif req.stop_checker is not None and req.stop_checker(req):
            req.status = RequestStatus.FINISHED_STOPPED

    def _complete(self, req: Request) -> None:
        req.finish_time = time.monotonic()
        self.sampler.forget(req.request_id)
        with self._stats_lock:
            self._num_finished += 1
        handle = self._handles.pop(req.request_id, None)
        if handle is not None:
            handle._finish()

    def _fail(self, req: Request, exc: BaseException, status=RequestStatus.FINISHED_ERROR) -> None:
        req.error = exc
        req.status = status
        self.block_manager.free(req.request_id)
        self._complete(req)

    def _fail_all(self, exc: BaseException) -> None:
        """An error in a step fails every request in flight; the engine then serves new ones."""
        for req in self.scheduler.all_requests():
            self._fail(req, exc)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.cache.metadata = None


def _available_host_memory() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
