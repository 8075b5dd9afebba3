"""Sizing the KV pools: device blocks from memory (profiling on CUDA), the host swap pool, and the
swap-versus-recompute cost estimate.

``LLMEngine`` asks a ``KVPoolSizer`` once, before it allocates anything, and gets a ``PoolSizes``
back: the sizes and, per pool, why it has its size (logged, and shown by the dashboard through
``LLMEngine.pool_sizing``).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.plan import NewRequestData, ScheduledRequest, StepPlan
from ..core.pool_size import Window, default_host_kv_blocks, default_swap_blocks
from ..kernels.kv_spec import KVCacheSpec, KVLayerShape
from ..kernels.paged_cache import PagedKVCache
from ..request import Request, SamplingParams
from .attention_switch import restore_attention, switch_to_paged_attention
from .kv_groups import cache_layer_sources, layer_kv_shapes, layer_query_heads, own_cache_kinds
from .runner import ModelRunner
from .sampler import Sampler

logger = logging.getLogger("hf_contbatch.engine")  # one logger for the engine's messages


def text_config(model):
    """The text model's config (multimodal configs nest it)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_context(cfg) -> Optional[int]:
    """The model's context in tokens from its (text) config: ``max_position_embeddings``, else
    MPT's ``max_seq_len`` (its ALiBi bias is built that long: a longer sequence fails in the model's
    own forward, in ``generate`` too); None where the config sets neither (no limit known)."""
    context = getattr(cfg, "max_position_embeddings", None)
    return context if context is not None else getattr(cfg, "max_seq_len", None)


def layer_devices(model, num_layers: int) -> list[torch.device]:
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


def available_host_memory() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class KVGeometry:
    """The model's shape as the KV pool sees it (read from the text model's config).

    Attributes:
        num_layers: cache layers (each has its slice of every block): the decoder layers, and
            for a model running a span of them several times its later passes' (see
            ``engine.kv_groups.cache_layer_sources``).
        num_heads: query heads (layer 0's where its module's differ from the config's, see ``of``).
        num_kv_heads: key/value heads (fewer than ``num_heads`` under grouped-query attention); layer
            0's where ``layer_shapes`` differ.
        head_dim: channels per head (layer 0's K heads where ``layer_shapes`` differ).
        max_model_len: the model's context in tokens (:func:`model_context`); None if unset.
        layer_shapes: each layer's K/V shape (``engine.kv_groups.layer_kv_shapes``); empty when the
            geometry was built by hand (every layer ``num_kv_heads`` x ``head_dim`` for K and V).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: Optional[int]
    layer_shapes: tuple[KVLayerShape, ...] = ()

    @classmethod
    def of(cls, model) -> "KVGeometry":
        """The geometry of ``model`` (a transformers causal LM; multimodal configs nest the text one).

        Raises:
            ValueError: a layer whose K/V projections do not split into heads (see
                ``layer_kv_shapes``).
        """
        cfg = text_config(model)
        if getattr(cfg, "num_attention_heads", None) is None:
            # No attention at all (Mamba: recurrent layers only): the pool the block manager counts
            # tokens in keeps one channel of one head per token; the state lives in the state pool.
            return cls(
                num_layers=cfg.num_hidden_layers,
                num_heads=1,
                num_kv_heads=1,
                head_dim=1,
                max_model_len=model_context(cfg),
            )
        # GPT-BigCode's multi-query attention has one KV head and no num_key_value_heads.
        kvh = (
            1 if getattr(cfg, "multi_query", False) else (_attr(cfg, "num_key_value_heads") or cfg.num_attention_heads)
        )
        # Gemma 4's config raises for a global head_dim (it is per layer): then each layer's module says.
        try:
            config_head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
            config_head_dim = None
        shapes = layer_kv_shapes(model, cfg.num_hidden_layers, kvh, config_head_dim)
        # A cache layer of a later loop pass (Inkling 2 Loop) is shaped as the layer it repeats.
        shapes = tuple(shapes[s] for s in cache_layer_sources(cfg))
        num_heads = cfg.num_attention_heads
        if num_heads % shapes[0].num_kv_heads:
            # Layer 0's heads are not the config's (Inkling's sliding layers: 64 query heads over 16
            # KV heads beside the config's 4 over 2): its module's count, so that the geometry the
            # backend is chosen and timed for is one layer's (the C kernels divide by the groups).
            num_heads = layer_query_heads(model, cfg.num_hidden_layers, 0)
            if num_heads is None or num_heads % shapes[0].num_kv_heads:
                num_heads = shapes[0].num_kv_heads
        return cls(
            num_layers=len(shapes),
            num_heads=num_heads,
            num_kv_heads=shapes[0].num_kv_heads,
            head_dim=shapes[0].head_size,
            max_model_len=model_context(cfg),
            layer_shapes=shapes,
        )

    def layer(self, index: int) -> KVLayerShape:
        """Layer ``index``'s K/V shape (the uniform one where ``layer_shapes`` is empty)."""
        if self.layer_shapes:
            return self.layer_shapes[index]
        return KVLayerShape(self.num_kv_heads, self.head_dim, self.head_dim)


