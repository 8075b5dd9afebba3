"""Host side of the Triton attention kernels: device checks, the device's limits, the launch
arguments the decode and the prefill launcher share (:func:`_prepare_attention`), the backend
questions (:func:`prefers_torch`, :func:`unsupported_reason`) and the KV store launcher
:func:`store_kv`.

Kernel launchers find ``_check_device``, ``_device_limits`` and ``_is_interpreted`` as this module's
globals: ``triton_aot`` replaces them here to record launches for a device that is not present.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from .triton_checks import check_attention_args, check_store_args, unsupported_shape_reason
from .triton_common import TRITON_AVAILABLE
from .triton_tiles import (
    DeviceLimits,
    TileConfig,
    arch_limits,
    check_device_dtype,
    next_power_of_2,
    prefill_tile_config,
)

if TRITON_AVAILABLE:
    from .triton_common import _store_kv_kernel


def _is_interpreted() -> bool:
    """True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_store_kv_kernel).__name__ == "InterpretedFunction"


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            "hf_contbatch.kernels.attention.triton_kernels needs the `triton` package, which is not installed; "
            "use the plain-torch attention path instead."
        )


def _check_device(tensors: dict) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(
            "all tensors must be on one device, got "
            + ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        )
    device = devices.pop()
    if device.type != "cuda" and not _is_interpreted():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got tensors on {device}); on CPU set TRITON_INTERPRET=1 "
            "before importing hf_contbatch.kernels.attention.triton_kernels, or use the plain-torch attention path"
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 must not silently drop to tf32; and Triton's interpreter multiplies bf16 operands of
    # tl.dot as raw uint16 bit patterns, so under the interpreter bf16 tiles are upcast first.
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _is_interpreted())


@dataclasses.dataclass(frozen=True)
class _AttentionLaunch:
    """What both attention launchers derive from their checked arguments: the tile, the tensor the
    kernel writes (``out``, or a stand-in contiguous in head_dim that :meth:`finish` copies back),
    and ``kernel_args``, the keyword arguments the decode and the prefill kernel share."""

    tile: TileConfig
    out: torch.Tensor
    target: torch.Tensor
    kernel_args: dict

    def finish(self) -> torch.Tensor:
        if self.target is not self.out:
            self.out.copy_(self.target)
        return self.out


