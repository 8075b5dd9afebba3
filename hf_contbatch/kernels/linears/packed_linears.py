"""The packed linears of one model (:class:`PackedLinears`) and :func:`pack_linears`, which installs them.

Packing happens before anything is installed and is probed against ``F.linear``, so a failure
(no C compiler, no oneDNN, out of memory, a disagreeing kernel) leaves the model untouched.
``linear_backend="auto"`` chooses each shape's kernel by timing them on this CPU (``autotune``),
chooses again without a kernel that fails, and packs only when the packed copy takes at most a
quarter of the available host memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Collection, Optional

import torch

from .autotune import DispatchGEMM, KernelTuner
from .fused import form_group, sibling_groups
from .native_gemm import NativeGEMM
from .onednn_gemm import OneDNNGEMM, onednn_available
from .packed_forward import PackedForward

logger = logging.getLogger(__name__)


class PackedLinears:
    """The packed ``nn.Linear`` modules of one model; :meth:`restore` puts their forwards back.
    ``backend`` names the kernels in use ("native", "onednn", or both joined by "+"); ``tuner`` holds
    the per-shape choices of ``linear_backend="auto"`` (None otherwise)."""

    def __init__(
        self, forwards: list[PackedForward], packed_bytes: int, backend: str, tuner: Optional[KernelTuner] = None
    ) -> None:
        self.forwards = forwards
        self.packed_bytes = packed_bytes
        self.backend = backend
        self.tuner = tuner

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


PACKED_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes whose linears are packed (bfloat16 where a kernel has a bf16 path)."""


def _eligible(m: torch.nn.Module) -> bool:
    return (
        type(m) is torch.nn.Linear  # subclasses (quantized, LoRA, ...) have their own forward
        and "forward" not in m.__dict__  # accelerate's hooks and other wrappers live here
        and not getattr(m, "_hf_hook", None)
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and m.weight.device.type == "cpu"
        and m.weight.dtype in PACKED_DTYPES
        and m.weight.numel() > 0
    )


def _make_kernel(name: str):
    """The kernel ``name`` ("native" or "onednn"); RuntimeError when it is unavailable here."""
    if name == "native":
        return NativeGEMM()
    if not onednn_available():
        raise RuntimeError("linear_backend='onednn' needs a torch build with oneDNN (torch.backends.mkldnn)")
    return OneDNNGEMM()


def available_kernels() -> dict:
    """The packed kernels that work here by name: "native" (where a C compiler builds it) and
    "onednn" (where torch has the oneDNN ops); the candidates of ``linear_backend="auto"``."""
    kernels = {}
    for name in ("native", "onednn"):
        try:
            kernels[name] = _make_kernel(name)
        except RuntimeError as exc:
            logger.info("packed linears: %s unavailable (%s)", name, exc)
    return kernels


def _probe(forward: PackedForward) -> None:
    """Raise RuntimeError unless ``forward`` (packed, installed or not) agrees with ``F.linear``."""
    m = forward.module
    x = torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(0)).to(m.weight.dtype)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, m.weight, m.bias).float()
        got = forward(x).float()
    tol = 1e-4 if m.weight.dtype == torch.float32 else 2e-2  # bf16: rounded once, either way
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()) + 1e-6):
        raise RuntimeError(
            f"{forward.kernel.name} linear disagrees with F.linear by {float((got - want).abs().max()):.3g}"
        )


def _units(model, modules: list[torch.nn.Linear], fuse: bool) -> list[list[torch.nn.Linear]]:
    """The GEMM units: each fused sibling group as one unit, every other module alone."""
    groups = sibling_groups(model, modules) if fuse else []
    grouped = {id(m) for g in groups for m in g}
    return groups + [[m] for m in modules if id(m) not in grouped]


def _shape(unit: list[torch.nn.Linear]) -> tuple[int, int, torch.dtype]:
    return unit[0].in_features, sum(m.out_features for m in unit), unit[0].weight.dtype


class KernelFailed(RuntimeError):
    """Packing with ``kernel`` failed (it cannot pack a weight, ran out of memory, or disagrees with
    ``F.linear``); the cause is ``__cause__``."""

    def __init__(self, kernel, cause: BaseException) -> None:
        super().__init__(f"{kernel.name}: {cause}")
        self.kernel = kernel


