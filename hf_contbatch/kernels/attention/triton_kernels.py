"""Triton kernels for attention over the paged KV cache.

The paged layout is owned by the engine (``hf_contbatch.kernels.paged_cache``):

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer.
* ``slot_mapping``: int64 ``[T]``, flat slot ``block_id * block_size + offset`` of each new token.
* ``block_tables``: int32 ``[B, max_blocks_per_seq]``; entry ``j`` of row ``b`` holds the block of
  request ``b``'s tokens ``j * block_size .. (j + 1) * block_size - 1``.
* ``seq_lens``: int32 ``[B]``, context length of each request INCLUDING this step's tokens, which are
  already in the cache when attention runs.
* ``query_start_loc``: int32 ``[B + 1]``, cumulative query lengths of the flattened, unpadded batch.

Algorithms: the tiled online softmax of FlashAttention (Dao et al., 2022, arXiv:2205.14135) read
through a block table as in vLLM's PagedAttention (Kwon et al., SOSP 2023, arXiv:2309.06180), and
for long contexts with few requests the split-context reduction of flash-decoding (Dao, Haziza,
Massa, Sizov, 2023, "Flash-Decoding for long-context inference").

Every kernel gathers keys token by token (``block_tables[b, n // block_size]``), so a key tile is
independent of the block size: any power-of-two block size >= 8 works with the same tile shapes.
All query heads that share a KV head are processed by one program (GQA), so each K/V tile is read
from memory once per KV head rather than once per query head - unless the tile would not fit the
device, when the group is split over a few programs.

The decode and the prefill kernel differ in the query rows a program holds and the keys each row
may see, and share the tile loop (``_attend_context``, :mod:`.triton_common`); their launchers
(:mod:`.triton_decode`, :mod:`.triton_prefill`) share the argument checks and launch arguments
(``_prepare_attention``, :mod:`.triton_launch`). This module gathers the public functions and
chooses between the two kernels for a step (:func:`paged_attention`). Tiles are sized per device (:mod:`.triton_tiles`) from its compute
capability and shared memory per block, read from the device or, when compiling ahead of time
(``triton_aot``: sm_75/80/86/90 without a GPU), from a per-arch table. bfloat16 needs sm_80.

The module imports without Triton; ``TRITON_AVAILABLE`` says whether the kernels exist. Kernels run
on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was imported.
Arguments are checked on the host (:mod:`hf_contbatch.kernels.attention.triton_checks`), ValueError
naming the argument.
"""

from __future__ import annotations

from typing import Optional

import torch

from .triton_checks import SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES, SUPPORTED_HEAD_SIZES, check_query_start_loc
from .triton_common import TRITON_AVAILABLE
from .triton_decode import decode_num_splits, paged_decode_attention
from .triton_launch import prefers_torch, store_kv, unsupported_reason
from .triton_prefill import paged_prefill_attention
from .triton_tiles import ARCH_SHARED_MEMORY, DeviceLimits, arch_limits, check_device_dtype

__all__ = [
    "TRITON_AVAILABLE",
    "SUPPORTED_HEAD_SIZES",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_attention",
    "decode_num_splits",
    "DeviceLimits",
    "ARCH_SHARED_MEMORY",
    "arch_limits",
    "check_device_dtype",
    "prefers_torch",
    "unsupported_reason",
]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention for one step's flattened batch: the decode kernel when every request has exactly
    one query token (``max_query_len == 1`` and ``T == B``), the prefill kernel otherwise.

    Shapes and dtypes as in :func:`paged_prefill_attention` (``k_scale``/``v_scale``: an int8
    cache's scales); returns ``[T, num_heads, head_dim]``.
    """
    check_query_start_loc(query_start_loc, seq_lens)
    if max_query_len == 1 and query.dim() == 3 and query.shape[0] == seq_lens.shape[0]:
        return paged_decode_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        scale,
        sliding_window,
        softcap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