def _prepare_attention(
    tile_config,
    query_shape: str,
    check_kind: Callable[[], None],
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    sliding_window,
    softcap,
    out,
    k_scale=None,
    v_scale=None,
    **index_tensors,
) -> tuple[torch.Tensor, Optional[_AttentionLaunch]]:
    """Everything the decode and the prefill launcher do alike before their launch: the argument
    checks (:func:`check_attention_args`, ``query`` of shape ``query_shape``, then ``check_kind``,
    the launcher's own checks, which may rely on the common ones), the device checks, the output
    tensor and the launch arguments. Returns ``(out, launch)``; launch is None for an empty batch
    (nothing to run).

    ``tile_config``: ``decode_tile_config`` or ``prefill_tile_config``; ``k_scale``/``v_scale``: the
    scales of an int8 cache (None for a float one); ``index_tensors``: the launcher's other index
    tensors, checked to be on the query's device.

    Raises:
        ValueError: a shape, dtype, device or scalar argument the kernels do not take (named).
        RuntimeError: triton is not installed.
    """
    _require_triton()
    check_attention_args(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        sliding_window,
        softcap,
        out,
        query_shape,
        k_scale,
        v_scale,
    )
    check_kind()
    tensors = {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    if k_scale is not None:
        tensors.update(k_scale=k_scale, v_scale=v_scale)
    _check_device({**tensors, "seq_lens": seq_lens, **index_tensors})
    limits = _device_limits(query.device)
    check_device_dtype(query.dtype, limits, "query")
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out, None
    query = _last_dim_contiguous(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    block_d = next_power_of_2(head_dim)
    tile = tile_config(block_d, num_heads // num_kv_heads, query.dtype, limits)
    if k_scale is not None and tile_config is prefill_tile_config and tile.block_n > 32 and tile.rows >= 128:
        # The int8 tile's conversions and scale vectors cost registers: 128 x 64 tiles spilled on
        # sm_80 (triton_aot); 128 x 32 keeps them in registers.
        tile = dataclasses.replace(tile, block_n=32)
    target = out if out.stride(-1) == 1 else torch.empty_like(query)
    kernel_args = dict(
        out_ptr=target,
        query_ptr=query,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        # A float cache passes its own pools as the (unread) scale pointers.
        k_scale_ptr=k_cache if k_scale is None else k_scale,
        v_scale_ptr=v_cache if v_scale is None else v_scale,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        q_strides=query.stride()[:2],
        o_strides=target.stride()[:2],
        k_strides=k_cache.stride(),
        v_strides=v_cache.stride(),
        s_strides=(k_cache.stride()[:3] if k_scale is None else k_scale.stride()[:3]),
        stride_bt=block_tables.stride(0),
        qk_scale=float(scale),
        softcap=float(softcap or 0.0),
        sliding_window=int(sliding_window or 0),
        GROUP=num_heads // num_kv_heads,
        HEADS=tile.heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=tile.block_n,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None,
        DOT_FP32=_dot_in_fp32(query.dtype),
        QUANT=k_scale is not None,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out, _AttentionLaunch(tile, out, target, kernel_args)


@functools.cache
def _cuda_limits(device_index: int) -> DeviceLimits:
    props = torch.cuda.get_device_properties(device_index)
    return DeviceLimits(
        f"{props.name} (sm_{props.major}{props.minor})",
        (props.major, props.minor),
        int(props.shared_memory_per_block_optin),
    )


def _device_limits(device: torch.device) -> DeviceLimits:
    """Limits of ``device``; under the interpreter (CPU tensors) those of sm_80, whose tiles the CPU
    tests then exercise (tests substitute other archs' limits to run their tiles)."""
    if device.type == "cuda":
        return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())
    return arch_limits(80)


def prefers_torch(device: torch.device) -> bool:
    """Whether ``attention_backend="auto"`` takes the torch path on ``device``: on CUDA devices below
    compute capability 8.0 (T4, RTX 20xx).

    Why (from the compiled code and the data sheets): Triton 3.9 lowers ``tl.dot`` for sm_75 to FMA
    instructions (no ``mma`` in the PTX ``triton_aot`` compiles), while the torch path (SDPA's
    memory-efficient kernel, cuBLAS) runs on the fp16 tensor cores, several times the FMA
    throughput: compute-bound prefill is much faster there. Memory-bound decode gains little from
    the kernels, since ``tl.dot`` pads a KV head's query heads to 16 rows, which reaches the FMA
    limit. ``attention_backend="triton"`` still runs the kernels there (tiles sized to fit 64 KiB).
    """
    return device.type == "cuda" and _device_limits(device).capability < (8, 0)


def unsupported_reason(
    device: torch.device,
    dtype: Optional[torch.dtype] = None,
    head_dim: Optional[int] = None,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    block_size: Optional[int] = None,
) -> Optional[str]:
    """Why the kernels cannot serve a cache of this shape on ``device`` (None when they can).

    Arguments left None are not checked. Covers dtype (and bfloat16 below sm_80), head size, block
    size, GQA group, and whether decode and prefill tiles fit the device's shared memory.
    """
    if not TRITON_AVAILABLE:
        return "triton is not installed"
    return unsupported_shape_reason(_device_limits(device), dtype, head_dim, num_heads, num_kv_heads, block_size)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Write this step's keys and values into their cache slots, in place.

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, fp16/bf16/fp32; cast to the cache dtype.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 (or int32) ``[T]``; token ``t`` goes to block ``slot // block_size``,
            row ``slot % block_size``. A negative slot marks a padding token and is skipped.
        k_scale, v_scale: for int8 caches, contiguous float32 ``[num_blocks, block_size,
            num_kv_heads, 1]``: each token-head row is quantized (``kv_quant``'s scheme: scale =
            absmax / 127, rounded half away from zero) and its scale written here.
    """
    _require_triton()
    check_store_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens = key.shape[0]
    tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    if k_scale is not None:
        if not (k_scale.is_contiguous() and v_scale.is_contiguous()):
            raise ValueError("`k_scale` and `v_scale` must be contiguous")
        tensors.update(k_scale=k_scale, v_scale=v_scale)
    _check_device(tensors)
    limits = _device_limits(k_cache.device)
    checked = (("key", key.dtype), ("value", value.dtype)) + ((("k_cache", k_cache.dtype),) if k_scale is None else ())
    for name, dtype in checked:
        check_device_dtype(dtype, limits, name)
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    strides = key.stride()[:2] + value.stride()[:2] + k_cache.stride()[:3] + v_cache.stride()[:3]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,
        *strides,
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1],
        QUANT=k_scale is not None,
    )
