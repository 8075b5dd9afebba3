"""Weight-only int8 by dequantizing tiles and multiplying in float (:class:`DequantFloatGEMM`): the
int8 kernel of many-row (prefill) calls, where the weight-streaming kernels of ``int8_gemm`` fall
behind."""

from __future__ import annotations

import threading
from typing import Optional

import torch

from .gemm_kernel import PackedWeight
from .int8_weights import Int8Kernel, int8_parts, is_plain_tensor, is_torchao_int8_weight_only, logical_dtype


def _panel_columns(data: torch.Tensor) -> torch.Tensor:
    """A view ``[panels, 4, nr / 4, in]`` of :class:`NativeInt8GEMM`'s packed int8 panels
    ``[panels, in, nr]`` in output-column order: ``int8_gemm.c`` stores column ``v * nr/4 + i`` of a
    panel in byte ``4 * i + v`` (byte ``v`` of 32-bit lane ``i``, unpacked by shifts)."""
    panels, k, nr = data.shape
    return data.view(panels, k, nr // 4, 4).permute(0, 3, 2, 1)


class DequantFloatGEMM(Int8Kernel):
    """Weight-only int8 by dequantizing and multiplying in float: for each tile of ``tile_columns``
    output columns, ``Wt = (Wq[tile] * s[tile])`` in ``x``'s dtype (float32 product, then rounded:
    the very weight :func:`reference_weight` gives) written into a scratch buffer reused across
    calls, then ``y[:, tile] = x @ Wt.T (+ b[tile])`` by torch's float GEMM (``torch.mm`` /
    ``torch.addmm`` into the output's column slice). The same numbers as
    ``F.linear(x, Wq * s, b)`` up to the GEMM's summation order. Tiling keeps the float copy bounded
    (``tile_columns * in_features`` values per thread, not a whole float weight) and small enough to
    stay in cache between its dequantization and its GEMM. It costs ``out * in`` dequantized values a
    call whatever the row count, so it pays at many rows (prefill) and loses to
    :class:`NativeInt8GEMM` at few; ``autotune`` picks per row bucket.

    Packed: ``data`` the int8 weight ``[out, in]`` row-major, ``scales`` float32 ``[out]``; or, when
    it serves beside :class:`NativeInt8GEMM` (``autotune`` gave each its row buckets), that kernel's
    own packed copy, ``[ceil(out/nr), in, nr]`` panels, read in place (:meth:`adopt`): one int8 copy
    of the weight, not two (the point of int8 is also the memory).

    Args:
        tile_bytes: float32 bytes of one dequantized tile; ``tile_columns`` is this over
            ``4 * in_features``, rounded down to a multiple of 16 and kept within ``[64, 1024]``
            (fewer columns would make each GEMM call too thin to run at float speed).
    """

    name = "dequant-float"
    isa = "torch"
    dtypes = (torch.float32, torch.bfloat16)
    always_timed = True
    """For ``autotune``: time it at every row bucket, even after it lost far at the small ones (it
    pays the whole weight's dequantization at one row, and wins only from many rows on; its cost is
    a float GEMM plus that, so the timing stays cheap)."""

    def __init__(self, tile_bytes: int = 2 * 2**20) -> None:
        if tile_bytes <= 0:
            raise ValueError(f"tile_bytes must be positive, got {tile_bytes}")
        self.tile_bytes = tile_bytes
        self.build_id = f"tile{tile_bytes}"  # timings hold for one tile size (the tuner's cache key)
        # Scratch per thread (an engine's scheduler thread and a tuning or test thread may share
        # this object): {(in_features, dtype): buffer}.
        self._local = threading.local()

    def tile_columns(self, in_features: int) -> int:
        """Output columns dequantized per GEMM call for ``in_features`` inputs."""
        cols = self.tile_bytes // (4 * max(1, in_features)) // 16 * 16
        return max(64, min(1024, cols))

    def supports(self, weight: torch.Tensor) -> bool:
        """float32 or bfloat16 2-D CPU weights, plain or torchao int8 weight-only."""
        if weight.device.type != "cpu" or weight.dim() != 2 or logical_dtype(weight) not in self.dtypes:
            return False
        return is_plain_tensor(weight) or is_torchao_int8_weight_only(weight)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """The int8 weight (row-major) and float32 scales. RuntimeError for a weight
        :meth:`supports` rejects."""
        if not self.supports(weight):
            raise RuntimeError(
                f"dequant-float cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}"
            )
        q, s = int8_parts(weight)
        return PackedWeight(q.contiguous(), tuple(weight.shape), logical_dtype(weight), scales=s.contiguous())

    def adopt(self, packed: PackedWeight) -> Optional[PackedWeight]:
        """This kernel's packed copy reading ``packed``'s int8 values in place, when ``packed`` is a
        float32 :class:`NativeInt8GEMM` copy (panels ``[ceil(out/nr), in, nr]``, float32 scales
        ``[out]``), else None. The scales are zero-padded to whole panels (a few bytes); the int8
        data is the same tensor (``PackedWeight.nbytes`` of a dispatching copy counts it once)."""
        data, scales = packed.data, packed.scales
        if not isinstance(data, torch.Tensor) or data.dtype != torch.int8 or data.dim() != 3 or scales is None:
            return None
        n, k = packed.shape
        panels, nr = data.shape[0], data.shape[2]
        if packed.dtype != torch.float32 or data.shape[1] != k or not nr or panels != -(-n // nr):
            return None
        if scales.dtype != torch.float32 or tuple(scales.shape) != (n,):
            return None
        padded = torch.zeros(panels * nr, dtype=torch.float32)
        padded[:n] = scales
        return PackedWeight(data, (n, k), torch.float32, scales=padded)

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` (the packed dtype, CPU) → ``[..., out_features]``. RuntimeError when
        ``x`` or ``bias`` does not fit."""
        self.check_call(x, packed, bias, out_features)
        return self.linear_verified(x, packed, None if bias is None else bias.detach(), out_features)

    def _scratch(self, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """This thread's ``(float32 tile, tile in dtype or None for float32)``, ``[tile_columns, k]``."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        # Buffers made inside an engine step are inference tensors, which a forward outside
        # inference mode (a user's own call, the quality report) may not write: one set per mode.
        key = (k, dtype, torch.is_inference_mode_enabled())
        if key not in buffers:
            cols = self.tile_columns(k)
            f32 = torch.empty((cols, k), dtype=torch.float32)
            buffers[key] = (f32, None if dtype == torch.float32 else torch.empty((cols, k), dtype=dtype))
        return buffers[key]

    def linear_verified(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        n, k = packed.shape
        x2 = x.reshape(-1, k)
        y = x.new_empty((x2.shape[0], out_features))
        if not x2.shape[0]:
            return y.reshape(*x.shape[:-1], out_features)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        panels = packed.data.dim() == 3  # a NativeInt8GEMM copy, adopted: [ceil(n/nr), k, nr]
        if torch.compiler.is_compiling():  # no scratch mutation in a graph: the whole weight at once
            q = _panel_columns(packed.data).reshape(-1, k) if panels else packed.data
            w = (q.float() * packed.scales[:, None])[:n].to(x.dtype)
            return torch.nn.functional.linear(x, w, bias)
        f32, low = self._scratch(k, x.dtype)
        nr = packed.data.shape[2] if panels else 1
        cols = max(nr, f32.shape[0] // nr * nr)  # whole panels per tile
        for j0 in range(0, n, cols):
            j1 = min(n, j0 + cols)
            if panels:  # whole panels (the last one's padding columns have scale 0), then cut
                p0, p1 = j0 // nr, -(-j1 // nr)
                src = _panel_columns(packed.data[p0:p1])  # [panels, 4, nr / 4, k]
                w32 = f32[: (p1 - p0) * nr]
                torch.mul(src, packed.scales[p0 * nr : p1 * nr].view(src.shape[:3] + (1,)), out=w32.view(src.shape))
                w32 = w32[: j1 - j0]
            else:
                w32 = f32[: j1 - j0]
                torch.mul(packed.data[j0:j1], packed.scales[j0:j1, None], out=w32)
            w = w32 if low is None else low[: j1 - j0].copy_(w32)
            if bias is None:
                torch.mm(x2, w.t(), out=y[:, j0:j1])
            else:
                torch.addmm(bias[j0:j1], x2, w.t(), out=y[:, j0:j1])
        return y.reshape(*x.shape[:-1], out_features)
