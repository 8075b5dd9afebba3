"""The engine: a background thread that runs scheduler iterations over one model.

Callers ``submit()`` token ids and get a ``RequestHandle`` back; they wait on events (never spin:
on 2 cores a spinning waiter slows the model's OpenMP threads by an order of magnitude). Errors in
the engine thread fail the affected requests' handles with the exception and the engine keeps
serving; ``close()`` stops the thread, frees the KV pool and restores the model's attention.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from .attention import ATTENTION_NAME, register_attention, resolve_backend
from .config import EngineConfig
from .cpu_linear import pack_linears
from .kv.block_manager import BlockManager
from .kv.paged_cache import PagedKVCache, kv_bytes_per_block
from .reliability import DeferredInterrupt, check_request, execute_isolating_failures
from .request import Request, RequestIdCounter, RequestStatus, SamplingParams
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import PHASES, ScheduledRequest, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

# Families whose attention goes through transformers' AttentionInterface and whose layers call
# ``cache.update(...)`` right before attention; tested in tests/test_models.py.
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "phi3", "granite", "olmo2", "smollm3",
)


class EngineError(RuntimeError):
    """Raised from ``RequestHandle.result()`` when the engine failed the request.

    Attributes:
        output: the request's ``RequestOutput`` with the tokens it generated before failing
            (``finish_reason="error"``); the cause is ``__cause__``.
    """

    def __init__(self, message: str, output: Optional["RequestOutput"] = None) -> None:
        super().__init__(message)
        self.output = output


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
        """Block until finished; return the output.

        Raises:
            EngineError: the engine failed the request (``.output`` holds its partial tokens).
            TimeoutError: not finished after ``timeout`` seconds (the request keeps running).
            KeyboardInterrupt: interrupted while waiting; the request is cancelled first (its
                output then has ``finish_reason="cancelled"``), other requests keep running.
        """
        try:
            if timeout is None and not self._done.is_set() and self._engine.drives_callers:
                self._engine.drive(self._done.is_set)
            finished = self._done.wait(timeout)
        except KeyboardInterrupt:
            self._engine.cancel_now([self])
            raise
        if not finished:
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self.request.error is not None:
            raise EngineError(
                f"request {self.request_id} failed in the engine after {len(self.request.output_token_ids)} "
                f"generated tokens: {self.request.error!r}", self.output(),
            ) from self.request.error
        return self.output()

    def output(self) -> RequestOutput:
        """The request's state now, without waiting or raising: the tokens so far and
        ``finish_reason`` (None while it runs; "error" when the engine failed it)."""
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
    # Memory management (issue 4). Counters are cumulative since the engine started.
    watermark_blocks: int = 0
    budget_blocks: int = 0  # last iteration: free - reservations - watermark, as measured in the budget step
    reserved_blocks: int = 0  # last iteration: running requests' blocks for the step + swap-ins + forks
    num_swap_blocks: int = 0  # host swap pool size
    swap_capacity_tokens: int = 0
    num_swapped_blocks: int = 0  # host blocks holding swapped-out KV now
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_swap_fallbacks: int = 0  # swap wanted but the host pool was full: recomputed instead
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    swap_seconds: float = 0.0  # time spent executing swap and copy mappings
    prefix_caching: bool = False
    num_cached_blocks: int = 0  # free blocks still holding a reusable prefix (evictable)
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served from the cache / prompt tokens looked up
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_prefix_evictions: int = 0
    num_forks: int = 0  # parallel-sampling sequences forked off a parent (blocks shared)
    num_fork_fallbacks: int = 0  # sequences that could not be forked and recompute their prompt
    block_ref_counts: tuple = ()  # per block; > 1 means shared (prefix cache or fork)
    phase_seconds: tuple = ()  # ((phase, total seconds), ...) over all iterations, in PHASES order
    last_phases: tuple = ()  # ((phase, seconds), ...) of the latest iteration
    num_kv_tokens: int = 0  # tokens whose KV the running requests hold (dashboard's tokens bar)


_ATTN_USERS = "_hf_contbatch_attention_users"  # on the model: its own implementation, open engines


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
        self.vocab_size = model.get_input_embeddings().weight.shape[0]  # ids at submit must index it
        cache_cfg = self.config.cache
        dtype = getattr(torch, cache_cfg.dtype) if cache_cfg.dtype else next(model.parameters()).dtype
        self.backend = resolve_backend(self.config.attention_backend, self.device)
        layer_devices = _layer_devices(model, self.num_layers)
        block_bytes = kv_bytes_per_block(self.num_layers, cache_cfg.block_size, self.num_kv_heads, self.head_dim, dtype)
        num_blocks = cache_cfg.num_blocks or self._blocks_from_memory(block_bytes, layer_devices, dtype)
        swap_blocks = self._swap_blocks(block_bytes, num_blocks)
        self.cache = PagedKVCache(
            self.num_layers, self.num_kv_heads, self.head_dim, num_blocks, cache_cfg.block_size, dtype,
            layer_devices, num_swap_blocks=swap_blocks, attention_backend=self.backend,
        )
        self.block_manager = BlockManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.host_block_manager = BlockManager(swap_blocks, cache_cfg.block_size)
        self.scheduler = Scheduler(
            self.config.scheduler, self.block_manager, host_block_manager=self.host_block_manager,
            swap_cost_per_block=self._estimate_swap_cost_per_block(block_bytes),
        )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(self.config.seed if self.config.seed is not None else int.from_bytes(os.urandom(4), "little"))
        self.sampler = Sampler(gen)
        self.runner = ModelRunner(model, self.cache, self.block_manager, self.device, self.sampler)

        # Before the attention switch: a forced backend that cannot pack raises with nothing changed.
        self.packed_linears = pack_linears(model, self.config.linear_backend, _available_host_memory)
        # Engines sharing one model share its attention switch: the first remembers the model's own
        # implementation, the last to close restores it (closing one must not break the other).
        users = model.__dict__.setdefault(_ATTN_USERS, {"previous": getattr(model.config, "_attn_implementation", None), "open": 0})
        self._previous_attn = users["previous"]
        try:
            register_attention()
            model.set_attn_implementation(ATTENTION_NAME)
        except BaseException:
            if not users["open"]:
                model.__dict__.pop(_ATTN_USERS, None)
            if self.packed_linears is not None:
                self.packed_linears.restore()
            raise
        users["open"] += 1
        model.eval()

        self._ids = RequestIdCounter()
        self._handles: dict[int, RequestHandle] = {}
        self._inbox: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._drive_lock = threading.Lock()  # held for one iteration by whichever thread drives
        self._num_drivers = 0  # blocking callers currently driving (the background thread leaves)
        self._driver: Optional[int] = None  # thread id inside an iteration
        self._live_views: "weakref.WeakSet" = weakref.WeakSet()  # see add_live_view
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
        self._phase_totals = dict.fromkeys(PHASES, 0.0)
        self._swap_seconds = 0.0
        self._last_budget = (0, 0)  # (budget_blocks, reserved_blocks) of the latest iteration
        # The background thread runs only while there is work and no blocking caller drives; it
        # exits when idle. Why: each thread that runs torch ops keeps an OpenMP team, and with two
        # teams alive on 2 cores libgomp stops spin-waiting, which made every op ~2x slower here.
        self._thread = threading.Thread(target=lambda: None, name="hf_contbatch-engine")
        self._worker_alive = False

    # --- sizing ------------------------------------------------------------------------------
    def _blocks_from_memory(self, block_bytes: int, layer_devices: Sequence[torch.device], dtype) -> int:
        """Pool size when ``num_blocks`` is None: ``gpu_memory_utilization`` on CUDA (after a
        profiling forward), ``cpu_cache_gib`` on CPU (checked against the available RAM).

        Raises:
            ValueError: the memory left cannot hold one block, or ``cpu_cache_gib`` exceeds the
                available host memory.
        """
        cache_cfg = self.config.cache
        if any(d.type == "cuda" for d in layer_devices):
            return self._blocks_from_device_memory(layer_devices, dtype)
        want = cache_cfg.cpu_cache_gib * 2**30
        available = _available_host_memory()
        if available is not None and want > available:
            raise ValueError(
                f"`cpu_cache_gib`={cache_cfg.cpu_cache_gib} exceeds the available host memory "
                f"({available / 2**30:.1f} GiB); lower it or pass `num_blocks`"
            )
        return max(1, int(want // block_bytes))

    def _blocks_from_device_memory(self, layer_devices: Sequence[torch.device], dtype) -> int:
        """vLLM's ``gpu_memory_utilization`` sizing, per CUDA device holding layers.

        KV budget of a device = total * utilization - memory in use before profiling (weights, the
        CUDA context, other processes) - the activation peak of one forward over
        ``max_num_batched_tokens`` tokens (measured, minus the probe's own small KV pool). The
        pool gets the smallest count of blocks any device can hold (a block spans every layer, each
        layer's slice on that layer's device).
        """
        util = self.config.cache.gpu_memory_utilization
        layers_on = collections.Counter(d for d in layer_devices if d.type == "cuda")
        before = {}
        for d in layers_on:
            torch.cuda.synchronize(d)
            torch.cuda.empty_cache()  # cached-but-unused blocks would read as "in use"
            torch.cuda.reset_peak_memory_stats(d)
            free, total = torch.cuda.mem_get_info(d)
            before[d] = (total, total - free, torch.cuda.memory_allocated(d))
        probe_bytes = self._profile_forward(layer_devices, dtype)
        per_layer_block = kv_bytes_per_block(1, self.config.cache.block_size, self.num_kv_heads, self.head_dim, dtype)
        counts = []
        for d, num_layers in layers_on.items():
            total, used, allocated = before[d]
            activation = max(0, torch.cuda.max_memory_allocated(d) - allocated - probe_bytes.get(d, 0))
            budget = total * util - used - activation
            blocks = int(budget // (per_layer_block * num_layers))
            if blocks < 1:
                raise ValueError(
                    f"no device memory left for the KV cache on {d}: gpu_memory_utilization={util} of "
                    f"{total / 2**30:.1f} GiB, {used / 2**30:.1f} GiB in use before profiling, "
                    f"{activation / 2**30:.2f} GiB activation peak at max_num_batched_tokens="
                    f"{self.config.scheduler.max_num_batched_tokens}; raise gpu_memory_utilization, lower "
                    "max_num_batched_tokens, or pass `num_blocks`"
                )
            counts.append(blocks)
        torch.cuda.empty_cache()
        return min(counts)

    @torch.inference_mode()
    def _profile_forward(self, layer_devices: Sequence[torch.device], dtype) -> dict:
        """One forward over ``max_num_batched_tokens`` dummy prompt tokens through the real step path
        (paged attention, a throwaway pool just big enough); returns that pool's bytes per device."""
        bs = self.config.cache.block_size
        budget = self.config.scheduler.max_num_batched_tokens
        per_request = min(budget, self.max_model_len or budget)
        lengths = [per_request] * (budget // per_request) + ([budget % per_request] if budget % per_request else [])
        num_blocks = sum(-(-n // bs) for n in lengths)
        probe = PagedKVCache(
            self.num_layers, self.num_kv_heads, self.head_dim, num_blocks, bs, dtype, layer_devices,
            attention_backend=self.backend,
        )
        probe_bm = BlockManager(num_blocks, bs)
        out = SchedulerOutput(iteration=-1)
        for i, n in enumerate(lengths):
            req = Request(request_id=-1 - i, prompt_token_ids=[0] * n, sampling=SamplingParams(max_new_tokens=1))
            probe_bm.allocate(req.request_id, n)
            out.scheduled.append(ScheduledRequest.of(req, n))
        previous = getattr(self.model.config, "_attn_implementation", None)
        register_attention()
        self.model.set_attn_implementation(ATTENTION_NAME)
        try:
            sampler = Sampler(torch.Generator(device="cpu"))
            ModelRunner(self.model, probe, probe_bm, self.device, sampler).execute(out)
            for d in {d for d in layer_devices if d.type == "cuda"}:
                torch.cuda.synchronize(d)
        finally:
            if previous is not None:
                self.model.set_attn_implementation(previous)
        sizes: dict = collections.Counter()
        for k, v in zip(probe.key_cache, probe.value_cache):
            sizes[k.device] += k.numel() * k.element_size() + v.numel() * v.element_size()
        probe.release()
        return dict(sizes)

    def _swap_blocks(self, block_bytes: int, num_blocks: int) -> int:
        """Host swap pool size in blocks (0 unless a swapping preemption mode is on).

        Raises:
            ValueError: the swap pool (plus the KV pool, when that is on the host too) exceeds the
                available host memory.
        """
        if self.config.scheduler.preemption_mode not in ("swap", "auto"):
            return 0
        gib = self.config.cache.swap_space_gib
        swap_blocks = int(gib * 2**30 // block_bytes)
        host_kv = num_blocks * block_bytes if self.device.type == "cpu" else 0
        available = _available_host_memory()
        if available is not None and swap_blocks * block_bytes + host_kv > available:
            raise ValueError(
                f"`swap_space_gib`={gib} plus the {host_kv / 2**30:.2f} GiB KV pool exceeds the available host "
                f"memory ({available / 2**30:.1f} GiB); lower swap_space_gib or use preemption_mode='recompute'"
            )
        return swap_blocks

    def _estimate_swap_cost_per_block(self, block_bytes: int) -> float:
        """Cost of moving one block to the host and back, in tokens of recompute ("auto" mode).

        Recomputing a token costs about ``2 * parameters`` FLOPs; a swap round trip moves
        ``2 * block_bytes``. Nominal rates: CPU ~50 GFLOP/s against ~5 GB/s memcpy; CUDA ~50 TFLOP/s
        against ~12 GB/s pinned PCIe. So swapping wins on CPU for any model, and on CUDA for all but
        tiny models with large blocks. ``SchedulerConfig.swap_cost_per_block`` overrides this.
        """
        num_params = sum(p.numel() for p in self.model.parameters())
        flops, bandwidth = (5e13, 1.2e10) if self.device.type == "cuda" else (5e10, 5e9)
        seconds_per_token = 2 * num_params / flops
        seconds_per_block = 2 * block_bytes / bandwidth
        return seconds_per_block / max(seconds_per_token, 1e-12)

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: submits raise, the pool is released."""
        return self._closed

    def _has_work_locked(self) -> bool:
        """Requests queued in the inbox or held by the scheduler (call with ``_cv`` held)."""
        return bool(self._inbox or self.scheduler.has_work)

    def add_live_view(self, view) -> None:
        """Register a live view (anything with a ``running`` property, held weakly).

        While one is running, blocking callers leave the iterations to the background thread:
        driving in the caller is fast on 2 cores because torch's OpenMP workers spin-wait on both,
        which starves the kernel's I/O and the browser that render the view (measured: the
        dashboard's browser test froze in about half the runs while the caller drove, never
        otherwise).
        """
        self._live_views.add(view)

    @property
    def drives_callers(self) -> bool:
        """Whether blocking callers run iterations themselves (``EngineConfig.drive_in_caller``,
        and no live view running)."""
        if not self.config.drive_in_caller or self._closed:
            return False
        return not any(view.running for view in list(self._live_views))

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
        nrs = 1 if num_return_sequences is None else num_return_sequences
        if isinstance(nrs, bool) or not isinstance(nrs, int) or nrs < 1:
            raise ValueError(f"`num_return_sequences` must be an int >= 1 or None, got {num_return_sequences!r}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("`prompt_token_ids` must be a sequence of ints")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"`priority` must be an int (lower runs first), got {priority!r}")
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
            request_id=self._ids(), prompt_token_ids=ids, sampling=sampling, priority=priority,
            stop_checker=stop_checker, max_total_tokens=self.max_model_len,
        )
        for k in range(1, nrs):
            sampling_k = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + k)
            req.pending_forks.append(Request(
                request_id=self._ids(), prompt_token_ids=list(ids), sampling=sampling_k, priority=priority,
                arrival_time=req.arrival_time, stop_checker=stop_checker, max_total_tokens=self.max_model_len,
                parent_id=req.request_id,
            ))
        handles = [RequestHandle(self, r) for r in [req, *req.pending_forks]]
        with self._cv:
            for h in handles:
                self._handles[h.request_id] = h
            self._inbox.append(("add", req))
            self._idle.clear()
            self._start_worker_locked()
        return handles[0] if num_return_sequences is None else handles

    def cancel(self, request_id: int) -> None:
        with self._cv:
            self._inbox.append(("cancel", request_id))
            self._start_worker_locked()

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
                watermark_blocks=sched.watermark_blocks,
                budget_blocks=self._last_budget[0],
                reserved_blocks=self._last_budget[1],
                num_swap_blocks=self.host_block_manager.num_blocks,
                swap_capacity_tokens=self.host_block_manager.num_blocks * bm.block_size,
                num_swapped_blocks=self.host_block_manager.num_used_blocks,
                num_preemptions_swap=sched.num_swap_preemptions,
                num_preemptions_recompute=sched.num_recompute_preemptions,
                num_swap_fallbacks=sched.num_swap_fallbacks,
                num_blocks_swapped_out=sched.num_blocks_swapped_out,
                num_blocks_swapped_in=sched.num_blocks_swapped_in,
                swap_seconds=self._swap_seconds,
                prefix_caching=bm.enable_prefix_caching,
                num_cached_blocks=bm.num_cached_free_blocks,
                prefix_cache_hit_rate=bm.prefix_hit_rate,
                prefix_cache_query_tokens=bm.num_prefix_query_tokens,
                prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
                num_prefix_evictions=bm.num_evictions,
                num_forks=sched.num_forks,
                num_fork_fallbacks=sched.num_fork_fallbacks,
                block_ref_counts=tuple(bm.ref_counts),
                phase_seconds=tuple(self._phase_totals.items()),
                last_phases=recent[-1][1] if recent else (),
                num_kv_tokens=sum(r.num_computed_tokens for r in list(sched.running)),
            )

    def close(self) -> None:
        """Stop the thread, fail what is still queued, free the pool, restore the model's attention."""
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.ident is not None:  # the placeholder before any work was never started
            self._thread.join(timeout=60)
        err = RuntimeError("the engine was closed before the request finished")
        for req in self.scheduler.all_requests():
            self._fail(req, err, status=RequestStatus.FINISHED_CANCELLED)
        for kind, item in list(self._inbox):
            if kind == "add":
                for req in [item, *item.pending_forks]:
                    self._fail(req, err, status=RequestStatus.FINISHED_CANCELLED)
        self._inbox.clear()
        self.cache.release()
        if self.packed_linears is not None:
            self.packed_linears.restore()
        users = self.model.__dict__.get(_ATTN_USERS)
        if users is not None:
            users["open"] -= 1
            if users["open"] > 0:
                return  # another open engine still serves this model through our attention
            self.model.__dict__.pop(_ATTN_USERS, None)
        if self._previous_attn is not None and getattr(self.model.config, "_attn_implementation", None) == ATTENTION_NAME:
            try:
                self.model.set_attn_implementation(self._previous_attn)
            except Exception:  # restoring must not turn close() into an error
                if not sys.is_finalizing():  # at interpreter exit (``__del__``) there is nothing to restore for
                    logger.warning("could not restore attention implementation %r", self._previous_attn)

    # --- the engine thread ---------------------------------------------------------------------
    def _start_worker_locked(self) -> None:
        """Start the background thread if there is work, nobody drives, and none runs (cv held)."""
        if self._worker_alive or self._stop or self._num_drivers:
            return
        if not self._has_work_locked():
            return
        self._worker_alive = True
        self._thread = threading.Thread(target=self._loop, name="hf_contbatch-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        while True:
            with self._cv:
                # Leave when there is nothing to do, when closing, or when a blocking caller drives
                # (``drive``): the next submit, or the driver leaving with work left, starts a new one.
                has_work = self._has_work_locked()
                if self._stop or self._num_drivers or not has_work:
                    if not has_work:
                        self._idle.set()
                    self._worker_alive = False
                    self._cv.notify_all()
                    return
            self._iterate(as_worker=True)

    def _iterate(self, as_worker: bool = False) -> None:
        """Take new requests and cancellations, then run one iteration (in whichever thread drives)."""
        with self._drive_lock:
            if as_worker and self._num_drivers:
                return  # a blocking caller arrived while we waited for the lock: leave it the work
            self._driver = threading.get_ident()
            try:
                self._take_inbox()
                if self.scheduler.has_work:
                    try:
                        self.step()
                    except Exception as exc:  # noqa: BLE001 - every error must reach the callers
                        logger.exception("engine step failed")
                        self._fail_all(exc)
                    except BaseException as exc:  # KeyboardInterrupt in a driving caller: stay consistent
                        self._fail_all(exc)
                        raise
                with self._cv:
                    if not self._has_work_locked():
                        self._idle.set()
            finally:
                self._driver = None

    def drive(self, until: Callable[[], bool], after_iteration: Optional[Callable[[], None]] = None) -> None:
        """Run iterations in the calling thread until ``until()`` is true.

        Blocking callers (``ContinuousBatchingPipeline.__call__``, ``RequestHandle.result``) lend
        their thread to the engine instead of sleeping: the background thread leaves meanwhile, so
        one thread runs torch. Measured on 2 cores: with a second thread's OpenMP team alive, libgomp
        stops spin-waiting and every op of a step runs up to 2x slower (4,384 tokens: 3.6 s driven
        by the caller vs 5.6 s on a background thread). ``submit()`` + streaming keep working
        through the background thread, which resumes when the caller leaves. Iterations are the
        same five steps whoever runs them.

        A KeyboardInterrupt (SIGINT: Ctrl-C, a notebook's Stop button) that arrives meanwhile is
        held until the current iteration is over, then raised here; the requests in flight are
        untouched (the caller cancels its own, see ``cancel_now``).

        Raises:
            RuntimeError: called from inside an iteration (e.g. a done-callback), which would nest.
            KeyboardInterrupt: an interrupt arrived; the engine's state is whole.
        """
        if self._driver == threading.get_ident():
            raise RuntimeError("drive()/result() called from inside an engine iteration (a callback)")
        with self._cv:
            self._num_drivers += 1  # a running background thread leaves after its current iteration
        interrupt = DeferredInterrupt()
        try:
            with interrupt:
                while not until() and not interrupt.pending:
                    if self._closed:
                        raise RuntimeError("the engine is closed")
                    with self._cv:
                        busy = self._has_work_locked()
                    if not busy:
                        break  # nothing left that could satisfy ``until``
                    self._iterate()
                    if after_iteration is not None:
                        after_iteration()
        finally:
            with self._cv:
                self._num_drivers -= 1
                self._start_worker_locked()  # work left by others (submit()) continues in the background
        interrupt.replay()

    def cancel_now(self, handles: Sequence["RequestHandle"]) -> None:
        """Cancel these requests and release them before returning: their handles are done with
        ``finish_reason="cancelled"`` and their partial tokens, their blocks are free. For a
        blocking call that was interrupted; other requests keep running. Waits for an iteration
        in progress in another thread to end."""
        for h in handles:
            self.cancel(h.request_id)
        if self._closed or self._driver == threading.get_ident():
            return  # closing fails them anyway; inside an iteration the next reap releases them
        interrupt = DeferredInterrupt()  # a second Stop press must not leave them half released
        with interrupt:
            with self._drive_lock:
                self._take_inbox()
                for req in self.scheduler.reap():
                    self._complete(req)
                with self._cv:
                    if not self._has_work_locked():
                        self._idle.set()
        interrupt.replay()

    def _take_inbox(self) -> None:
        """Hand new requests and cancellations to the scheduler (with the drive lock held)."""
        with self._cv:
            inbox = list(self._inbox)
            self._inbox.clear()
        for kind, item in inbox:
            if kind == "add":
                self.scheduler.add_request(item)
            else:
                self._apply_cancel(item)

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
        self._move_blocks(out)
        t_moved = time.monotonic()
        # A failing forward is narrowed down to the requests that fail alone; the others advance.
        sampled, failed = execute_isolating_failures(self.runner.execute, out)
        for s, exc in failed:
            self._fail_in_step(s.request, exc)
        advanced = self.scheduler.update_from_output(out, sampled)
        now = time.monotonic()
        for req in advanced:
            try:
                self._on_new_token(req, now)
            except Exception as exc:  # noqa: BLE001 - a stop checker or stream of one request
                self._fail_in_step(req, exc)
        t2 = time.monotonic()
        out.phases.append(("decode", t2 - t1))
        with self._stats_lock:
            self._peak_used = max(self._peak_used, self.block_manager.num_used_blocks)
            if not out.is_empty:
                self._busy_time += t2 - t0
            self.phase_log.append((out.iteration, tuple(out.phases)))
            for name, seconds in out.phases:
                self._phase_totals[name] += seconds
            if out.blocks_to_swap_in or out.blocks_to_swap_out or out.blocks_to_copy:
                self._swap_seconds += t_moved - t1
            self._last_budget = (out.budget_blocks, out.reserved_blocks)
        # Finished requests are released by the next reap; make sure there is a next iteration.
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

    def _on_new_token(self, req: Request, now: float) -> None:
        token = req.output_token_ids[-1]
        if req.first_token_time is None:
            req.first_token_time = now
            self._ttfts.append(now - req.arrival_time)
        else:
            self._itls.append(now - req.last_token_time)
        req.last_token_time = now
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

    def _fail_in_step(self, req: Request, exc: Exception) -> None:
        """Fail one request during a step: it keeps its tokens, the next reap frees its blocks and
        finishes its handle (its pending forks with it); the other requests are untouched."""
        logger.error("request %s failed after %d generated tokens: %r", req.request_id, len(req.output_token_ids), exc)
        req.error = exc
        req.status = RequestStatus.FINISHED_ERROR
        for child in req.pending_forks:
            child.error = exc

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
        self.host_block_manager.free(req.request_id)
        self._complete(req)

    def _fail_all(self, exc: BaseException) -> None:
        """An error in a step fails every request in flight; the engine then serves new ones."""
        for req in self.scheduler.all_requests():
            self._fail(req, exc)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.scheduler.swapped.clear()
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
