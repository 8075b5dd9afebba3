"""Int8 weights: the weight-only quantization scheme, a torchao int8 weight's own parts, and what
every int8 kernel shares (:class:`Int8Kernel`).

Scheme (torchao's int8 weight-only one, ``Int8WeightOnlyConfig``): symmetric, one scale per output
channel, ``s = absmax(W[j, :]) / 127``, ``Wq = round(W / s)`` clamped to ``[-127, 127]``; the layer
computes ``x @ (Wq * s).T + b``. A model that torchao quantized already
(``transformers.TorchAoConfig(Int8WeightOnlyConfig())``: the weight is a
``torchao.quantization.Int8Tensor`` with per-row blocks and no activation quantization) is repacked
exactly from its own ``qdata`` and ``scale`` (:func:`int8_parts`). The kernels are in ``int8_gemm``
(and ``dequant_gemm``, ``w8a8_torch``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .gemm_kernel import PackedWeight

QMAX = 127
"""The largest magnitude of a quantized weight (symmetric: the range is ``[-127, 127]``)."""


def is_torchao_int8_weight_only(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a torchao ``Int8Tensor`` in int8 weight-only form: int8 ``qdata``
    ``[out, in]``, one scale per output row (``block_size == [1, in]``) and no activation
    quantization (``Int8DynamicActivationInt8WeightConfig`` sets ``act_quant_kwargs``)."""
    if type(weight).__name__ != "Int8Tensor" or not type(weight).__module__.startswith("torchao"):
        return False
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if not isinstance(qdata, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return False
    return (
        qdata.dtype == torch.int8
        and qdata.dim() == 2
        and list(getattr(weight, "block_size", [])) == [1, qdata.shape[1]]
        and scale.numel() == qdata.shape[0]
        and getattr(weight, "act_quant_kwargs", None) is None
    )


def is_plain_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ordinary dense tensor (or Parameter), not a tensor subclass such as a
    quantized weight whose storage is not float data."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and type(t.data) is torch.Tensor and t.layout == torch.strided


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq, s)`` for a float ``[out, in]`` weight: ``s = absmax(row) / 127`` (float32, rounded to
    ``scale_dtype`` and used as rounded), ``Wq = round(W / s).clamp(-127, 127)`` int8. A row of
    zeros gets ``s = 1`` (its ``Wq`` is zeros either way)."""
    w = weight.detach().float()
    s = w.abs().amax(dim=1) / QMAX
    s = torch.where(s > 0, s, torch.ones_like(s)).to(scale_dtype).float()
    q = torch.round(w / s[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, s


def int8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq int8 [out, in], s float32 [out])`` of a weight: a torchao int8 weight-only tensor's own
    values (exact), else :func:`quantize_int8` of the float weight (scales rounded to the weight's
    dtype, so a bfloat16 kernel's scales are the ones used)."""
    if is_torchao_int8_weight_only(weight):
        return weight.qdata.contiguous(), weight.scale.reshape(-1).float()
    if not is_plain_tensor(weight) or not weight.is_floating_point():
        raise RuntimeError(f"cannot quantize a {type(weight).__name__} {weight.dtype} weight to int8")
    return quantize_int8(weight, weight.dtype)


def reference_weight(weight: torch.Tensor) -> torch.Tensor:
    """The float weight an int8 kernel multiplies by, ``Wq * s`` in ``weight``'s dtype: what a
    packed int8 linear is probed against."""
    q, s = int8_parts(weight)
    return (q.float() * s[:, None]).to(weight.dtype)


def logical_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``weight`` computes in (a torchao ``Int8Tensor`` reports the one it dequantizes to)."""
    return weight.dtype  # a torchao Int8Tensor reports the dtype it dequantizes to


def check_bias(name: str, bias: Optional[torch.Tensor], out_features: int) -> None:
    """RuntimeError naming kernel ``name`` unless ``bias`` is None or a float CPU ``[out_features]``."""
    if bias is not None and (
        not bias.is_floating_point() or bias.device.type != "cpu" or tuple(bias.shape) != (out_features,)
    ):
        raise RuntimeError(
            f"{name} linear: bias {tuple(bias.shape)} {bias.dtype} on {bias.device} does not fit {out_features} CPU outputs"
        )


class Int8Kernel:
    """What every int8 weight-only kernel here shares: the packed int8 weight and its scales are the
    only copy (``unpack`` gives no float weight back: ``close()`` restores the model's own), the
    reference weight is the dequantized one, and the bias is passed as it is."""

    exact_unpack = False  # int8 values: the float weight cannot be given back
    reference_weight = staticmethod(reference_weight)

    def unpack(self, packed: PackedWeight) -> None:
        return None

    def check_call(self, x: torch.Tensor, packed: PackedWeight, bias, out_features: int) -> None:
        """RuntimeError naming the kernel when ``x`` (``[..., in]``, the packed dtype, CPU) or
        ``bias`` (``[out_features]``) does not fit ``packed``."""
        n, k = packed.shape
        if x.device.type != "cpu" or x.dtype != packed.dtype or not x.dim() or x.shape[-1] != k or n != out_features:
            raise RuntimeError(
                f"{self.name} linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit a packed "
                f"{packed.dtype} int8 weight of {k} inputs and {n} outputs"
            )
        check_bias(self.name, bias, out_features)

    @staticmethod
    def step_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if bias is None else bias.detach()
