"""What one KV block holds, as every part that sizes, allocates or reads the pools sees it.

``KVCacheSpec`` is the single place that turns the model's KV geometry and the storage dtype into
tensor shapes and bytes: pool sizing (``engine.pool_sizing``), the pool tensors and the swap pool
(``kernels.paged_cache``) and the attention backends read it. A quantized layout (for example int8
K/V with one float scale per token and KV head) is described by ``scale_dtype`` and
``scales_per_token_head``; float caches leave them at None and 0.

A ``KVCacheGroup`` is the layers that share one spec and one block table per request (vLLM's KV
cache groups): today one group per model, full attention or, when every layer slides over the same
window, sliding window W (its blocks are released as the window moves on, see
``core.block_manager``). Where the kinds not built yet go (each needs its own tests first):

- Per-layer shapes (built): ``layer_shapes`` gives each layer its own KV heads and K and V head
  sizes (Gemma 4's global layers, MiMo-V2-Flash's sliding layers with more KV heads, V heads
  narrower than K heads, the latents of multi-head latent attention). Every layer still shares
  the one block-id space: a block id indexes every layer's pool, each pool shaped by its layer.
- Attention sinks: a ``num_sink_tokens`` field; the block manager then keeps the first
  ``ceil(sinks / block_size)`` entries live however far the window moved (``first_live_block``).
- A recurrent layer's state: a spec of its own kind with ``state_bytes`` per request instead of
  blocks (one slot per request, no block table), in its own group.
- Mixed models (Gemma-2/3, Qwen2 with ``max_window_layers``): one group per kind, each with its
  block manager and block table per request; until then they are one full-attention group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVLayerShape:
    """What one layer's K and V pools hold per token.

    Attributes:
        num_kv_heads: key/value heads of the layer.
        head_size: channels per K head.
        v_head_size: channels per V head (MiMo-V2-Flash's V heads may be narrower than its K heads).
        latent: the layer caches multi-head latent attention's compressed latents as transformers
            does (DeepSeek V2/V3, MiniCPM3, GLM4-MoE-Lite...): one "KV head" whose K is the
            normalized KV latent (``kv_lora_rank`` channels) and whose V is the shared rotary key
            (``qk_rope_head_dim`` channels). Its ``cache.update`` returns each request's whole
            stored context, which the model expands into K/V heads itself before attention (see
            ``kernels.paged_cache.PagedCacheStep.update``).
        shared_from: the earlier layer whose K/V this layer attends over without storing any (Gemma
            4's KV sharing: its last layers reuse the K/V of the last layer of their kind before
            them); None for a layer with pools of its own. A sharing layer's pools are its source's
            tensors, so it costs no bytes; its shape fields repeat the source's.
        indexer_head_size: channels of the one key the layer's sparse-attention indexer caches per
            token (DeepSeek V3.2's DSA and its kin: transformers' ``DynamicIndexedLayer.indexer_keys``),
            0 for a layer without an indexer (or one reusing another layer's top-k). Stored in a third
            pool of the layer, ``[num_blocks, block_size, indexer_head_size]``, indexed by the same
            block ids (``kernels.paged_cache.PagedCacheStep.update_indexer``).
        key_bias_heads: channels of the additive attention bias the layer computes per key from
            that key's own projections and caches beside it (Doge's dynamic mask: ``dt_states``,
            one value per KV head, computed from the key's V), 0 for a layer without one. Stored in
            a pool of the layer, ``[num_blocks, block_size, key_bias_heads]`` float32, indexed by the
            same block ids (``kernels.paged_cache.PagedCacheStep.store_key_bias``).

    Raises:
        ValueError: a non-positive size, a negative ``indexer_head_size``, ``key_bias_heads`` or
            ``shared_from``.
    """

    num_kv_heads: int
    head_size: int
    v_head_size: int
    latent: bool = False
    shared_from: Optional[int] = None
    indexer_head_size: int = 0
    key_bias_heads: int = 0

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_size", "v_head_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayerShape.{name} must be positive, got {getattr(self, name)}")
        for name in ("indexer_head_size", "key_bias_heads"):
            if getattr(self, name) < 0:
                raise ValueError(f"KVLayerShape.{name} must be 0 or positive, got {getattr(self, name)}")
        if self.shared_from is not None and self.shared_from < 0:
            raise ValueError(f"KVLayerShape.shared_from must be None or a layer index, got {self.shared_from}")


@dataclass(frozen=True)
class KVCacheSpec:
    """The layout of the paged KV cache.

    Attributes:
        num_layers: decoder layers; every block has a slice in each layer's pool.
        block_size: tokens per block.
        num_kv_heads: key/value heads per layer (of layer 0 where ``layer_shapes`` is given).
        head_size: channels per head (of layer 0's K heads where ``layer_shapes`` is given).
        dtype: storage dtype of the K and V pools.
        scale_dtype: dtype of the per-token dequantization scales of a quantized layout (None: the
            pools hold K/V as they are, no scales).
        scales_per_token_head: scales stored per (token, KV head) for K and for V each (0 without a
            quantized layout).
        sliding_window: W when every layer of the group attends over the last W positions (the
            query's own included; transformers' ``sliding_window``), None for full attention. A
            sliding group's device pool has one more block, the null block (zeroed, never handed
            out), at index ``num_blocks``: see :attr:`num_null_blocks`.

    Raises:
        ValueError: a non-positive size or window, or scales declared without a ``scale_dtype`` (or
            the reverse).
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    scale_dtype: Optional[torch.dtype] = None
    scales_per_token_head: int = 0
    sliding_window: Optional[int] = None
    layer_shapes: tuple[KVLayerShape, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"KVCacheSpec.sliding_window must be None or positive, got {self.sliding_window}")
        if (self.scale_dtype is None) != (self.scales_per_token_head == 0):
            raise ValueError("KVCacheSpec: scale_dtype and scales_per_token_head go together (both set or neither)")
        if self.layer_shapes:
            if len(self.layer_shapes) != self.num_layers:
                raise ValueError(f"KVCacheSpec: {len(self.layer_shapes)} layer shapes for {self.num_layers} layers")
            first = self.layer_shapes[0]
            if (first.num_kv_heads, first.head_size) != (self.num_kv_heads, self.head_size):
                raise ValueError(
                    f"KVCacheSpec: layer 0's shape {first} disagrees with num_kv_heads={self.num_kv_heads}, "
                    f"head_size={self.head_size}"
                )
            for i, shape in enumerate(self.layer_shapes):
                src = shape.shared_from
                if src is not None and not (src < i and self.layer_shapes[src].shared_from is None):
                    raise ValueError(f"KVCacheSpec: layer {i} shares the K/V of layer {src}, not an earlier owner")

    @classmethod
    def for_layers(cls, shapes: Sequence[KVLayerShape], **fields) -> "KVCacheSpec":
        """The spec of layers shaped ``shapes`` (one per layer; ``fields``: the other attributes but
        ``num_layers``, ``num_kv_heads``, ``head_size`` and ``layer_shapes``, which come from
        ``shapes``). ``layer_shapes`` stays empty where every layer is the plain shape of layer 0
        (K and V heads of one size, no latents), so such a spec equals one built without shapes."""
        shapes = tuple(shapes)
        first = shapes[0]
        plain = KVLayerShape(first.num_kv_heads, first.head_size, first.head_size)
        per_layer = () if all(s == plain for s in shapes) else shapes
        return cls(
            num_layers=len(shapes),
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            layer_shapes=per_layer,
            **fields,
        )

    def layer(self, index: int) -> KVLayerShape:
        """The shape of layer ``index``'s K and V pools (0-based)."""
        if self.layer_shapes:
            return self.layer_shapes[index]
        return KVLayerShape(self.num_kv_heads, self.head_size, self.head_size)

    @property
    def uniform(self) -> bool:
        """Whether every layer holds ``num_kv_heads`` heads of ``head_size`` channels for K and V
        alike (no latents): the shape a backend's one-shape preparation (``setup``) times."""
        return not self.layer_shapes

    @property
    def num_null_blocks(self) -> int:
        """Blocks the device pool holds beyond its ``num_blocks``: 1 (the null block that a sliding
        group's block tables point at where the window moved on) or 0 (full attention)."""
        return 0 if self.sliding_window is None else 1

    @property
    def is_quantized(self) -> bool:
        """Whether the pools store scales beside K/V."""
        return self.scales_per_token_head > 0

    def layer_shape(self, num_blocks: int, layer: int = 0) -> tuple[int, int, int, int]:
        """Shape of layer ``layer``'s K pool: ``[num_blocks, block_size, num_kv_heads, head_size]``
        (its V pool: :meth:`value_shape`)."""
        shape = self.layer(layer)
        return (num_blocks, self.block_size, shape.num_kv_heads, shape.head_size)

    def value_shape(self, num_blocks: int, layer: int = 0) -> tuple[int, int, int, int]:
        """Shape of layer ``layer``'s V pool: ``[num_blocks, block_size, num_kv_heads, v_head_size]``."""
        shape = self.layer(layer)
        return (num_blocks, self.block_size, shape.num_kv_heads, shape.v_head_size)

    def scale_shape(self, num_blocks: int, layer: int = 0) -> Optional[tuple[int, int, int, int]]:
        """Shape of layer ``layer``'s K (or V) scales, ``[num_blocks, block_size, num_kv_heads,
        scales_per_token_head]``; None for a float cache."""
        if not self.is_quantized:
            return None
        return (num_blocks, self.block_size, self.layer(layer).num_kv_heads, self.scales_per_token_head)

    @property
    def indexer_dtype(self) -> torch.dtype:
        """dtype of the indexer key pools: the K/V dtype for a float cache; float32 under a quantized
        layout (the indexer scores in float32, and its top-k must pick what ``generate``'s would)."""
        return torch.float32 if self.is_quantized else self.dtype

    def indexer_shape(self, num_blocks: int, layer: int = 0) -> Optional[tuple[int, int, int]]:
        """Shape of layer ``layer``'s indexer key pool, ``[num_blocks, block_size,
        indexer_head_size]``; None for a layer without an indexer."""
        size = self.layer(layer).indexer_head_size
        return (num_blocks, self.block_size, size) if size else None

    # float32 whatever the K/V dtype: a bias computed in bf16 or float16 is held exactly, and the
    # top-k over it is taken in the model's dtype again (``torch_paged.key_biased_attention``).
    key_bias_dtype = torch.float32

    def key_bias_shape(self, num_blocks: int, layer: int = 0) -> Optional[tuple[int, int, int]]:
        """Shape of layer ``layer``'s per-key bias pool, ``[num_blocks, block_size, key_bias_heads]``
        (``key_bias_dtype``); None for a layer without a per-key bias."""
        heads = self.layer(layer).key_bias_heads
        return (num_blocks, self.block_size, heads) if heads else None

    def owner(self, layer: int) -> int:
        """The layer whose pools ``layer`` reads: itself, or the layer it shares K/V with."""
        src = self.layer(layer).shared_from
        return layer if src is None else src

    def layer_block_bytes(self, layer: int) -> int:
        """Bytes of one block in layer ``layer``: K and V, scales, indexer keys and per-key biases
        included (0 for a layer that shares another's pools)."""
        shape = self.layer(layer)
        if shape.shared_from is not None:
            return 0
        tokens_heads = self.block_size * shape.num_kv_heads
        data = tokens_heads * (shape.head_size + shape.v_head_size) * _itemsize(self.dtype)
        scales = tokens_heads * self.scales_per_token_head * _itemsize(self.scale_dtype) if self.is_quantized else 0
        indexer = self.block_size * shape.indexer_head_size * _itemsize(self.indexer_dtype)
        key_bias = self.block_size * shape.key_bias_heads * _itemsize(self.key_bias_dtype)
        return data + 2 * scales + indexer + key_bias

    @functools.cached_property
    def layer_bytes_per_block(self) -> int:
        """Bytes of one block in the largest layer: K and V, scales included (every layer's where
        the layers share one shape; per layer: :meth:`layer_block_bytes`)."""
        return max(self.layer_block_bytes(i) for i in range(self.num_layers))

    @functools.cached_property  # a sum over the layers; stats read it per snapshot (frozen: computed once)
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers: K and V, scales included."""
        return sum(self.layer_block_bytes(i) for i in range(self.num_layers))


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one KV layout (each layer's shape in ``spec.layer_shapes`` where they
    differ) and one block table per request.

    Attributes:
        group_id: the group's index in the model's groups (0-based).
        layers: indices of the decoder layers in the group, ascending.
        spec: their layout (``spec.num_layers == len(layers)``; its ``sliding_window`` is the kind).

    Raises:
        ValueError: no layer, or ``spec.num_layers`` not the number of layers.
    """

    group_id: int
    layers: tuple[int, ...]
    spec: KVCacheSpec

    def __post_init__(self) -> None:
        if not self.layers or self.spec.num_layers != len(self.layers):
            raise ValueError(f"KVCacheGroup: {len(self.layers)} layers but a spec of {self.spec.num_layers}")
