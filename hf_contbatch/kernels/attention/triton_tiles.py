"""Tile sizing of the Triton attention kernels per device, without Triton and without a device.

A launch shape (:class:`TileConfig`) is chosen from the device's :class:`DeviceLimits`: its compute
capability (tensor cores from sm_80 on) and its opt-in shared memory per block. On a device the
launchers in :mod:`hf_contbatch.kernels.attention.triton_launch` read the limits from
``torch.cuda.get_device_properties``; ahead of time (``triton_aot``) and in tests they come from the
per-arch table :data:`ARCH_SHARED_MEMORY`. Candidates are tried from the widest tile down and the
first whose shared-memory estimate fits is taken, so every supported shape gets a tile on every arch
in the table (checked by ``tests/kernels/test_triton_tiles.py``; the estimate itself is checked
against Triton's real allocation by the compile check).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "MAX_GQA_GROUP",
    "SHARED_MARGIN",
    "ARCH_SHARED_MEMORY",
    "DeviceLimits",
    "TileConfig",
    "arch_limits",
    "check_device_dtype",
    "decode_tile_config",
    "next_power_of_2",
    "prefill_tile_config",
    "shared_memory_estimate",
]

MAX_GQA_GROUP = 64
"""Query heads per KV head that one program can hold; also the row tile of the prefill kernel."""

SHARED_MARGIN = 1024
"""Bytes of shared memory the compiler may add to :func:`shared_memory_estimate` (reduction scratch,
barriers)."""


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): Triton's tile dimensions are powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What the launchers size tiles from: ``capability`` (major, minor), ``shared_memory_per_block``
    (bytes, the opt-in per-block maximum a kernel may request), ``name`` for messages."""

    name: str
    capability: tuple
    shared_memory_per_block: int


# Opt-in shared memory per block (bytes) by compute capability (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"); used when compiling ahead of time. On a device the
# launchers read torch.cuda.get_device_properties(i).shared_memory_per_block_optin instead.
ARCH_SHARED_MEMORY = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_ARCH_NAMES = {
    75: "T4 / RTX 20xx",
    80: "A100",
    86: "A10 / RTX 30xx",
    87: "Jetson Orin",
    89: "L4 / RTX 40xx",
    90: "H100 / H200",
}


def arch_limits(arch: int) -> DeviceLimits:
    """The :class:`DeviceLimits` of compute capability ``arch`` (e.g. 75, 80, 86, 90) from the table; an
    arch newer than the table gets the newest entry's shared memory. ValueError below sm_75."""
    known = [a for a in ARCH_SHARED_MEMORY if a <= arch]
    if not known:
        raise ValueError(f"`arch` must be a compute capability >= 75 (sm_75), got {arch!r}")
    return DeviceLimits(
        f"sm_{arch} ({_ARCH_NAMES.get(arch, 'unknown GPU')})", divmod(arch, 10), ARCH_SHARED_MEMORY[max(known)]
    )


