"""oneDNN's inner product over weights reordered once into its blocked layout, rows padded.

The ops are those inductor's CPU weight-freezing pass emits (``torch.ops.mkldnn._reorder_linear_weight``
and ``_linear_pointwise``). Why the rows are padded to a bounded set of sizes (:func:`padded_rows`):
oneDNN builds and keeps a primitive (JIT code) for every input shape it sees, and a serving engine
sees every row count from 1 to ``max_num_batched_tokens``, so unpadded the process grows without
bound. Padded, a model holds at most ``distinct (in, out) pairs x 64`` primitives up to 1024 rows,
and steps of more than 16 rows compute at most 12.5% padding rows (``benchmarks/bench_linear_padding.py``
measures what padding costs).
"""

from __future__ import annotations

from typing import Optional

import torch

from .gemm_kernel import PackedWeight
from .linear_op import register_linear_op


def padded_rows(m: int) -> int:
    """The row count a ``m``-row input is padded to: ``m`` itself up to 16 (decode steps of a few
    sequences pay nothing), then eight sizes per octave (18, 20, ..., 32, 36, ..., 64, 72, ...), so
    at most 1/8 of the rows are padding and row counts up to ``2**k`` use ``16 + 8 * (k - 4)``
    distinct shapes (64 up to 1024). Why not coarser: at these sizes oneDNN's time grows with the
    rows, so padding costs its share."""
    if m <= 16:
        return max(m, 1)
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops."""
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - attribute lookup raises if missing
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return torch.backends.mkldnn.is_available()


def padded_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int
) -> torch.Tensor:
    """``x @ W.T + b`` through the packed weight (the ``data`` of :meth:`OneDNNGEMM.pack`), rows padded to
    :func:`padded_rows`. Input ``[..., in]`` of the weight's dtype, output ``[..., out]``; oneDNN
    raises RuntimeError on a mismatch."""
    if torch.compiler.is_compiling():
        # Opaque to torch.compile: inductor cannot lower oneDNN's packed layout, and the padding
        # keeps oneDNN's primitives bounded there too.
        return torch.ops.hf_contbatch.onednn_linear(x, packed, None, None, bias, out_features)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    rows = padded_rows(m)
    if rows != m:
        padded = x2.new_zeros(rows, k)
        padded[:m] = x2
        x2 = padded
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # oneDNN reads a strided bias as if it were dense (wrong sums)
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y[:m].reshape(*lead, out_features)


class OneDNNGEMM:
    """oneDNN's inner product over its blocked weight layout, rows padded (:func:`padded_rows`);
    float32 weights, and bfloat16 ones where oneDNN has bf16 kernels for this CPU.

    Raises:
        RuntimeError: on construction, when this torch build has no oneDNN packed-linear ops.
    """

    name = "onednn"
    exact_unpack = False  # an opaque blocked layout: the float weight is kept beside it
    isa = "onednn"
    build_id = ""  # part of torch: its version is in the tuner's cache key already

    def __init__(self) -> None:
        if not onednn_available():
            raise RuntimeError("linear_backend='onednn' needs a torch build with oneDNN (torch.backends.mkldnn)")

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """float32, and bfloat16 where oneDNN has bf16 kernels for this CPU."""
        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)

    def supports(self, weight: torch.Tensor) -> bool:
        """Whether oneDNN packs ``weight``: a 2-D CPU float32 weight, or bfloat16 where supported."""
        if weight.device.type != "cpu" or weight.dim() != 2:
            return False
        if weight.dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return weight.dtype == torch.float32

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """``[out, in]`` weight → oneDNN's blocked copy (an opaque tensor of the weight's dtype).
        Raises RuntimeError for a weight it does not pack (:meth:`supports`)."""
        if not self.supports(weight):
            raise RuntimeError(f"oneDNN cannot pack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}")
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight), tuple(weight.shape), weight.dtype)

    def unpack(self, packed: PackedWeight) -> None:
        """None: oneDNN's blocked layout is opaque, so the float weight is kept beside it."""
        return None

    def linear(self, x, packed: PackedWeight, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` (the weight's dtype) → ``[..., out_features]`` through ``packed``
        (from :meth:`pack`), plus ``bias`` ``[out_features]`` (the same dtype) if given; oneDNN
        raises RuntimeError on a mismatch."""
        return padded_linear(x, packed.data, bias, out_features)

    linear_verified = linear

    @staticmethod
    def step_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The bias as :meth:`linear_verified` takes it: dense (oneDNN reads a strided one wrong)."""
        return None if bias is None else bias.detach().contiguous()


def _onednn_op(x, packed, scales, zero_points, bias, out_features: int) -> torch.Tensor:
    return padded_linear(x, packed, bias, out_features)  # a float layout: no scales


register_linear_op("onednn_linear", _onednn_op)
