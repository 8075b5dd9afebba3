"""The paged KV pool (tensors), the host swap pool, and the per-step view the model gets as its cache.

The pools of layer ``i`` are ``KVCacheSpec.layer_shape(n, i)`` and ``value_shape(n, i)``: ``[num_blocks,
block_size, num_kv_heads, head_dim]`` (vLLM's layout, one token's heads contiguous; each layer its own
heads and K and V head sizes, every layer indexed by the same block ids), on that layer's device. A step passes
``PagedKVCache.for_step(metadata)`` to the model: the part of ``transformers.Cache`` that decoder
layers call, whose ``update()`` stores this step's K/V through the engine's attention backend.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .attention import note_stored, take_stored
from .attention.metadata import AttentionMetadata
from .kv_spec import KVCacheSpec

try:  # transformers' continuous-batching cache: its mask code builds no mask for one (see PagedCacheStep)
    from transformers.generation.continuous_batching.cache import PagedAttentionCache as _CBCache
except ImportError:  # pragma: no cover - other transformers versions: the step then relies on the mask registry
    _CBCache = object

__all__ = ["AttentionMetadata", "KVCacheSpec", "PagedKVCache", "PagedCacheStep"]


class PagedKVCache:
    """Per-layer K/V block tensors and the host swap pool of one engine, laid out by ``spec``.

    Args:
        spec: the cache layout (layers, block size, heads, head size, dtype).
        num_blocks: blocks of the device pool (the block manager's; a sliding-window spec adds its
            zeroed null block at index ``num_blocks``, see ``KVCacheSpec.num_null_blocks``).
        layer_devices: device of each layer's pool (one entry per layer).
        backend: the engine's ``AttentionBackend`` (stores K/V and attends); its ``check_spec``
            must accept ``spec`` (ValueError otherwise).
        num_swap_blocks: blocks in the host swap pool (0 disables swapping).

    The model never holds this object itself: each step passes ``for_step(metadata)``, a view
    carrying that step's metadata, so nothing per step is stored here.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        layer_devices: Sequence[torch.device],
        backend,
        num_swap_blocks: int = 0,
    ) -> None:
        backend.check_spec(spec)
        self.spec = spec
        self.backend = backend
        self.num_layers = spec.num_layers
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_size
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.dtype = spec.dtype
        # Layers whose update returns each request's stored context (multi-head latent attention).
        self.latent_layers = frozenset(i for i in range(spec.num_layers) if spec.layer(i).latent)
        # Layers with pools of their own; a layer sharing another's K/V (Gemma 4) gets its tensors.
        self.owning_layers = [i for i in range(spec.num_layers) if spec.owner(i) == i]
        # Layers that store their own K/V and read them as they are (neither latent nor shared):
        # fixed by the spec, so ``PagedCacheStep.plain_layer`` reads a set instead of the spec.
        self.own_kv_layers = frozenset(i for i in self.owning_layers if i not in self.latent_layers)
        n = num_blocks + spec.num_null_blocks
        self.key_cache = _per_layer(
            spec, lambda i: torch.zeros(spec.layer_shape(n, i), dtype=spec.dtype, device=layer_devices[i])
        )
        self.value_cache = _per_layer(
            spec, lambda i: torch.zeros(spec.value_shape(n, i), dtype=spec.dtype, device=layer_devices[i])
        )
        # Layers whose sparse-attention indexer caches a key per token (``KVLayerShape.indexer_head_size``):
        # a third pool each, None for the other layers (``update_indexer``).
        self.indexer_layers = frozenset(i for i in self.owning_layers if spec.layer(i).indexer_head_size)
        self.indexer_keys: list[Optional[torch.Tensor]] = [
            torch.zeros(spec.indexer_shape(n, i), dtype=spec.indexer_dtype, device=layer_devices[i])
            if i in self.indexer_layers
            else None
            for i in range(spec.num_layers)
        ]
        # Layers that cache an additive attention bias per key (``KVLayerShape.key_bias_heads``: Doge's
        # dynamic mask): one more pool each, None for the other layers (``PagedCacheStep.store_key_bias``).
        self.key_bias_layers = frozenset(i for i in self.owning_layers if spec.layer(i).key_bias_heads)
        self.key_biases: list[Optional[torch.Tensor]] = [
            torch.zeros(spec.key_bias_shape(n, i), dtype=spec.key_bias_dtype, device=layer_devices[i])
            if i in self.key_bias_layers
            else None
            for i in range(spec.num_layers)
        ]
        # A quantized layout's scales, beside the pools block for block (empty for a float cache).
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        if spec.is_quantized:
            self.key_scales = _per_layer(
                spec, lambda i: torch.zeros(spec.scale_shape(n, i), dtype=spec.scale_dtype, device=layer_devices[i])
            )
            self.value_scales = _per_layer(
                spec, lambda i: torch.zeros(spec.scale_shape(n, i), dtype=spec.scale_dtype, device=layer_devices[i])
            )
        self.num_swap_blocks = num_swap_blocks
        self.swap_key_cache: list[torch.Tensor] = []
        self.swap_value_cache: list[torch.Tensor] = []
        self.swap_key_scales: list[torch.Tensor] = []
        self.swap_value_scales: list[torch.Tensor] = []
        self.swap_indexer_keys: list[Optional[torch.Tensor]] = []
        self.swap_key_biases: list[Optional[torch.Tensor]] = []
        if num_swap_blocks:
            m = num_swap_blocks
            # Pinned only where there is a device to DMA from (transformers' CPU offload pins
            # unconditionally and crashes on CPU-only torch). ``empty``: on CPU the pages are
            # committed only when a swap first writes them, so an unused pool costs no RAM.
            pin = torch.cuda.is_available() and any(torch.device(d).type == "cuda" for d in layer_devices)
            self.swap_key_cache = _per_layer(
                spec, lambda i: torch.empty(spec.layer_shape(m, i), dtype=spec.dtype, pin_memory=pin)
            )
            self.swap_value_cache = _per_layer(
                spec, lambda i: torch.empty(spec.value_shape(m, i), dtype=spec.dtype, pin_memory=pin)
            )
            self.swap_indexer_keys = [
                torch.empty(spec.indexer_shape(m, i), dtype=spec.indexer_dtype, pin_memory=pin)
                if i in self.indexer_layers
                else None
                for i in range(spec.num_layers)
            ]
            self.swap_key_biases = [
                torch.empty(spec.key_bias_shape(m, i), dtype=spec.key_bias_dtype, pin_memory=pin)
                if i in self.key_bias_layers
                else None
                for i in range(spec.num_layers)
            ]
            if spec.is_quantized:
                self.swap_key_scales = _per_layer(
                    spec, lambda i: torch.empty(spec.scale_shape(m, i), dtype=spec.scale_dtype, pin_memory=pin)
                )
                self.swap_value_scales = _per_layer(
                    spec, lambda i: torch.empty(spec.scale_shape(m, i), dtype=spec.scale_dtype, pin_memory=pin)
                )

    def for_step(self, metadata: Optional[AttentionMetadata]) -> "PagedCacheStep":
        """The view the model gets as its cache (and ``paged_cache``) for one step: ``update`` stores
        that step's K/V by ``metadata``. ``None``: a view whose ``update`` stores nothing, for a
        compiled forward (its attention op stores K/V through the step's own view)."""
        return PagedCacheStep(self, metadata)

    def device_tensors(self, layer: int) -> list[torch.Tensor]:
        """The tensors of ``layer`` indexed by device block: K and V pools, their scales if any, then
        its indexer key pool and its per-key bias pool where it has them (swaps and copy-on-write
        move them all together)."""
        scales = [self.key_scales[layer], self.value_scales[layer]] if self.key_scales else []
        indexer = [self.indexer_keys[layer]] if layer in self.indexer_layers else []
        bias = [self.key_biases[layer]] if layer in self.key_bias_layers else []
        return [self.key_cache[layer], self.value_cache[layer], *scales, *indexer, *bias]

    def host_tensors(self, layer: int) -> list[torch.Tensor]:
        """The swap pool's counterparts of :meth:`device_tensors`, in the same order."""
        scales = [self.swap_key_scales[layer], self.swap_value_scales[layer]] if self.swap_key_scales else []
        indexer = [self.swap_indexer_keys[layer]] if layer in self.indexer_layers else []
        bias = [self.swap_key_biases[layer]] if layer in self.key_bias_layers else []
        return [self.swap_key_cache[layer], self.swap_value_cache[layer], *scales, *indexer, *bias]

    def scales(self, layer: int) -> dict:
        """``{"k_scale": ..., "v_scale": ...}`` of ``layer`` for a quantized layout, else ``{}``: the
        keywords a quantized backend's ``store_kv``/``attend`` take."""
        if not self.key_scales:
            return {}
        return {"k_scale": self.key_scales[layer], "v_scale": self.value_scales[layer]}

    @property
    def nbytes(self) -> int:
        """Bytes of the device pool (all layers, K and V; the null block included)."""
        return (self.num_blocks + self.spec.num_null_blocks) * self.spec.bytes_per_block

    # --- swapping (block contents between device pool and host pool) ---------------------------
    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks; ``mapping`` holds (device_block, host_block) pairs."""
        self._copy_blocks(mapping, to_host=True)

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks; ``mapping`` holds (host_block, device_block) pairs."""
        self._copy_blocks(mapping, to_host=False)

    def copy_blocks(self, mapping: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks within the pool (copy-on-write of a forked partial block).

        ``mapping`` holds (src, dst) pairs; every src is read before any dst is written, so a
        block freed and reused as a dst in the same step is safe.
        """
        if not mapping:
            return
        src_cpu, dst_cpu = _block_ids(mapping)
        indices: dict = {}
        for layer in self.owning_layers:  # a sharing layer's pools are its owner's: copied once
            dev = self.key_cache[layer].device
            if dev not in indices:
                indices[dev] = (src_cpu.to(dev), dst_cpu.to(dev))
            src, dst = indices[dev]
            for pool in self.device_tensors(layer):  # K, V and their scales move together
                pool.index_copy_(0, dst, pool.index_select(0, src))

    def _copy_blocks(self, mapping: Sequence[tuple[int, int]], to_host: bool) -> None:
        """Gather the source blocks, move them across in one transfer per layer and tensor, scatter."""
        if not mapping:
            return
        if not self.num_swap_blocks:
            raise RuntimeError("swap requested but the swap pool is empty (swap_space_gib=0)")
        src_cpu, dst_cpu = _block_ids(mapping)
        on_device: dict = {}
        for layer in self.owning_layers:
            dev = self.key_cache[layer].device
            if dev not in on_device:
                on_device[dev] = (src_cpu if to_host else dst_cpu).to(dev)
            pools = tuple(zip(self.device_tensors(layer), self.host_tensors(layer)))
            if to_host:
                src = on_device[dev]
                for device_pool, host_pool in pools:
                    # Synchronous: a later swap-in reads the host pool on the CPU side at once.
                    host_pool.index_copy_(0, dst_cpu, device_pool.index_select(0, src).to("cpu"))
            else:
                dst = on_device[dev]
                for device_pool, host_pool in pools:
                    device_pool.index_copy_(0, dst, host_pool.index_select(0, src_cpu).to(dev))

    def release(self) -> None:
        """Drop every tensor (``close()``)."""
        self.key_cache.clear()
        self.value_cache.clear()
        self.swap_key_cache.clear()
        self.swap_value_cache.clear()
        self.indexer_keys.clear()
        self.swap_indexer_keys.clear()
        self.key_biases.clear()
        self.swap_key_biases.clear()
        for scales in (self.key_scales, self.value_scales, self.swap_key_scales, self.swap_value_scales):
            scales.clear()


def _per_layer(spec: KVCacheSpec, make) -> list[torch.Tensor]:
    """One tensor per layer: ``make(i)`` for each layer with pools of its own, and for a layer that
    shares another's K/V (``KVLayerShape.shared_from``) its owner's tensor, built once."""
    made: dict = {}
    for i in range(spec.num_layers):
        owner = spec.owner(i)
        if owner not in made:
            made[owner] = make(owner)
    return [made[spec.owner(i)] for i in range(spec.num_layers)]


def _block_ids(mapping: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (src, dst) block ids of ``mapping``'s pairs as two int64 CPU tensors."""
    return torch.tensor([s for s, _ in mapping]), torch.tensor([d for _, d in mapping])


class PagedCacheStep(_CBCache):
    """One step's view of a ``PagedKVCache``: the part of ``transformers.Cache`` decoder layers call
    (``update``, ``get_seq_length``, the mask-size queries) plus :meth:`attend`.

    ``update`` scatters this step's K/V into their slots (the metadata's slot mapping) through the
    backend and returns them unchanged; the registered attention function then calls
    :meth:`attend`, which reads each request's context back through its block table.

    Duck-typed rather than a ``transformers.Cache``; to transformers' mask code it is a
    ``PagedAttentionCache`` (the class of its own continuous batching, whose ``__init__`` is never
    run here), for which it builds no mask: a dense mask over the flattened batch would be the
    step's largest tensor, and the paged kernels keep requests apart through the metadata.
    """

    is_compileable = False

    def __init__(self, cache: PagedKVCache, metadata: Optional[AttentionMetadata]) -> None:
        self.cache = cache
        self.metadata = metadata
        self.is_sliding = [False] * cache.num_layers
        self.layers_stored: set[int] = set()  # the layers a compiled forward's op stored this step
        self._index_mask: Optional[torch.Tensor] = None  # built on first use (``index_mask``)
        # Each metadata entry's prompt length (tokens), set by the runner for a model with a
        # sparse-attention indexer, a per-key bias or a router mixing a forward's tokens: the
        # rows generate would build come from it (``engine.sparse_indexer``,
        # ``torch_paged.key_biased_attention``, ``engine.cross_token_routers``).
        self.prompt_lens: Optional[list[int]] = None
        # Layers whose per-key bias this step stored (``store_key_bias``): layer -> (top-k width,
        # the dtype the model computed the bias in).
        self._key_bias_calls: dict[int, tuple[int, torch.dtype]] = {}
        # What the fused decoder-layer step (``kernels.fused_layer``) checked once for this step and
        # every layer of it (the forward's position embeddings, dtype, shape, attention): it lives
        # and dies with this view, so a later step checks again.
        self.layer_checks: dict = {}
        take_stored()  # a record a failed step left on this thread is not this step's

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this step's K/V (``[1, num_kv_heads, T, Dk]`` and ``[1, num_kv_heads, T, Dv]``)
        into their slots.

        Returns the inputs, except for a latent layer (``KVLayerShape.latent``: multi-head latent
        attention, whose K/V here are the compressed latents): there every request's whole stored
        context, ``[1, 1, S, Dk]`` and ``[1, 1, S, Dv]`` with ``S = sum(seq_lens)``, requests in the
        step's order (``torch_paged.context_slots``), as transformers' own cache returns a
        request's past and present latents for the model to expand into K/V heads."""
        if self.metadata is None:
            return key_states, value_states
        cache = self.cache
        k_pool, v_pool = cache.key_cache[layer_idx], cache.value_cache[layer_idx]
        meta = self.metadata.to(k_pool.device)
        # [1, KVH, T, D] -> [T, KVH, D]
        key = key_states[0].transpose(0, 1)
        value = value_states[0].transpose(0, 1)
        scales = cache.scales(layer_idx)
        cache.backend.store_kv(key, value, k_pool, v_pool, meta, **scales)
        if layer_idx in cache.latent_layers:
            from .attention.torch_paged import context_slots, gather_contexts

            slots = meta.derived(("contexts",), lambda: context_slots(meta))
            key_states = gather_contexts(k_pool, slots, scales.get("k_scale"), key_states.dtype)
            value_states = gather_contexts(v_pool, slots, scales.get("v_scale"), value_states.dtype)
        note_stored(self, layer_idx, key_states, value_states)  # for the attention call that follows
        return key_states, value_states

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Store this step's sparse-attention indexer keys (``[1, T, D]``, one per token, D the
        layer's ``KVLayerShape.indexer_head_size``) into their slots of the layer's indexer pool, and
        return every request's whole stored indexer keys, ``[1, S, D]`` in ``key_states``' dtype,
        laid out as :meth:`update`'s latent contexts (``S = sum(seq_lens)``, requests in the step's
        order): transformers' ``DynamicIndexedLayer.update_indexer`` for the flattened step.

        Raises:
            ValueError: a layer without an indexer pool.
        """
        if self.metadata is None:
            return key_states
        cache = self.cache
        if layer_idx not in cache.indexer_layers:
            raise ValueError(f"layer {layer_idx} has no indexer key pool (KVLayerShape.indexer_head_size is 0)")
        pool = cache.indexer_keys[layer_idx]
        meta = self.metadata.to(pool.device)
        flat = pool.view(-1, pool.shape[-1])
        flat.index_copy_(0, meta.slot_mapping, key_states[0].to(pool.dtype))
        from .attention.torch_paged import context_slots

        slots = meta.derived(("contexts",), lambda: context_slots(meta))
        return flat.index_select(0, slots).to(key_states.dtype).unsqueeze(0)

    def request_indexer_keys(
        self, key_states: torch.Tensor, layer_idx: int, request: int, rows: torch.Tensor, stored: int, length: int
    ) -> torch.Tensor:
        """Store the indexer keys ``key_states`` ``[1, len(rows), D]`` of the step's query rows
        ``rows`` (int64, indices into the step's tokens) into their slots, and return the first
        ``stored`` indexer keys of the step's ``request``-th metadata entry (positions ``0..stored-1``
        of its context, through its block table) zero-padded to ``length`` rows: ``[1, length, D]`` in
        ``key_states``' dtype. What one request's indexer call reads (``engine.sparse_indexer``).

        Raises:
            ValueError: a layer without an indexer pool, or ``stored`` past ``length``.
        """
        cache = self.cache
        if layer_idx not in cache.indexer_layers:
            raise ValueError(f"layer {layer_idx} has no indexer key pool (KVLayerShape.indexer_head_size is 0)")
        if stored > length:
            raise ValueError(f"request_indexer_keys: {stored} stored keys do not fit a row of {length}")
        pool = cache.indexer_keys[layer_idx]
        meta = self.metadata.to(pool.device)
        flat = pool.view(-1, pool.shape[-1])
        flat.index_copy_(0, meta.slot_mapping[rows.to(pool.device)], key_states[0].to(pool.dtype))
        bs = meta.block_size
        positions = torch.arange(stored, device=pool.device)
        slots = meta.block_tables[request].to(torch.long)[positions // bs] * bs + positions % bs
        out = flat.new_zeros((length, pool.shape[-1]))
        out[:stored] = flat.index_select(0, slots)
        return out.to(key_states.dtype).unsqueeze(0)

    def store_key_bias(self, layer_idx: int, bias: torch.Tensor, keep: int) -> torch.Tensor:
        """Store this step's per-key attention biases ``bias`` ``[1, C, T]`` (C the layer's
        ``KVLayerShape.key_bias_heads``, one value per KV head and token: Doge's ``dt_states``) into
        their slots of the layer's bias pool, for the attention call that follows: it adds each
        key's bias to every query's score of that key and keeps, per query row, only the ``keep``
        keys of largest bias (Doge's ``keep_window_size``; see ``torch_paged.key_biased_attention``).

        Returns the stand-in for the dense mask the model would build, ``[1, C, T, 0]`` (empty, so
        no mask of the model's own can be taken for it): the model hands it on to attention (Doge
        repeats it per query head), where :meth:`key_bias_call` recognizes it.

        Raises:
            ValueError: a layer without a bias pool, a view without metadata, or ``bias`` not one row
                per token of the step.
        """
        cache = self.cache
        if layer_idx not in cache.key_bias_layers:
            raise ValueError(f"layer {layer_idx} has no per-key bias pool (KVLayerShape.key_bias_heads is 0)")
        if self.metadata is None:
            raise ValueError("store_key_bias: a view without step metadata stores nothing")
        pool = cache.key_biases[layer_idx]
        meta = self.metadata.to(pool.device)
        if bias.dim() != 3 or bias.shape[1] != pool.shape[-1] or bias.shape[2] != meta.slot_mapping.shape[0]:
            raise ValueError(
                f"store_key_bias: bias {tuple(bias.shape)} is not [1, {pool.shape[-1]}, {meta.slot_mapping.shape[0]}]"
            )
        flat = pool.view(-1, pool.shape[-1])
        flat.index_copy_(0, meta.slot_mapping, bias[0].transpose(0, 1).to(pool.dtype))
        self._key_bias_calls[layer_idx] = (int(keep), bias.dtype)
        return bias.new_empty((1, bias.shape[1], bias.shape[2], 0))

    def key_bias_call(self, layer_idx, mask) -> Optional[tuple[int, torch.dtype]]:
        """``(keep, dtype)`` when ``mask`` is the stand-in :meth:`store_key_bias` returned for
        ``layer_idx`` this step (an empty last dimension; repeated per query head or not), else None."""
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != 0:
            return None
        return self._key_bias_calls.get(layer_idx)

    def index_mask(self) -> torch.Tensor:
        """bool ``[1, 1, T, S]``: the causal mask over the step's flattened contexts
        (``torch_paged.context_mask``) that a sparse-attention indexer adds to its scores, passed
        to the model as its ``attention_mask`` (the runner: ``{"indexed_attention": ...}``). Built
        once per step; the attention call recognizes it (:meth:`is_index_mask`).

        Raises:
            RuntimeError: a view without metadata.
        """
        if self.metadata is None:
            raise RuntimeError("PagedCacheStep.index_mask called on a view without step metadata")
        if self._index_mask is None:
            from .attention.torch_paged import context_mask

            device = self.metadata.slot_mapping.device
            self._index_mask = context_mask(self.metadata, device)[None, None]
        return self._index_mask

    def is_index_mask(self, mask) -> bool:
        """Whether ``mask`` is this step's :meth:`index_mask`: the one mask an attention call may
        bring (a model with an indexer passes its attention mask on to attention unchanged)."""
        return self._index_mask is not None and mask is self._index_mask

    def shares_kv(self, layer_idx) -> bool:
        """Whether ``layer_idx`` attends over another layer's K/V without storing any (Gemma 4's KV
        sharing, ``KVLayerShape.shared_from``)."""
        spec = self.cache.spec
        return isinstance(layer_idx, int) and 0 <= layer_idx < spec.num_layers and spec.owner(layer_idx) != layer_idx

    def serves_position_bias(self, position_bias: torch.Tensor) -> bool:
        """Whether :meth:`attend` can add ``position_bias`` (a model's own additive bias,
        ``[1, H, T, S]``: Inkling's relative position bias) to its scores: only where the step is one
        request whose ``T`` query rows attend over its whole context of ``S`` tokens, positions
        ``0..S-1`` (what the model computed it over when the cache's ``get_query_offset`` and
        ``get_mask_sizes`` told it that request's positions: ``RecurrentStateStep``)."""
        rows = self.one_request_rows()
        if rows is None or position_bias.dim() != 4 or position_bias.shape[0] != 1:
            return False
        return tuple(position_bias.shape[2:]) == rows

    def one_request_rows(self) -> Optional[tuple[int, int]]:
        """``(query rows, context length)`` of the step's one request, or None when the step has
        several (or no metadata): what a model's own per-row attention inputs (a position bias,
        per-row sinks) can be served over."""
        meta = self.metadata
        if meta is None or meta.num_requests != 1:
            return None
        return meta.query_start_loc_cpu[1] - meta.query_start_loc_cpu[0], meta.seq_lens_cpu[0]

    def plain_layer(self, layer_idx: int) -> bool:
        """Whether :meth:`store_and_attend` serves ``layer_idx`` as ``update`` and ``attend`` would:
        the view has metadata, and the layer stores its own K/V and reads them as they are (not a
        latent layer, not one sharing another's K/V, no per-key bias stored this step)."""
        return (
            self.metadata is not None
            and layer_idx in self.cache.own_kv_layers
            and layer_idx not in self._key_bias_calls
        )

    def store_and_attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, sliding_window
    ) -> torch.Tensor:
        """Store this step's ``key``/``value`` ``[T, KVH, D]`` into their slots and attend ``query``
        ``[T, H, D]`` over the layer's pool -> ``[T, H, D]``: what :meth:`update` then :meth:`attend`
        do for a :meth:`plain_layer` without sinks, chunk, head maps or bias, called with one
        decoder layer's tensors already in the backend's layout (``kernels.fused_layer``).
        ``sliding_window``: tokens, or None. The thread's record of the stored K/V
        (``attention.note_stored``) is not written: no attention function call follows."""
        cache = self.cache
        k_pool, v_pool = cache.key_cache[layer_idx], cache.value_cache[layer_idx]
        meta = self.metadata.to(k_pool.device)
        scales = cache.scales(layer_idx)
        cache.backend.store_kv(key, value, k_pool, v_pool, meta, **scales)
        # The backends take the step's own K/V as [KVH, T, D] (``attend``'s ``key[0]``).
        return cache.backend.attend(
            query,
            k_pool,
            v_pool,
            meta,
            scale,
            sliding_window,
            None,
            key=key.transpose(0, 1),
            value=value.transpose(0, 1),
            **scales,
        )

    def is_latent(self, layer_idx: int) -> bool:
        """Whether ``layer_idx``'s update returns whole stored contexts (see :meth:`update`)."""
        return layer_idx in self.cache.latent_layers

    def end(self) -> None:
        """Forget this thread's record of the K/V the step stored last (``attention.note_stored``):
        the attention calls of every layer read it, so it lives until the step's forward is done,
        and it holds this view and with it the pools (an engine closed after a step driven on the
        caller's thread would otherwise keep them)."""
        take_stored()

    def attend(
        self,
        layer_idx: int,
        query,
        key,
        value,
        scale: float,
        sliding_window=None,
        softcap=None,
        sinks=None,
        chunk_size=None,
        head_maps=None,
        selected=None,
        key_bias=None,
        position_bias=None,
    ):
        """``query`` ``[1, H, T, Dk]`` over the pool of ``layer_idx`` -> ``[1, T, H, Dv]``;
        ``key``/``value`` ``[1, KVH, T, Dk]`` and ``[1, KVH, T, Dv]`` this step's rows (already
        stored); ``sinks`` ``[H]`` attention-sink logits (gpt-oss), ``[T, H]`` per query row (Inkling
        2; a step of one request) or None; ``chunk_size`` (tokens)
        for a chunked local attention layer (Llama 4: a query sees the earlier keys of its own
        chunk only) or None; ``head_maps`` ``(key_heads, value_heads)``, the pool heads each of
        ``key``'s and ``value``'s heads are (DiffLlama, JetMoE: see
        ``torch_paged.torch_paged_attention``), or None. A call with a chunk or head maps takes the
        torch path (``torch_paged``, plain torch on any device): the C and Triton kernels have
        neither. For a latent layer ``key``/``value`` are the model's expansion of what
        :meth:`update` returned, ``[1, H, S, Dk]`` and ``[1, H, S, Dv]``, and attention reads them
        (``torch_paged.context_attention``) rather than the pool. ``selected``: for a latent layer
        with a sparse-attention indexer, its top-k, int ``[1, T, k]`` positions in those ``S``
        context rows (picked under :meth:`index_mask`; a pick outside the query's own causal
        context is a masked key the top-k took for want of enough visible ones, and stays masked),
        or None for dense attention. ``key_bias``: ``(keep, dtype)`` from :meth:`key_bias_call`
        for a layer whose per-key biases this step stored (``store_key_bias``), read by the torch
        path (``torch_paged.key_biased_attention``, with the step's ``prompt_lens``), or None.
        ``position_bias``: float ``[1, H, T, S]`` added to the scaled scores of the step's one
        request over its whole context (see :meth:`serves_position_bias`; Inkling's relative
        position bias), or None; a call with one takes the torch path.

        Raises:
            RuntimeError: a view without metadata (no step to attend for), or ``key_bias`` without
                the step's ``prompt_lens``.
            ValueError: ``key_bias`` with sinks, a chunk, head maps or a position bias (the path has
                none of them); a ``position_bias`` that :meth:`serves_position_bias` refuses, or one
                on a latent layer.
        """
        if self.metadata is None:
            raise RuntimeError("PagedCacheStep.attend called on a view without step metadata")
        cache = self.cache
        k_pool, v_pool = cache.key_cache[layer_idx], cache.value_cache[layer_idx]
        meta = self.metadata.to(k_pool.device)
        q = query[0].transpose(0, 1)  # [T, H, D]
        if position_bias is not None and (
            layer_idx in cache.latent_layers or not self.serves_position_bias(position_bias)
        ):
            raise ValueError(
                f"layer {layer_idx}: a position bias of shape {tuple(position_bias.shape)} is not over one request's "
                "whole context (or the layer is latent)"
            )
        if layer_idx in cache.latent_layers:
            from .attention.torch_paged import context_attention

            picks = None if selected is None else selected[0].to(q.device)
            out = context_attention(q, key[0], value[0], meta, scale, sliding_window, softcap, sinks, picks)
            return out.unsqueeze(0)
        single = key.shape[0] == 1
        if key_bias is not None:
            from .attention.torch_paged import key_biased_attention

            if self.prompt_lens is None:
                raise RuntimeError("PagedCacheStep.attend: a per-key bias needs the step's prompt_lens")
            if sinks is not None or chunk_size is not None or head_maps is not None or position_bias is not None:
                raise ValueError(
                    "PagedCacheStep.attend: a per-key bias with sinks, a chunk, head maps or a position bias is not served"
                )
            keep, bias_dtype = key_bias
            out = key_biased_attention(
                q,
                k_pool,
                v_pool,
                cache.key_biases[layer_idx],
                meta,
                scale,
                keep,
                self.prompt_lens,
                bias_dtype,
                sliding_window=sliding_window,
                softcap=softcap,
                **cache.scales(layer_idx),
            )
            return out.unsqueeze(0)
        if sinks is not None or position_bias is not None:
            # The torch path alone adds sinks and position biases (the C and Triton kernels have neither).
            attend, extra = self._torch_attention(), {"sinks": sinks, "chunk_size": chunk_size, "head_maps": head_maps}
            if position_bias is not None:
                extra["position_bias"] = position_bias[0].to(q.device)
        elif chunk_size is not None or head_maps is not None:
            from .attention.torch_paged import torch_paged_attention

            attend, extra = torch_paged_attention, {"chunk_size": chunk_size, "head_maps": head_maps}
        else:
            attend, extra = cache.backend.attend, {}
        out = attend(
            q,
            k_pool,
            v_pool,
            meta,
            scale,
            sliding_window,
            softcap,
            key=key[0] if single else None,
            value=value[0] if single else None,
            **extra,
            **cache.scales(layer_idx),
        )
        return out.unsqueeze(0)

    def _torch_attention(self):
        """The attention function of a layer with attention sinks or a position bias: the torch
        path's, the only one that has them (the C kernels and Triton do not). Every backend's pools
        have the torch path's layout, so a Triton engine's such layers step aside to it (on the GPU,
        reading the same pools)."""
        from .attention.torch_paged import torch_paged_attention

        return torch_paged_attention

    @property
    def is_initialized(self) -> bool:
        # transformers' Cache: whether K/V were stored; the pool holds the requests' context (HRM reads it).
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Positions are always passed explicitly; models that ask (OPT) get 0 as "no dense past".
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0
