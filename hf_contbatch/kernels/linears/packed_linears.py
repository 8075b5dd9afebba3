"""The packed linears of one model (:class:`PackedLinears`) and :func:`pack_linears`, which installs them.

Packing happens before anything is installed and is probed against ``F.linear``, so a failure
(no C compiler, no oneDNN, out of memory, a disagreeing kernel) leaves the model untouched;
``linear_backend="auto"`` then falls back from our GEMM to oneDNN's to ``F.linear``, and packs only
when the packed copy takes at most a quarter of the available host memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Collection, Optional

import torch

from .native_gemm import NativeGEMM
from .onednn_gemm import OneDNNGEMM, onednn_available
from .packed_forward import PackedForward

logger = logging.getLogger(__name__)


class PackedLinears:
    """The packed ``nn.Linear`` modules of one model; :meth:`restore` puts their forwards back.
    ``backend`` names the kernel: "native" (ours) or "onednn"."""

    def __init__(self, forwards: list[PackedForward], packed_bytes: int, backend: str) -> None:
        self.forwards = forwards
        self.packed_bytes = packed_bytes
        self.backend = backend

    @property
    def modules(self) -> list[torch.nn.Linear]:
        """The ``nn.Linear`` modules that run packed (empty after :meth:`restore`)."""
        return [f.module for f in self.forwards]

    def __len__(self) -> int:
        return len(self.forwards)

    def refresh(self) -> None:
        """Repack every weight changed since it was packed. A compiled forward cannot check the
        weights' versions inside its graph, so it calls this before each step instead."""
        for f in self.forwards:
            if f.group is not None:
                if f is f.group.members[0]:
                    f.group.repack_if_changed()
            elif f.active:
                f.repack_if_changed()

    @contextlib.contextmanager
    def verified_step(self):
        """For the duration of the ``with`` block, calls from this thread skip the per-call checks
        of the weights: every changed weight is repacked on entry (:meth:`refresh`) and each
        module's weight and bias checked once. Inputs are still checked per call; a weight changed
        inside the block is only seen at the next step. Modules that fail the check (or any when
        autograd is on) keep the checked path. Not for compiled forwards (they call
        :meth:`refresh` themselves)."""
        self.refresh()
        thread = threading.get_ident()
        marked = []
        try:
            if not torch.is_grad_enabled():  # with autograd on, every call keeps its checks
                seen_groups = set()
                for f in self.forwards:
                    group = f.group
                    if group is None:
                        members = [f] if f.verify() else []
                    elif id(group) in seen_groups:
                        continue
                    else:  # a group runs unchecked only when its fused weight and every member pass
                        seen_groups.add(id(group))
                        ok = group.packed is not None and all([m.verify() for m in group.members])
                        members = group.members if ok else []
                    for m in members:
                        m.verified_thread = thread
                        marked.append(m)
            yield
        finally:
            for f in marked:
                f.verified_thread = None
            for f in self.forwards:
                f.verified_bias = None

    def repack(self) -> None:
        """Repack every weight now, changed or not: after writes the version counter does not see
        (through ``.data``, e.g. ``lin.weight.data.mul_(2)``)."""
        for f in self.forwards:
            if f.group is not None:
                f.group.keys = None  # never equal to the current keys: repacked below
            elif f.active:
                f.weight_key = None
        self.refresh()

    def restore(self) -> None:
        """Remove the instance forwards this object installed and free the packed copies
        (idempotent). A forward someone wrapped meanwhile stays wrapped but runs ``F.linear``."""
        for f in self.forwards:
            f.disable()
            m = f.module
            if m.__dict__.get("forward") is f:
                del m.__dict__["forward"]
        self.forwards = []


def _eligible(m: torch.nn.Module) -> bool:
    return (
        type(m) is torch.nn.Linear  # subclasses (quantized, LoRA, ...) have their own forward
        and "forward" not in m.__dict__  # accelerate's hooks and other wrappers live here
        and not getattr(m, "_hf_hook", None)
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        and m.weight.numel() > 0
    )


def _make_kernel(name: str):
    if name == "native":
        return NativeGEMM()
    if not onednn_available():
        raise RuntimeError("linear_backend='onednn' needs a torch build with oneDNN (torch.backends.mkldnn)")
    return OneDNNGEMM()


def _pack_all(modules: list[torch.nn.Linear], name: str) -> list[PackedForward]:
    """Pack every module with kernel ``name`` (nothing installed yet), after a probe against
    ``F.linear``. Raises RuntimeError when the kernel is unavailable or disagrees."""
    kernel = _make_kernel(name)
    forwards = [PackedForward(m, kernel) for m in modules]
    probe = forwards[0]
    x = torch.randn(3, probe.module.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.nn.functional.linear(x, probe.module.weight, probe.module.bias)
        got = probe(x)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-6):
        raise RuntimeError(f"{name} linear disagrees with F.linear by {float((got - want).abs().max()):.3g}")
    return forwards


def pack_linears(
    model: torch.nn.Module,
    mode: str,
    available_bytes: Optional[Callable[[], Optional[int]]] = None,
    exclude: Collection[torch.nn.Module] = (),
) -> Optional[PackedLinears]:
    """Pack the model's float32 CPU ``nn.Linear`` weights for a faster GEMM, or do nothing.

    Args:
        model: the model (modified only through instance attributes; see the module docstring).
        mode: ``"torch"`` (do nothing), ``"native"`` (our GEMM, :class:`NativeGEMM`), ``"onednn"``
            (oneDNN's; both raise if impossible) or ``"auto"`` (ours where it builds, else oneDNN,
            else nothing; only when the packed copy takes at most a quarter of the available host
            memory). A probe output must match ``F.linear`` before anything is installed.
        available_bytes: returns the available host memory in bytes (None when unknown).
        exclude: modules left as they are (LoRA's A and B matrices, which ``kernels.lora`` reads).

    Returns:
        The packed modules (``backend`` names the kernel), or None when nothing was packed.

    Raises:
        RuntimeError: ``mode="native"`` without a working C compiler, ``mode="onednn"`` on a torch
            without the oneDNN ops, or the probe disagrees (not for ``"auto"``, which falls back).
    """
    if mode == "torch":
        return None
    skip = {id(m) for m in exclude}
    modules = [m for m in model.modules() if _eligible(m) and id(m) not in skip]
    if not modules:
        return None
    total = sum(m.weight.numel() * m.weight.element_size() for m in modules)
    if mode == "auto" and available_bytes is not None:
        avail = available_bytes()
        if avail is not None and total > avail // 4:
            logger.info(
                "not packing %d linear layers: %.1f GiB is over a quarter of the available memory "
                "(set linear_backend='native' or 'onednn' to force)",
                len(modules),
                total / 2**30,
            )
            return None
    errors = []
    for name in ("native", "onednn") if mode == "auto" else (mode,):
        try:
            # Pack every module before installing any: a failure leaves the model untouched.
            forwards = _pack_all(modules, name)
        except RuntimeError as exc:  # kernel errors and out-of-memory surface as RuntimeError
            if mode != "auto":
                raise
            errors.append(f"{name}: {exc}")
            logger.info("packed linears: %s unavailable (%s)", name, exc)
            continue
        for f in forwards:
            f.module.__dict__["forward"] = f
        return PackedLinears(forwards, total, name)
    logger.warning("packed linears unavailable (%s); using F.linear", "; ".join(errors))
    return None