def _pack_units(units, kernel_of) -> list[PackedForward]:
    """Pack every unit with ``kernel_of(unit)`` (None: left to F.linear), nothing installed yet;
    each kernel probed once against ``F.linear``. Raises :class:`KernelFailed` when packing fails or
    a kernel disagrees (fused groups that cannot be packed run their members on their own)."""
    forwards, probed = [], set()
    for unit in units:
        kernel = kernel_of(unit)
        if kernel is None:
            continue
        try:
            if len(unit) == 1:
                members = [PackedForward(unit[0], kernel)]
            else:
                members = [PackedForward(m, kernel, pack=False) for m in unit]
                if form_group(members, kernel) is None:
                    members = [PackedForward(m, kernel) for m in unit]
            if kernel.name not in probed:
                _probe(members[0])
                probed.add(kernel.name)
        except RuntimeError as exc:  # kernel errors and out-of-memory surface as RuntimeError
            raise KernelFailed(kernel, exc) from exc
        forwards += members
    return forwards


def pack_linears(
    model: torch.nn.Module,
    mode: str,
    available_bytes: Optional[Callable[[], Optional[int]]] = None,
    exclude: Collection[torch.nn.Module] = (),
    *,
    fuse: bool = False,
    max_rows: int = 1024,
    max_head_rows: Optional[int] = None,
    tuner: Optional[KernelTuner] = None,
) -> Optional[PackedLinears]:
    """Pack the model's float32 (and, where a kernel has a bf16 path, bfloat16) CPU ``nn.Linear``
    weights for a faster GEMM, or do nothing.

    Args:
        model: the model (modified only through instance attributes; see the package docstring).
        mode: ``"torch"`` (do nothing), ``"native"`` (our GEMM, :class:`NativeGEMM`), ``"onednn"``
            (oneDNN's; both raise if impossible) or ``"auto"``: the kernel of each shape class chosen
            by timing the available ones on this CPU (:mod:`~hf_contbatch.kernels.linears.autotune`;
            a shape ``F.linear`` wins is not packed), only when the packed copy takes at most a
            quarter of the available host memory. A probe output must match ``F.linear`` before
            anything is installed.
        available_bytes: returns the available host memory in bytes (None when unknown).
        exclude: modules left as they are (LoRA's A and B matrices, which ``kernels.lora`` reads).
        fuse: fuse sibling projections (q/k/v, gate/up) into one GEMM while packing
            (:mod:`~hf_contbatch.kernels.linears.fused`); with "auto" their fused shape is the one tuned.
        max_rows: the most rows a call has (the token budget): the row buckets "auto" times.
        max_head_rows: the most rows the model's output embedding (LM head) sees, when fewer.
        tuner: the :class:`KernelTuner` for "auto" (default: one over the kernels available here,
            its timings cached on disk per CPU).

    Returns:
        The packed modules (``backend`` names the kernels used, e.g. "native" or "native+onednn";
        ``tuner`` holds the "auto" choices), or None when nothing was packed.

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
    avail = available_bytes() if available_bytes is not None else None
    if mode == "auto" and avail is not None and total > avail // 4:
        logger.info(
            "not packing %d linear layers: %.1f GiB is over a quarter of the available memory "
            "(set linear_backend='native' or 'onednn' to force)",
            len(modules),
            total / 2**30,
        )
        return None
    units = _units(model, modules, fuse)
    if mode != "auto":
        kernel = _make_kernel(mode)
        forwards = _pack_units(units, lambda unit: kernel if kernel.supports(unit[0].weight) else None)
        return _install(forwards, total, None)
    if tuner is None:
        tuner = KernelTuner(available_kernels())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    dual = [avail is None or 2 * total <= avail // 4]  # a second packed copy per shape fits

    def kernel_of(unit):
        rows = max_head_rows if unit[0] is head and max_head_rows else max_rows
        return tuner.kernel(tuner.choose(*_shape(unit), max_rows=rows, allow_dual=dual[0], packed_only=len(unit) > 1))

    # A kernel that fails is left out and everything chosen again without it (two kernels for a
    # shape: one each from then on).
    while True:
        try:
            forwards = _pack_units(units, kernel_of)
        except KernelFailed as exc:
            if isinstance(exc.kernel, DispatchGEMM):
                dual[0] = False
            else:
                tuner.candidates.pop(exc.kernel.name, None)
            logger.info("packed linears: %s; choosing again without it", exc)
            if len(tuner.candidates) == 1:  # only F.linear is left
                logger.warning("packed linears unavailable (%s); using F.linear", exc)
                return None
            continue
        logger.info("%s", tuner.report())
        return _install(forwards, total, tuner)


def _install(forwards: list[PackedForward], total: int, tuner: Optional[KernelTuner]) -> Optional[PackedLinears]:
    if not forwards:
        return None
    for f in forwards:
        f.module.__dict__["forward"] = f
    names = sorted({n for f in forwards for n in (f.group.kernel if f.group else f.kernel).name.split("+")})
    return PackedLinears(forwards, total, "+".join(names), tuner)
