"""What the Triton kernels accept: the launchers' argument checks, and whether a cache shape can be
served on a device (:func:`unsupported_shape_reason`, behind ``triton_kernels.unsupported_reason``).

Shapes, dtypes, index tensors and scalars are checked on the host, each failure a ValueError naming
the argument and what it must be; devices are the launchers' own check. The contents of the index
tensors (block ids in range, ``seq_lens`` within the block table) are the caller's contract, since
checking them would cost a device sync per call. No Triton here.
"""

from __future__ import annotations

from typing import Optional

import torch

from .triton_tiles import (
    MAX_GQA_GROUP,
    DeviceLimits,
    check_device_dtype,
    decode_tile_config,
    next_power_of_2,
    prefill_tile_config,
)

__all__ = [
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_SIZES",
    "check_attention_args",
    "check_cache",
    "check_index_tensor",
    "check_query_start_loc",
    "check_store_args",
    "unsupported_shape_reason",
]

SUPPORTED_HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # 16/32: the tiny test and default models
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_tensor(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """ValueError unless ``tensor`` is an ``ndim``-D int32 or int64 tensor."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _INDEX_DTYPES or tensor.dim() != ndim:
        got = f"{tensor.dtype} with {tensor.dim()} dims" if isinstance(tensor, torch.Tensor) else type(tensor)
        raise ValueError(f"`{name}` must be a {ndim}-D int32 (or int64) tensor, got {got}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale=None, v_scale=None) -> None:
    """ValueError unless both caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` of one
    shape and supported dtype, contiguous in head_dim, with a supported block and head size; with
    ``k_scale``/``v_scale`` (an int8 cache), the caches int8 and the scales float32 ``[num_blocks,
    block_size, num_kv_heads, 1]``."""
    quantized = k_scale is not None or v_scale is not None
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"`{name}` must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(cache.shape)}"
            )
        if quantized:
            if cache.dtype != torch.int8:
                raise ValueError(f"`{name}` must be int8 when scales are given, got {cache.dtype}")
        elif cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"`{name}` dtype must be one of {SUPPORTED_DTYPES}, got {cache.dtype}")
        if cache.stride(-1) != 1:
            raise ValueError(f"`{name}` must be contiguous in its last (head_dim) dimension")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"`k_cache` and `v_cache` must have the same shape and dtype, got {tuple(k_cache.shape)} {k_cache.dtype} "
            f"and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if quantized:
        want = tuple(k_cache.shape[:3]) + (1,)
        for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != want:
                got = "None" if scales is None else f"{scales.dtype} {tuple(scales.shape)}"
                raise ValueError(f"`{name}` must be float32 {want} (one scale per token and KV head), got {got}")
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"`block_size` (k_cache.shape[1]) must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")
    if head_dim not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"`head_dim` (k_cache.shape[3]) must be one of {SUPPORTED_HEAD_SIZES}, got {head_dim}")


def check_store_args(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """The shape and dtype checks of ``store_kv`` (see there)."""
    check_cache(k_cache, v_cache, k_scale, v_scale)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != tuple(k_cache.shape[2:]):
            raise ValueError(
                f"`{name}` must be [T, num_kv_heads={k_cache.shape[2]}, head_dim={k_cache.shape[3]}], "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"`{name}` dtype must be one of {SUPPORTED_DTYPES}, got {t.dtype}")
    check_index_tensor("slot_mapping", slot_mapping, 1)
    if value.shape[0] != key.shape[0] or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"`key`, `value` and `slot_mapping` must have the same number of tokens, got "
            f"{key.shape[0]}, {value.shape[0]}, {slot_mapping.shape[0]}"
        )


def check_attention_args(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    sliding_window,
    softcap,
    out,
    query_name,
    k_scale=None,
    v_scale=None,
) -> None:
    """The checks both attention launchers make first (see ``paged_decode_attention`` for the
    arguments); ``query_name`` is the query's layout for the message. An int8 cache (with
    ``k_scale``/``v_scale``) takes a query of any supported float dtype."""
    if query.dim() != 3:
        raise ValueError(f"`query` must be {query_name}, got shape {tuple(query.shape)}")
    check_cache(k_cache, v_cache, k_scale, v_scale)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"`head_dim` (query.shape[2]) must be one of {SUPPORTED_HEAD_SIZES}, got {head_dim}")
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"`query` head_dim {head_dim} differs from the cache's head_dim {k_cache.shape[3]}")
    if k_scale is not None:
        if query.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"`query` dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
    elif query.dtype != k_cache.dtype:
        raise ValueError(f"`query` dtype {query.dtype} must equal the cache dtype {k_cache.dtype}")
    if num_heads % num_kv_heads != 0 or num_heads // num_kv_heads > MAX_GQA_GROUP:
        raise ValueError(
            f"`num_heads` (query.shape[1]={num_heads}) must be a multiple of num_kv_heads "
            f"(k_cache.shape[2]={num_kv_heads}) with at most {MAX_GQA_GROUP} query heads per KV head"
        )
    check_index_tensor("block_tables", block_tables, 2)
    check_index_tensor("seq_lens", seq_lens, 1)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"`block_tables` has {block_tables.shape[0]} rows but `seq_lens` has {seq_lens.shape[0]} entries"
        )
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"`scale` must be a positive float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"`sliding_window` must be None or a positive int, got {sliding_window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"`softcap` must be None or a positive float, got {softcap!r}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device):
        raise ValueError(
            f"`out` must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )


def check_query_start_loc(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """ValueError unless ``query_start_loc`` is a 1-D int tensor of ``len(seq_lens) + 1`` entries."""
    check_index_tensor("query_start_loc", query_start_loc, 1)
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"`query_start_loc` must have B + 1 = {seq_lens.shape[0] + 1} entries, got {query_start_loc.shape[0]}"
        )


def unsupported_shape_reason(
    limits: DeviceLimits,
    dtype: Optional[torch.dtype] = None,
    head_dim: Optional[int] = None,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    block_size: Optional[int] = None,
) -> Optional[str]:
    """Why the kernels cannot serve a cache of this shape on a device with ``limits`` (None when
    they can); ``triton_kernels.unsupported_reason`` for a device. Arguments left None are not
    checked."""
    if dtype is not None:
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not one of {SUPPORTED_DTYPES}"
        try:
            check_device_dtype(dtype, limits)
        except ValueError as e:
            return str(e)
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_SIZES:
        return f"head size {head_dim} is not one of {SUPPORTED_HEAD_SIZES}"
    if block_size is not None and block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block size {block_size} is not one of {SUPPORTED_BLOCK_SIZES}"
    group = None
    if num_heads is not None and num_kv_heads is not None:
        if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GQA_GROUP:
            return (
                f"{num_heads} query heads over {num_kv_heads} KV heads is not a GQA group of at most "
                f"{MAX_GQA_GROUP} query heads per KV head"
            )
        group = num_heads // num_kv_heads
    if dtype is not None and head_dim is not None:
        try:
            for g in (group,) if group else (1, MAX_GQA_GROUP):
                decode_tile_config(next_power_of_2(head_dim), g, dtype, limits)
                prefill_tile_config(next_power_of_2(head_dim), g, dtype, limits)
        except ValueError as e:
            return str(e)
    return None
