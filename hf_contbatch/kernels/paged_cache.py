"""The paged KV pool (tensors), the host swap pool, and one step's attention metadata.

The pool of each layer is ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's layout, one
token's heads contiguous), on that layer's device. It implements the part of ``transformers.Cache``
that decoder layers call: ``update()`` scatters this step's K/V into their slots (slot mapping) and
returns them unchanged; the registered attention function then reads each request's context back
through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs about one flattened, unpadded step.

    Requests are ordered decodes first (one query token each), then prefill chunks.

    Attributes:
        slot_mapping: int64 ``[T]``; flat slot ``block * block_size + offset`` of each new token.
        query_start_loc: int32 ``[B + 1]``; cumulative query lengths.
        seq_lens: int32 ``[B]``; context length of each request including this step's tokens.
        block_tables: int32 ``[B, max_blocks]``; padded with 0 (never read past ``seq_lens``).
        num_decodes: the first ``num_decodes`` requests have exactly one query token.
        max_query_len, max_seq_len: maxima over the batch (ints, for kernel grids).
        query_start_loc_cpu, seq_lens_cpu: the same as Python lists (the torch path loops on them).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    num_kv_heads: int = 0
    # Per-step derived tensors shared by every layer (built lazily once, then reused).
    _derived: dict = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)

    def derived(self, key, builder):
        """Memoise a per-step tensor (masks, gather indices) across layers."""
        value = self._derived.get(key)
        if value is None:
            value = builder()
            self._derived[key] = value
        return value

    def to(self, device: torch.device) -> "AttentionMetadata":
        """This metadata with its tensors on ``device`` (memoised; for models spread by device_map)."""
        if self.slot_mapping.device == device:
            return self
        return self.derived(
            ("to", str(device)),
            lambda: AttentionMetadata(
                slot_mapping=self.slot_mapping.to(device),
                query_start_loc=self.query_start_loc.to(device),
                seq_lens=self.seq_lens.to(device),
                block_tables=self.block_tables.to(device),
                num_decodes=self.num_decodes,
                max_query_len=self.max_query_len,
                max_seq_len=self.max_seq_len,
                query_start_loc_cpu=self.query_start_loc_cpu,
                seq_lens_cpu=self.seq_lens_cpu,
                block_size=self.block_size,
                num_kv_heads=self.num_kv_heads,
            ),
        )


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V together."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class PagedKVCache:
    """Per-layer K/V block tensors plus the step's metadata; passed to the model as its cache.

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        num_blocks, block_size: pool geometry.
        dtype: cache dtype.
        layer_devices: device of each layer's pool (one entry per layer).
        num_swap_blocks: blocks in the host swap pool (0 disables swapping).
        attention_backend: "torch" or "triton"; decides how ``update`` stores K/V.

    Only what decoder layers call is implemented (``update``, ``get_seq_length`` and the mask-size
    queries), which is why this is duck-typed rather than a ``transformers.Cache`` subclass: the
    mask builders skip custom attention implementations, so nothing else is consulted.
    """

    is_compileable = False

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        layer_devices: Sequence[torch.device],
        num_swap_blocks: int = 0,
        attention_backend: str = "torch",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.attention_backend = attention_backend
        # The compiled CPU decode kernel (built and loaded on the first decode step that can use it).
        self.cpu_decode_kernel = None
        if (
            attention_backend == "torch"
            and dtype in (torch.float32, torch.bfloat16)
            and all(torch.device(d).type == "cpu" for d in layer_devices)
        ):
            from .attention.cpu_kernel import CPUDecodeKernel

            self.cpu_decode_kernel = CPUDecodeKernel()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=d) for d in layer_devices]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=d) for d in layer_devices]
        self.num_swap_blocks = num_swap_blocks
        self.swap_key_cache: list[torch.Tensor] = []
        self.swap_value_cache: list[torch.Tensor] = []
        if num_swap_blocks:
            swap_shape = (num_swap_blocks,) + shape[1:]
            # Pinned only where there is a device to DMA from (transformers' CPU offload pins
            # unconditionally and crashes on CPU-only torch). ``empty``: on CPU the pages are
            # committed only when a swap first writes them, so an unused pool costs no RAM.
            pin = torch.cuda.is_available() and any(torch.device(d).type == "cuda" for d in layer_devices)
            self.swap_key_cache = [torch.empty(swap_shape, dtype=dtype, pin_memory=pin) for _ in layer_devices]
            self.swap_value_cache = [torch.empty(swap_shape, dtype=dtype, pin_memory=pin) for _ in layer_devices]
        self.metadata: Optional[AttentionMetadata] = None
        # Set by a compiled forward (hf_contbatch.kernels.compiled_forward): attention then stores K/V itself.
        self.compiled_handle: Optional[torch.Tensor] = None
        self.is_sliding = [False] * num_layers

    # --- the transformers.Cache surface used by decoder layers -----------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this step's K/V (``[1, num_kv_heads, T, head_dim]``) into their slots.

        Returns the inputs unchanged: the attention function reads the context from the pool.
        """
        meta = self.metadata
        if meta is None:
            raise RuntimeError("PagedKVCache.update called outside an engine step (no attention metadata is set)")
        k_pool = self.key_cache[layer_idx]
        meta = meta.to(k_pool.device)
        # [1, KVH, T, D] -> [T, KVH, D]
        key = key_states[0].transpose(0, 1)
        value = value_states[0].transpose(0, 1)
        if self.attention_backend == "triton":
            from .attention.triton_kernels import store_kv

            store_kv(key, value, k_pool, self.value_cache[layer_idx], meta.slot_mapping)
        elif self.cpu_decode_kernel is None or not self.cpu_decode_kernel.store(
            key, value, k_pool, self.value_cache[layer_idx], meta.slot_mapping
        ):
            flat_k = k_pool.view(-1, self.num_kv_heads, self.head_dim)
            flat_v = self.value_cache[layer_idx].view(-1, self.num_kv_heads, self.head_dim)
            flat_k.index_copy_(0, meta.slot_mapping, key.to(self.dtype))
            flat_v.index_copy_(0, meta.slot_mapping, value.to(self.dtype))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Positions are always passed explicitly; models that ask (OPT) get 0 as "no dense past".
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

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
        for layer in range(self.num_layers):
            dev = self.key_cache[layer].device
            if dev not in indices:
                indices[dev] = (src_cpu.to(dev), dst_cpu.to(dev))
            src, dst = indices[dev]
            self.key_cache[layer].index_copy_(0, dst, self.key_cache[layer].index_select(0, src))
            self.value_cache[layer].index_copy_(0, dst, self.value_cache[layer].index_select(0, src))

    def _copy_blocks(self, mapping: Sequence[tuple[int, int]], to_host: bool) -> None:
        """Gather the source blocks, move them across in one transfer per layer and tensor, scatter."""
        if not mapping:
            return
        if not self.num_swap_blocks:
            raise RuntimeError("swap requested but the swap pool is empty (swap_space_gib=0)")
        src_cpu, dst_cpu = _block_ids(mapping)
        on_device: dict = {}
        for layer in range(self.num_layers):
            dev = self.key_cache[layer].device
            if dev not in on_device:
                on_device[dev] = (src_cpu if to_host else dst_cpu).to(dev)
            pools = (
                (self.key_cache[layer], self.swap_key_cache[layer]),
                (self.value_cache[layer], self.swap_value_cache[layer]),
            )
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
        self.metadata = None


def _block_ids(mapping: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (src, dst) block ids of ``mapping``'s pairs as two int64 CPU tensors."""
    return torch.tensor([s for s, _ in mapping]), torch.tensor([d for _, d in mapping])
