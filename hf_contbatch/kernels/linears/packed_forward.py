"""The instance ``forward`` of one packed ``nn.Linear`` (see :mod:`hf_contbatch.kernels.linears`).

A packed forward runs its kernel's GEMM over the packed copy of the module's weight, repacking first
when the weight changed since packing (:func:`weight_key`), and ``F.linear`` for whatever it was not
packed for (another dtype or device, autograd). Inside ``PackedLinears.verified_step`` its calls
skip the weight checks made once at the step's start. A member of a fused group
(:class:`~hf_contbatch.kernels.linears.fused.FusedGroup`) hands its call to the group.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def weight_key(weight: torch.Tensor) -> tuple:
    """What identifies the packed values: in-place writes bump the version, ``.data = ...`` and
    ``.to(...)`` change the storage, assigning a new Parameter changes the identity."""
    return (id(weight), weight.data_ptr(), weight._version, weight.dtype)


def check_packable(weight: torch.Tensor, kernel) -> None:
    """Raise RuntimeError unless ``kernel`` packs ``weight`` (float32 CPU weights for every kernel;
    bfloat16 ones where the kernel has a bf16 path: ``kernel.supports``)."""
    if not kernel.supports(weight):
        raise RuntimeError(f"{kernel.name} cannot pack a {weight.dtype} weight on {weight.device}")


class PackedForward:
    """The instance ``forward`` of one packed ``nn.Linear``: input ``[..., in_features]`` →
    ``[..., out_features]``, in the weight's dtype (float32, or bfloat16 where the kernel packs it)."""

    def __init__(self, module: torch.nn.Linear, kernel, pack: bool = True) -> None:
        self.module = module
        self.kernel = kernel  # NativeGEMM or OneDNNGEMM (or a DispatchGEMM choosing between them by rows)
        self.dtype = module.weight.dtype  # what it is packed for: inputs of another dtype run F.linear
        self.active = True
        self.weight_key: Optional[tuple] = None
        self.packed: Optional[torch.Tensor] = None
        self.group = None  # a fused.FusedGroup computing this output with its siblings
        self.group_index = 0  # this module's place in its group (0: the leader, which runs the GEMM)
        # Set by PackedLinears.verified_step for its duration: the thread whose calls may skip the
        # per-call checks, and the step's bias (detached, dense).
        self.verified_thread: Optional[int] = None
        self.verified_bias: Optional[torch.Tensor] = None
        self.weight_ref = None
        if pack:  # not for a member of a fused group about to be formed: the group packs for all
            self._pack()

    def _pack(self) -> None:
        weight = self.module.weight
        check_packable(weight, self.kernel)
        key = weight_key(weight)  # before reading: a write during the reorder repacks next call
        with torch.no_grad():
            self.packed = self.kernel.pack(weight.detach())
        # weight_ref keeps the packed weight alive, so its id() in the key cannot be reused.
        self.weight_ref, self.weight_key, self.dtype = weight, key, weight.dtype

    def disable(self) -> None:
        """Plain ``F.linear`` from now on, and the packed copy freed (for references that outlive
        :meth:`PackedLinears.restore`, e.g. a wrapper installed on top of this forward)."""
        self.active, self.packed, self.weight_ref, self.weight_key = False, None, None, None
        self.verified_thread = self.verified_bias = None
        if self.group is not None:
            self.group.release()
            self.group = None

    def __getstate__(self) -> dict:
        # A deepcopy or pickle of the model carries no opaque oneDNN tensor: the copy packs its
        # own weights on first use.
        return {
            "module": self.module,
            "kernel": self.kernel,
            "dtype": self.dtype,
            "active": self.active,
            "weight_ref": None,
            "weight_key": None,
            "packed": None,
            "group": self.group,
            "group_index": self.group_index,
            "verified_thread": None,
            "verified_bias": None,
        }

    def repack_if_changed(self) -> None:
        """Repack when the module's weight changed since packing (follow its current weights). If
        that fails (out of memory; a copy unpickled where our GEMM cannot be built), this module
        runs ``F.linear`` from then on, with one warning."""
        if self.weight_key != weight_key(self.module.weight):
            try:
                self._pack()
            except RuntimeError as exc:
                logger.warning("repacking %s failed (%s); it runs F.linear from now on", self.module, exc)
                self.disable()

    def verify(self) -> bool:
        """Whether this module's calls may skip their checks until the end of the step: active
        (packed, or its group's fused weight, for the current weights: :meth:`PackedLinears.refresh`
        ran just before), CPU weight and bias of the packed dtype. Sets the step's bias. Called by
        :meth:`PackedLinears.verified_step`."""
        weight, bias = self.module.weight, self.module.bias
        if not self.active or weight.dtype != self.dtype or not weight.is_cpu:
            return False
        if bias is not None and (bias.dtype != self.dtype or not bias.is_cpu or bias.shape != weight.shape[:1]):
            return False
        self.verified_bias = self.kernel.step_bias(bias)
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        verified = self.verified_thread
        if (
            verified is not None
            and verified == threading.get_ident()
            and x.dtype == self.dtype
            and x.is_cpu
            and x.dim()
            and x.shape[-1] == self.module.in_features
        ):
            # Inside a verified step (weights checked and repacked once at its start): only the
            # input is checked, which saves most of a call's Python time (a step makes dozens).
            if self.group is not None:
                return self.group(self, x, verified=True)
            return self.kernel.linear_verified(x, self.packed, self.verified_bias, self.module.out_features)
        weight, bias = self.module.weight, self.module.bias
        if (
            not self.active
            or x.dtype != self.dtype
            or weight.dtype != self.dtype
            or x.device.type != "cpu"
            or weight.device.type != "cpu"
            or x.dim() == 0
            or x.shape[-1] != weight.shape[1]
            or bias is not None
            and (bias.dtype != self.dtype or bias.device.type != "cpu" or bias.shape != weight.shape[:1])
            or torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or bias is not None and bias.requires_grad)
        ):
            # Outside what we packed for (F.linear raises torch's own error for a bad size), or autograd.
            return torch.nn.functional.linear(x, weight, bias)
        if self.group is not None:
            return self.group(self, x)
        if not torch.compiler.is_compiling():  # id() and versions are not traceable: see refresh()
            self.repack_if_changed()
            if not self.active:
                return torch.nn.functional.linear(x, weight, bias)
        return self.kernel.linear(x, self.packed, self.kernel.step_bias(bias), weight.shape[0])
