"""The KV pools of one engine, built for its model: the attention backend, the pools' sizes (from
``KVPoolSizer``), the paged cache tensors, and the block bookkeeping of the device pool and of the
host swap pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..core.block_manager import BlockManager
from ..core.plan import StepPlan
from ..kernels.attention.backends import AttentionBackend, select_backend
from ..kernels.kv_spec import KVCacheGroup, KVCacheSpec
from ..kernels.paged_cache import PagedKVCache
from .kv_groups import cache_layer_sources, kv_cache_groups, layer_windows
from .pool_sizing import KVGeometry, KVPoolSizer, PoolSizes, layer_devices, text_config
from .runner import ModelRunner

logger = logging.getLogger("hf_contbatch.engine")


@dataclass
class KVPools:
    """The KV pools of one engine.

    Attributes:
        geometry: the model's KV geometry.
        groups: the model's KV cache groups (one today: see ``engine.kv_groups.kv_cache_groups``).
        spec: the cache layout every part reads (shapes, dtype, bytes per block, window): the
            one group's.
        device: the device of the model's input embedding.
        backend: the engine's attention backend (``kernels.attention.backends.select_backend``).
        sizes: the pools' sizes and why each has its size.
        cache: the K/V block tensors of every layer, and the host swap pool.
        block_manager: the device pool's bookkeeping.
        host_block_manager: the host swap pool's bookkeeping (0 blocks: no swapping).
    """

    geometry: KVGeometry
    groups: list[KVCacheGroup]
    spec: KVCacheSpec
    device: torch.device
    backend: AttentionBackend
    sizes: PoolSizes
    cache: PagedKVCache
    block_manager: BlockManager
    host_block_manager: BlockManager

    @classmethod
    def for_model(cls, model, config: EngineConfig, runner_class=ModelRunner) -> "KVPools":
        """Size and allocate the pools for ``model`` under ``config`` (KV dtype: ``config.cache.dtype``,
        else the model's; each layer's slice on that layer's device). ``runner_class``: the
        ``ModelRunner`` class the engine runs the model with (a memory probe runs it too).

        Raises:
            ValueError: an unknown or unusable ``attention_backend``, or pools that do not fit in
                memory (see ``KVPoolSizer.size``).
        """
        geometry = KVGeometry.of(model)
        device = model.get_input_embeddings().weight.device
        cache_cfg = config.cache
        sources = cache_layer_sources(text_config(model))  # the decoder layer of each cache layer
        windows = [layer_windows(text_config(model))[s] for s in sources]
        groups = kv_cache_groups(cache_spec(cache_cfg, geometry, next(model.parameters()).dtype), windows)
        spec = groups[0].spec
        devices = [layer_devices(model, text_config(model).num_hidden_layers)[s] for s in sources]
        backend = select_backend(config.attention_backend, device, spec, geometry.num_heads, devices)
        sizes = KVPoolSizer(model, config, geometry, device=device, backend=backend, runner_class=runner_class).size(
            devices, spec
        )
        cache = PagedKVCache(spec, sizes.num_blocks, devices, backend, num_swap_blocks=sizes.num_swap_blocks)
        line = backend.setup(spec, geometry.num_heads)  # e.g. the compiled decode kernel where it is faster here
        if line:
            logger.info("%s", line)
        window = spec.sliding_window
        return cls(
            geometry=geometry,
            groups=groups,
            spec=spec,
            device=device,
            backend=backend,
            sizes=sizes,
            cache=cache,
            block_manager=BlockManager(
                sizes.num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching, sliding_window=window
            ),
            host_block_manager=BlockManager(sizes.num_swap_blocks, cache_cfg.block_size, sliding_window=window),
        )


def cache_spec(cache_cfg, geometry: KVGeometry, model_dtype: torch.dtype) -> KVCacheSpec:
    """The pools' layout for ``cache_cfg.dtype``: the model's dtype (None), a float dtype, or "int8"
    (int8 K/V with one float32 scale per token and KV head for K and for V each); each layer shaped
    as ``geometry.layer(i)``."""
    kv = cache_cfg.kv_quant  # decoded once in the config: an int8 layout's element and scale dtypes
    dtype = getattr(torch, kv.dtype if kv else cache_cfg.dtype) if cache_cfg.dtype else model_dtype
    return KVCacheSpec.for_layers(
        [geometry.layer(i) for i in range(geometry.num_layers)],
        block_size=cache_cfg.block_size,
        dtype=dtype,
        scale_dtype=getattr(torch, kv.scale_dtype) if kv else None,
        scales_per_token_head=kv.scales_per_token_head if kv else 0,
    )


def move_blocks(cache: PagedKVCache, plan: StepPlan) -> None:
    """Execute the plan's KV moves before the forward, in the order the scheduler relies on:
    swap in (its host blocks may be reused by this step's swap-outs), swap out (its device
    blocks may be reused as this step's copy targets), then copy-on-write of forked blocks."""
    if plan.blocks_to_swap_in:
        cache.swap_in(plan.blocks_to_swap_in)
    if plan.blocks_to_swap_out:
        cache.swap_out(plan.blocks_to_swap_out)
    if plan.blocks_to_copy:
        cache.copy_blocks(plan.blocks_to_copy)
