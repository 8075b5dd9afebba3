"""Default sizes of the host-memory pools: the KV pool on CPU and the swap pool.

Pure arithmetic (no torch), so the rules are easy to test and to read. A pool much larger than the
model can ever fill costs memory and makes the dashboard's grid unreadable (a small model's blocks
are small, so a fixed byte budget can hold many times what ``max_num_seqs`` requests at its full
context need), so the defaults are sized from what the model can use:

- **KV pool on CPU** (``CacheConfig.cpu_cache_gib=None``): ``max_num_seqs`` requests each at the
  model's full context (``max_position_embeddings``), in blocks (a sliding-window group: each
  request's window plus one step's tokens, :func:`blocks_per_request`); capped at ``HOST_CAP_GIB`` and at
  ``HOST_FRACTION`` of the available host memory. With an unknown context, the cap.
- **Swap pool** (``CacheConfig.swap_space_gib=None``, swap/auto preemption): as many blocks as the
  device pool (swapped-out requests held those blocks on the device, and swap falls back to
  recompute when the host pool is full), at most what the model can use, under the same caps
  after the host KV pool's bytes.

CUDA pools keep vLLM's ``gpu_memory_utilization`` rule (see ``LLMEngine``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

HOST_CAP_GIB = 1.0  # most a default host pool takes
HOST_FRACTION = 0.25  # of the available host memory, at most, for a default host pool


@dataclass(frozen=True)
class PoolSize:
    """A pool size and why: ``num_blocks`` blocks, ``reason`` in words (for the log and the dashboard)."""

    num_blocks: int
    reason: str


@dataclass(frozen=True)
class Window:
    """A sliding-window KV cache group's window: ``tokens`` (W) and the most tokens a request
    schedules in one step (``max_step_tokens``, the scheduler's ``max_num_batched_tokens``)."""

    tokens: int
    max_step_tokens: int


def blocks_per_request(max_model_len: Optional[int], block_size: int, window: Optional[Window] = None) -> Optional[int]:
    """Most blocks one request holds at once: its full context ``max_model_len`` (tokens) in blocks
    under full attention; under a window, at most the blocks spanning ``W - 1`` positions before a
    step and the step's tokens, ``ceil((W - 2 + max_step_tokens) / block_size) + 1``, whatever the
    request's length. None when neither bounds it (context unknown, full attention)."""
    full = math.ceil(max_model_len / block_size) if max_model_len else None
    if window is None:
        return full
    span = math.ceil((window.tokens - 2 + window.max_step_tokens) / block_size) + 1
    return span if full is None else min(full, span)


def blocks_model_can_use(
    max_num_seqs: int, max_model_len: Optional[int], block_size: int, window: Optional[Window] = None
) -> Optional[int]:
    """Blocks that ``max_num_seqs`` requests at the full context ``max_model_len`` (tokens) hold
    (under ``window``, each at most its window's blocks); None when that is unbounded."""
    per_request = blocks_per_request(max_model_len, block_size, window)
    return None if per_request is None else max_num_seqs * per_request


def _cap_blocks(block_bytes: int, available_bytes: Optional[int]) -> tuple[int, str]:
    cap = HOST_CAP_GIB * 2**30
    why = f"{HOST_CAP_GIB:g} GiB"
    if available_bytes is not None and available_bytes * HOST_FRACTION < cap:
        cap = available_bytes * HOST_FRACTION
        why = f"{HOST_FRACTION:.0%} of the available host memory ({available_bytes / 2**30:.1f} GiB)"
    return max(1, int(cap // block_bytes)), why


def default_host_kv_blocks(
    block_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: Optional[int],
    available_bytes: Optional[int],
    window: Optional[Window] = None,
) -> PoolSize:
    """The CPU KV pool's default size.

    Args:
        block_bytes: bytes of one block over all layers, K and V.
        block_size: tokens per block.
        max_num_seqs: most requests running at once (``SchedulerConfig.max_num_seqs``).
        max_model_len: the model's context in tokens, or None when unknown.
        available_bytes: available host memory (``MemAvailable``), or None when unknown.
        window: the sliding window of a sliding-window group, None for full attention.
    """
    cap, cap_why = _cap_blocks(block_bytes, available_bytes)
    want = blocks_model_can_use(max_num_seqs, max_model_len, block_size, window)
    if want is None:
        return PoolSize(cap, f"{cap_why} (the model's context is unknown)")
    if want <= cap:
        return PoolSize(want, _want_words(max_num_seqs, max_model_len, window))
    return PoolSize(
        cap,
        f"capped at {cap_why}; max_num_seqs {max_num_seqs} × context {max_model_len} tokens "
        f"would take {want * block_bytes / 2**30:.2f} GiB",
    )


def default_swap_blocks(
    block_bytes: int,
    device_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: Optional[int],
    available_bytes: Optional[int],
    host_kv_bytes: int = 0,
    window: Optional[Window] = None,
) -> PoolSize:
    """The swap pool's default size: the device pool's block count, at most what the model can use,
    capped like the KV pool after ``host_kv_bytes`` (the KV pool's bytes when it is on the host too).

    Args: as ``default_host_kv_blocks``, plus ``device_blocks`` (the KV pool's size) and
    ``host_kv_bytes``.
    """
    left = None if available_bytes is None else max(0, available_bytes - host_kv_bytes)
    cap, cap_why = _cap_blocks(block_bytes, left)
    want = blocks_model_can_use(max_num_seqs, max_model_len, block_size, window)
    target, why = device_blocks, "as many blocks as the KV pool"
    if want is not None and want < target:
        target, why = want, _want_words(max_num_seqs, max_model_len, window)
    if target <= cap:
        return PoolSize(target, why)
    return PoolSize(cap, f"capped at {cap_why}")


def _want_words(max_num_seqs: int, max_model_len: Optional[int], window: Optional[Window]) -> str:
    """Why a pool holds what the model can use, in words."""
    words = f"max_num_seqs {max_num_seqs} × context {max_model_len} tokens"
    if window is None:
        return words
    if max_model_len is None:
        words = f"max_num_seqs {max_num_seqs}"
    return f"{words}, a window of {window.tokens} tokens each (+ a {window.max_step_tokens}-token step)"
