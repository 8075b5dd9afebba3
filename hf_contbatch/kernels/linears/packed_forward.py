"""The instance ``forward`` of one packed ``nn.Linear`` (see :mod:`hf_contbatch.kernels.linears`).

A packed forward runs its kernel's GEMM over the packed copy of the module's weight, repacking first
when the weight changed since packing (:func:`weight_key`), and ``F.linear`` for whatever it was not
packed for (another dtype or device, autograd). Inside ``PackedLinears.verified_step`` its calls
skip the weight checks made once at the step's start. A member of a fused group
(:class:`~hf_contbatch.kernels.linears.fused.FusedGroup`) hands its call to the group.

Released weights: where the kernel gives a weight back bit for bit (``GemmKernel.exact_unpack``) and
the weight belongs to this module alone (not tied to an embedding), the Parameter's storage is
replaced by a placeholder (:func:`placeholder_like`: the weight's shape and dtype over one NaN, so
a stray read shows NaN rather than plausible numbers, and in-place writes other than ``fill_``/``zero_``
raise torch's own error), and the packed copy alone holds the values. :meth:`PackedForward.disable`
(``PackedLinears.restore``) puts the exact weight back; so does any call that needs the float
weight (``F.linear`` for autograd or another dtype), after which the module keeps it. A weight given
new storage while packed (``.data = ...``) is repacked and released again; ``fill_``/``zero_`` on
the placeholder are followed too (the version counter).
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


def module_tensor(module: torch.nn.Module, name: str):
    """``module.<name>`` (its weight or bias) without ``nn.Module.__getattr__`` (about a
    microsecond; the per-step checks read dozens) where that is what it returns: a plain
    ``nn.Linear``'s registered parameter; anything else by attribute lookup."""
    params = module._parameters
    if type(module) is torch.nn.Linear and name in params and name not in module.__dict__:
        return params[name]
    return getattr(module, name)