def _attr(cfg, name: str):
    """``cfg.name`` or None; also None where transformers raises for an attribute that is per layer
    in this config (Gemma 4's ``head_dim``: ``AmbiguousGlobalPerLayerAttributeError``, a RuntimeError)."""
    try:
        return getattr(cfg, name, None)
    except RuntimeError:
        return None


@dataclass(frozen=True)
class PoolSizes:
    """The KV pools' sizes, as ``KVPoolSizer.size`` decided them.

    Attributes:
        num_blocks: blocks of the device pool.
        num_swap_blocks: blocks of the host swap pool (0: no swapping).
        block_bytes: bytes of one block over all layers (keys and values).
        swap_cost_per_block: a swap round trip of one block in tokens of recompute (the
            scheduler's estimate for ``preemption_mode="auto"``).
        reasons: pool ("kv", and "swap" when there is one) -> why it has its size.
    """

    num_blocks: int
    num_swap_blocks: int
    block_bytes: int
    swap_cost_per_block: float
    reasons: dict = field(default_factory=dict)


class KVPoolSizer:
    """Decides how many blocks the device pool and the host swap pool get.

    Args:
        model: the model the pools serve (its parameters count for the swap cost; on CUDA one
            profiling forward runs through it).
        config: the engine configuration (cache and scheduler settings).
        geometry: the model's KV geometry.
        device: the device of the model's input embedding.
        backend: the attention backend the profiling forward uses.
        runner_class: the ``ModelRunner`` class the engine runs the model with (the profiling forward's).
    """

    def __init__(
        self,
        model,
        config: EngineConfig,
        geometry: KVGeometry,
        *,
        device: torch.device,
        backend,
        runner_class=ModelRunner,
    ) -> None:
        self.model = model
        self.runner_class = runner_class
        self.config = config
        self.geometry = geometry
        self.device = device
        self.backend = backend

    def size(self, layer_devices: Sequence[torch.device], spec: KVCacheSpec) -> PoolSizes:
        """The pools' sizes for a cache laid out by ``spec`` with each layer's slice on
        ``layer_devices[i]``; logs them in one INFO line.

        Raises:
            ValueError: the memory left cannot hold one block, or ``cpu_cache_gib`` /
                ``swap_space_gib`` exceed the available host memory.
        """
        cache_cfg = self.config.cache
        block_bytes = spec.bytes_per_block
        reasons: dict[str, str] = {}
        if cache_cfg.num_blocks:
            num_blocks = cache_cfg.num_blocks
            reasons["kv"] = f"num_blocks={num_blocks}"
        else:
            num_blocks, reasons["kv"] = self._blocks_from_memory(block_bytes, layer_devices, spec)
        swap_blocks, swap_reason = self._swap_blocks(block_bytes, num_blocks, self._window(spec))
        if swap_reason:
            reasons["swap"] = swap_reason
        sizes = PoolSizes(num_blocks, swap_blocks, block_bytes, self._swap_cost_per_block(block_bytes), reasons)
        self._log(sizes)
        return sizes

    def _blocks_from_memory(
        self, block_bytes: int, layer_devices: Sequence[torch.device], spec: KVCacheSpec
    ) -> tuple[int, str]:
        """Pool size when ``num_blocks`` is None: ``gpu_memory_utilization`` on CUDA (after a
        profiling forward); on CPU ``cpu_cache_gib`` (checked against the available RAM) or, when
        that is None, what the model can use (``core.pool_size.default_host_kv_blocks``), which is
        also the size for a model whose requests keep their own caches (``kv_groups.own_cache_kinds``).

        Raises:
            ValueError: the memory left cannot hold one block, or ``cpu_cache_gib`` exceeds the
                available host memory.
        """
        cache_cfg = self.config.cache
        nulls = spec.num_null_blocks  # a sliding group's null block comes out of the same memory
        if own_cache_kinds(self.model):
            # Each request keeps transformers' own cache (engine.own_cache_runner): the pool, one
            # channel per layer, only counts tokens, and a profiling forward through a paged step
            # would hand the model a cache without its layers' methods. As many blocks as the model
            # can use, whatever the device.
            size = default_host_kv_blocks(
                block_bytes,
                cache_cfg.block_size,
                self.config.scheduler.max_num_seqs,
                self.geometry.max_model_len,
                None,
                self._window(spec),
            )
            return size.num_blocks, f"requests keep their own caches; {size.reason}"
        if any(d.type == "cuda" for d in layer_devices):
            reason = f"gpu_memory_utilization={cache_cfg.gpu_memory_utilization:g}"
            return max(1, self.blocks_from_device_memory(layer_devices, spec) - nulls), reason
        available = available_host_memory()
        if cache_cfg.cpu_cache_gib is None:
            size = default_host_kv_blocks(
                block_bytes,
                cache_cfg.block_size,
                self.config.scheduler.max_num_seqs,
                self.geometry.max_model_len,
                available,
                self._window(spec),
            )
            return size.num_blocks, size.reason
        want = cache_cfg.cpu_cache_gib * 2**30
        if available is not None and want > available:
            raise ValueError(
                f"`cpu_cache_gib`={cache_cfg.cpu_cache_gib} exceeds the available host memory "
                f"({available / 2**30:.1f} GiB); lower it or pass `num_blocks`"
            )
        return max(1, int(want // block_bytes) - nulls), f"cpu_cache_gib={cache_cfg.cpu_cache_gib:g}"

    def _window(self, spec: KVCacheSpec) -> Optional[Window]:
        """The window of a sliding-window group, for the pool sizes by what the model can use."""
        if spec.sliding_window is None:
            return None
        return Window(spec.sliding_window, self.config.scheduler.max_num_batched_tokens)

    def blocks_from_device_memory(self, layer_devices: Sequence[torch.device], spec: KVCacheSpec) -> int:
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
        probe_bytes = self.profile_forward(layer_devices, spec)
        block_bytes_on: dict = collections.Counter()  # each layer's own bytes per block (shapes may differ)
        for i, d in enumerate(layer_devices):
            if d.type == "cuda":
                block_bytes_on[d] += spec.layer_block_bytes(i)
        counts = []
        for d in layers_on:
            total, used, allocated = before[d]
            activation = max(0, torch.cuda.max_memory_allocated(d) - allocated - probe_bytes.get(d, 0))
            budget = total * util - used - activation
            blocks = int(budget // block_bytes_on[d])
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
    def profile_forward(self, layer_devices: Sequence[torch.device], spec: KVCacheSpec) -> dict:
        """One forward over ``max_num_batched_tokens`` dummy prompt tokens through the real step path
        (paged attention, a throwaway pool just big enough); returns that pool's bytes per device."""
        bs = spec.block_size
        budget = self.config.scheduler.max_num_batched_tokens
        per_request = min(budget, self.geometry.max_model_len or budget)
        lengths = [per_request] * (budget // per_request) + ([budget % per_request] if budget % per_request else [])
        num_blocks = sum(-(-n // bs) for n in lengths)
        probe = PagedKVCache(spec, num_blocks, layer_devices, self.backend)
        probe_bm = BlockManager(num_blocks, bs)
        plan = StepPlan(iteration=-1)
        sampler = Sampler(torch.Generator(device="cpu"))
        for i, n in enumerate(lengths):
            req = Request(request_id=-1 - i, prompt_token_ids=[0] * n, sampling=SamplingParams(max_new_tokens=1))
            probe_bm.allocate(req.request_id, n)
            row = ScheduledRequest.for_tokens(req, n)
            plan.scheduled.append(row.with_blocks(probe_bm.get_block_table(req.request_id)))
            plan.new_requests.append(NewRequestData.of(req))  # the runner's batch gets its values once
            sampler.processors.track(req)
        if self.runner_class.uses_attention_interface:
            previous = switch_to_paged_attention(self.model)
        else:  # a model attending in its own code (dense_runner) keeps its implementation
            previous = switch_to_paged_attention(self.model, switch=False)
        try:
            self.runner_class(self.model, probe, self.device, sampler, bs, budget).execute(plan)
            for d in {d for d in layer_devices if d.type == "cuda"}:
                torch.cuda.synchronize(d)
        finally:
            restore_attention(self.model, previous)
        sizes: dict = collections.Counter()
        for i, k in enumerate(probe.key_cache):
            sizes[k.device] += (num_blocks + spec.num_null_blocks) * spec.layer_block_bytes(i)
        probe.release()
        return dict(sizes)

    def _swap_blocks(self, block_bytes: int, num_blocks: int, window: Optional[Window] = None) -> tuple[int, str]:
        """Host swap pool size in blocks (0 unless a swapping preemption mode is on), and why.

        Raises:
            ValueError: the swap pool (plus the KV pool, when that is on the host too) exceeds the
                available host memory.
        """
        if self.config.scheduler.preemption_mode not in ("swap", "auto"):
            return 0, ""
        gib = self.config.cache.swap_space_gib
        host_kv = num_blocks * block_bytes if self.device.type == "cpu" else 0
        available = available_host_memory()
        if gib is None:
            size = default_swap_blocks(
                block_bytes,
                num_blocks,
                self.config.cache.block_size,
                self.config.scheduler.max_num_seqs,
                self.geometry.max_model_len,
                available,
                host_kv,
                window,
            )
            return size.num_blocks, size.reason
        swap_blocks = int(gib * 2**30 // block_bytes)
        if available is not None and swap_blocks * block_bytes + host_kv > available:
            raise ValueError(
                f"`swap_space_gib`={gib} plus the {host_kv / 2**30:.2f} GiB KV pool exceeds the available host "
                f"memory ({available / 2**30:.1f} GiB); lower swap_space_gib or use preemption_mode='recompute'"
            )
        return swap_blocks, f"swap_space_gib={gib:g}"

    def _log(self, sizes: PoolSizes) -> None:
        """One INFO line per engine: the pools' sizes and why."""
        bs = self.config.cache.block_size
        n, swap, block_bytes = sizes.num_blocks, sizes.num_swap_blocks, sizes.block_bytes
        line = (
            f"KV pool: {n} blocks of {bs} tokens ({n * bs} tokens, "
            f"{n * block_bytes / 2**20:.0f} MiB on {self.device.type}; {sizes.reasons['kv']})"
        )
        if swap:
            line += (
                f"; swap pool: {swap} blocks ({swap * block_bytes / 2**20:.0f} MiB; {sizes.reasons.get('swap', '')})"
            )
        logger.info(line)

    def _swap_cost_per_block(self, block_bytes: int) -> float:
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