def check_device_dtype(dtype: torch.dtype, limits: DeviceLimits, name: str = "dtype") -> None:
    """Raise ValueError if the kernels cannot run ``dtype`` on the device: bfloat16 needs compute
    capability 8.0 (ptxas rejects bf16 conversions for sm_75)."""
    if dtype == torch.bfloat16 and limits.capability < (8, 0):
        raise ValueError(
            f"`{name}` is torch.bfloat16, which the Triton kernels cannot run on {limits.name}: bfloat16 needs "
            f"compute capability 8.0 (Ampere) or newer. Use torch.float16 (load the model with "
            f"torch_dtype=torch.float16, or CacheConfig(dtype='float16')), or attention_backend='torch'."
        )


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A kernel launch shape: ``rows`` per program (decode: BLOCK_G query heads; prefill: BLOCK_M =
    BLOCK_Q tokens x ``heads``), ``block_n`` keys per tile, ``heads`` query heads per program (the
    whole GQA group unless it had to be split), ``num_warps``, ``num_stages``, and ``shared_bytes``,
    the shared-memory estimate it was admitted with."""

    rows: int
    block_n: int
    heads: int
    num_warps: int
    num_stages: int
    shared_bytes: int


def shared_memory_estimate(rows: int, block_n: int, block_d: int, elem_bytes: int, num_stages: int) -> int:
    """Bytes of shared memory a tile needs, an upper bound fitted to Triton 3.9's allocations for these
    kernels (``triton_aot`` reports the real figure): the K and V tiles once per pipeline stage plus
    the query tile (what the pipelined tensor-core and sm_75 paths allocate), or K, V, query and
    score tiles side by side (the unpipelined fp32 path), whichever is larger."""
    kv = 2 * block_n * block_d * elem_bytes
    q = rows * block_d * elem_bytes
    return max(num_stages * kv + q, kv + q + rows * block_n * elem_bytes)


def _tensor_cores(dtype: torch.dtype, limits: DeviceLimits) -> bool:
    """Whether Triton lowers this dtype's ``tl.dot`` to tensor-core instructions (mma/wgmma): fp16 and
    bf16 from sm_80 on. fp32 runs in IEEE precision (never tf32) on FMA units, and on sm_75 Triton
    3.9 emits FMA for fp16 as well (checked in the PTX by ``triton_aot``)."""
    return dtype != torch.float32 and limits.capability >= (8, 0)


def _elem_bytes(dtype: torch.dtype) -> int:
    # fp32 tiles stay fp32; the interpreter's bf16 upcast is not a GPU concern.
    return torch.finfo(dtype).bits // 8


def _first_fitting(candidates, block_d: int, elem_bytes: int, limits: DeviceLimits, what: str) -> TileConfig:
    for rows, block_n, heads, num_warps, num_stages in candidates:
        shared = shared_memory_estimate(rows, block_n, block_d, elem_bytes, num_stages)
        if shared + SHARED_MARGIN <= limits.shared_memory_per_block:
            return TileConfig(rows, block_n, heads, num_warps, num_stages, shared)
    raise ValueError(
        f"no {what} tile fits the {limits.shared_memory_per_block // 1024} KiB of shared memory per block of "
        f"{limits.name}; use attention_backend='torch'"
    )


def _halvings(start: int, stop: int):
    n = start
    while n >= stop:
        yield n
        n //= 2


def decode_tile_config(block_d: int, group: int, dtype: torch.dtype, limits: DeviceLimits) -> TileConfig:
    """Launch shape of the decode kernel for ``group`` query heads per KV head (``block_d``: the head
    size rounded up to a power of two). ValueError when no tile fits the device's shared memory.

    Tensor-core path: 64 keys per tile up to 128-wide rows (32 for 256), up to 8192 / block_d heads
    per program and rows x keys <= 2048. FMA path (fp32; everything on sm_75): at most 2048 /
    block_d keys, 4096 / block_d heads and rows x keys <= 1024 per program, so the score and
    accumulator tiles stay in registers (wider tiles spill, see ``triton_aot``). Then keys per tile,
    pipeline stages and heads per program are halved until the shared-memory estimate fits the
    device. ``tl.dot`` needs at least 16 rows, so BLOCK_G is at least 16.
    """
    if _tensor_cores(dtype, limits):
        max_n, max_heads, score_budget = (64 if block_d <= 128 else 32), min(MAX_GQA_GROUP, 8192 // block_d), 2048
    else:
        max_n, max_heads, score_budget = max(16, min(64, 2048 // block_d)), max(16, 4096 // block_d), 1024
    heads0 = min(group, max_heads)
    candidates = []
    for h in _halvings(heads0, 1):
        rows = max(16, next_power_of_2(h))
        for stages in (2, 1):
            for n in _halvings(max(16, min(max_n, score_budget // rows)), 16):
                candidates.append((rows, n, h, 4, stages))
    return _first_fitting(candidates, block_d, _elem_bytes(dtype), limits, "decode")


def prefill_tile_config(block_d: int, group: int, dtype: torch.dtype, limits: DeviceLimits) -> TileConfig:
    """Launch shape of the prefill kernel for ``group`` query heads per KV head (``block_d``: the head
    size rounded up to a power of two). ValueError when no tile fits the device's shared memory.

    Tensor-core path: the FlashAttention-2 shapes, 128 rows x 64 keys with 8 warps up to 128-wide
    rows, 64 x 32 with 8 warps for 256 (with 4 warps that tile spills). FMA path (fp32; everything
    on sm_75): rows x block_d <= 4096, rows x keys <= 512 and keys x block_d <= 2048 per 4 warps, so
    accumulator and scores stay in registers. A group wider than the rows is split over programs.
    Then keys, stages, heads per program and rows are halved until the shared-memory estimate fits
    the device.
    """
    tensor = _tensor_cores(dtype, limits)

    def warps(rows: int) -> int:
        # 64-row tensor-core tiles at head size 256 spill with 4 warps, not with 8.
        return 8 if rows >= 128 or (tensor and block_d >= 256 and rows >= 64) else 4

    if tensor:
        max_rows, max_n = (128, 64) if block_d <= 128 else (64, 32)
    else:
        max_rows = max(16, min(64, 4096 // block_d))
        max_n = max(16, min(64, 512 // max_rows, 2048 // block_d))
    heads0 = min(group, max_rows)
    candidates = []
    for rows in _halvings(max_rows, 16):
        for h in _halvings(min(heads0, rows), 1):
            for stages in (2, 1):
                for n in _halvings(max_n, 16):
                    candidates.append((max(rows, next_power_of_2(h)), n, h, warps(rows), stages))
    return _first_fitting(candidates, block_d, _elem_bytes(dtype), limits, "prefill")