def placeholder_like(weight: torch.Tensor) -> torch.Tensor:
    """A tensor of ``weight``'s shape, dtype and device holding one element (NaN), all strides 0."""
    return torch.full((), float("nan"), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def is_placeholder(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a :func:`placeholder_like` (or a fill of one): every stride 0."""
    return weight.numel() > 1 and all(st == 0 for st in weight.stride())


def release_weight(weight: torch.nn.Parameter) -> None:
    """Drop ``weight``'s storage for a :func:`placeholder_like` (the packed copy holds the values)."""
    weight.data = placeholder_like(weight)


def watch_loads(module: torch.nn.Module, put_back) -> None:
    """Have ``module.load_state_dict`` call ``put_back()`` first (once registered per module): it
    copies into the weight in place, which a released placeholder refuses. The load then bumps the
    version, so the new values are repacked (and released again) before their next use."""
    if "_hf_contbatch_load_hook" not in module.__dict__:
        handle = module.register_load_state_dict_pre_hook(_PutBackFirst(put_back))
        module.__dict__["_hf_contbatch_load_hook"] = handle


class _PutBackFirst:
    """A load_state_dict pre-hook calling ``put_back()`` (a class, not a closure: models pickle)."""

    def __init__(self, put_back) -> None:
        self.put_back = put_back

    def __call__(self, *args) -> None:
        self.put_back()


def unwatch_loads(module: torch.nn.Module) -> None:
    handle = module.__dict__.pop("_hf_contbatch_load_hook", None)
    if handle is not None:
        handle.remove()


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
        # (bias key, the bias, its step bias) of the last verify: the bias converted again only
        # when it changed (the bias is held so that its id() in the key cannot be reused).
        self._step_bias: Optional[tuple] = None
        self.weight_ref = None
        # Whether this module's float weight may be released while packed (PackedLinears sets it
        # where the weight is not shared), and whether it is now.
        self.releasable = False
        self.released = False
        self.released_key: Optional[tuple] = None
        self.restore_from_packed = False  # a deepcopy/pickle: its weight is a copy of the placeholder
        if pack:  # not for a member of a fused group about to be formed: the group packs for all
            self._pack()

    def _pack(self) -> None:
        weight = self.module.weight
        self._put_back()
        check_packable(weight, self.kernel)
        key = weight_key(weight)  # before reading: a write during the reorder repacks next call
        with torch.no_grad():
            self.packed = self.kernel.pack(weight.detach())
        # weight_ref keeps the packed weight alive, so its id() in the key cannot be reused.
        self.weight_ref, self.weight_key, self.dtype = weight, key, weight.dtype
        self.release()

    def release(self) -> None:
        """Release the float weight where allowed (see the module docstring); the key follows."""
        if self.releasable and self.kernel.exact_unpack and self.packed is not None and not self.released:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, also when repacked in a step
                release_weight(self.module.weight)
            watch_loads(self.module, self._put_back)
            self.released, self.weight_key = True, weight_key(self.module.weight)
            self.released_key = self.weight_key

    def _put_back(self) -> None:
        """Make the module's weight hold real values again: the exact weight from the packed copy
        where it was released (or this is a deepcopy of a released one), the uniform values of a
        ``fill_``/``zero_`` on the placeholder; anything else is the user's own and stays."""
        weight = self.module.weight
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, also when repacked in a step
            if self.restore_from_packed and self.packed is not None:
                weight.data = self.kernel.unpack(self.packed)
            elif is_placeholder(weight):
                if self.released and self.packed is not None and self.released_key == weight_key(weight):
                    weight.data = self.kernel.unpack(self.packed)
                    if self.weight_key == self.released_key:  # the packed copy still matches it
                        self.weight_key = weight_key(weight)
                else:
                    weight.data = weight.data.contiguous()
        self.restore_from_packed = self.released = False

    def materialize(self) -> None:
        """Put the exact float weight back where it was released, and keep it from now on (a
        member of a fused group: its group's weights, which the group's copy holds)."""
        if self.group is not None:
            self.group.materialize()
            return
        self.releasable = False
        self._put_back()

    def disable(self) -> None:
        """Plain ``F.linear`` from now on, the float weight put back where it was released, and the
        packed copy freed (for references that outlive :meth:`PackedLinears.restore`, e.g. a
        wrapper installed on top of this forward)."""
        self.materialize()
        unwatch_loads(self.module)
        self.active, self.packed, self.weight_ref, self.weight_key = False, None, None, None
        self.verified_thread = self.verified_bias = self._step_bias = None
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
            # A released weight lives only in the packed copy: the copy takes it along (our GEMM's
            # panels are a plain tensor) and puts it back into its own module on first use.
            "packed": self.packed if self.released else None,
            "releasable": self.releasable,
            "released": False,
            "released_key": None,
            "restore_from_packed": self.released,
            "group": self.group,
            "group_index": self.group_index,
            "verified_thread": None,
            "verified_bias": None,
            "_step_bias": None,
        }

    def _f_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear`` over the module's float weight (put back first where it was released)."""
        self.materialize()
        return torch.nn.functional.linear(x, self.module.weight, self.module.bias)

    def repack_if_changed(self) -> None:
        """Repack when the module's weight changed since packing (follow its current weights). If
        that fails (out of memory; a copy unpickled where our GEMM cannot be built), this module
        runs ``F.linear`` from then on, with one warning."""
        if self.weight_key != weight_key(module_tensor(self.module, "weight")):
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
        module = self.module
        weight, bias = module_tensor(module, "weight"), module_tensor(module, "bias")
        if not self.active or weight.dtype != self.dtype or not weight.is_cpu:
            return False
        if bias is None:
            self.verified_bias = None
            return True
        if bias.dtype != self.dtype or not bias.is_cpu or bias.shape != weight.shape[:1]:
            return False
        key = (weight_key(bias), self.kernel)
        cached = self._step_bias
        if cached is None or cached[0] != key:
            cached = self._step_bias = (key, bias, self.kernel.step_bias(bias))
        self.verified_bias = cached[2]
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
            return self._f_linear(x)
        if self.group is not None:
            return self.group(self, x)
        if not torch.compiler.is_compiling():  # id() and versions are not traceable: see refresh()
            self.repack_if_changed()
            if not self.active:
                return torch.nn.functional.linear(x, self.module.weight, bias)
        return self.kernel.linear(x, self.packed, self.kernel.step_bias(bias), weight.shape[0])
