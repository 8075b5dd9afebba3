"""The packed linears of one model (:class:`PackedLinears`) and :func:`pack_linears`, which installs them.

Packing happens before anything is installed and is probed against ``F.linear``, so a failure
(no C compiler, no oneDNN, out of memory, a disagreeing kernel) leaves the model untouched.
``linear_backend="auto"`` packs by the choices of :func:`~hf_contbatch.kernels.linears.linear_choices.tune_linears`
(each shape's kernel timed on this CPU, ``autotune``; run as a step of its own or from here),
chooses again without a kernel that fails, and packs only when the packed copy takes at most a
quarter of the available host memory.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Callable, Collection, Optional

import torch

from ...config import QuantScheme
from ..model_layout import ModelLayout
from .autotune import KernelTuner
from .dispatch_gemm import DispatchGEMM
from .fused import form_group
from .gemm_kernel import GemmKernel
from .linear_choices import LinearChoices, tune_linears
from .linear_units import linear_units, packable_modules, weight_bytes
from .packed_forward import PackedForward
from .registry import AUTO, UNPACKED, forced_quantized_kernel, make_kernel

logger = logging.getLogger(__name__)


class PackedLinears:
    """The packed ``nn.Linear`` modules of one model; :meth:`restore` puts their forwards back.

    Attributes:
        forwards: the installed packed forwards.
        packed_bytes: bytes of the float weights packed (what one packed copy costs).
        kernel_names: the registry names of the kernels in use, sorted (("native",), ("native", "onednn")).
        choices: the per-unit choices of ``linear_backend="auto"`` (None otherwise).
        scheme: the :class:`~hf_contbatch.config.QuantScheme` packed (None: float).
        quantization: the weights' format as served, for reports (``scheme.label``): None
            (float), "int8" (weight-only int8; also for a torchao int8 weight-only model's linears)
            or "w8a8" (int8 weights and dynamic int8 activations).
    """

    def __init__(
        self,
        forwards: list[PackedForward],
        packed_bytes: int,
        kernel_names: tuple[str, ...],
        choices: Optional[LinearChoices] = None,
        scheme: Optional[QuantScheme] = None,
    ) -> None:
        self.forwards = forwards
        self.packed_bytes = packed_bytes
        self.kernel_names = kernel_names
        self.choices = choices
        self.scheme = scheme
        self.quantization = None if scheme is None else scheme.label

    def merged(self, other: Optional["PackedLinears"]) -> "PackedLinears":
        """One collection of this and ``other``'s forwards (a float pass and an int8 pass over
        different modules of one model); ``choices`` and ``scheme`` from the one that has them."""
        if other is None:
            return self
        return PackedLinears(
            self.forwards + other.forwards,
            self.packed_bytes + other.packed_bytes,
            tuple(sorted({*self.kernel_names, *other.kernel_names})),
            self.choices or other.choices,
            self.scheme or other.scheme,
        )

    @property
    def label(self) -> str:
        """The kernels in use, for reports: "native", "native+onednn"."""
        return "+".join(self.kernel_names)

    @property
    def modules(self) -> list[torch.nn.Linear]:
        """The ``nn.Linear`` modules that run packed (empty after :meth:`restore`)."""
        return [f.module for f in self.forwards]

    def __len__(self) -> int:
        return len(self.forwards)

    def refresh(self) -> None:
        """Repack every weight changed since it was packed. A compiled forward cannot check the
        weights' versions inside its graph, so it calls this before each step instead."""
        # Repacked tensors are ordinary tensors, as at packing time, even when called inside the
        # step's inference mode: a compiled graph guards on its inputs' dispatch keys, and a bias
        # repacked as an inference tensor recompiled every graph of the model after a weight change.
        with torch.inference_mode(False):
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


def _probe(forward: PackedForward) -> None:
    """Raise RuntimeError unless ``forward`` (packed, installed or not) agrees with ``F.linear``."""
    m = forward.module
    x = torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(0)).to(m.weight.dtype)
    reference = getattr(forward.kernel, "reference_weight", None)  # a quantized kernel: its dequantized weight
    with torch.no_grad():
        weight = m.weight if reference is None else reference(m.weight)
        want = torch.nn.functional.linear(x, weight, m.bias).float()
        got = forward(x).float()
    tol = 1e-4 if m.weight.dtype == torch.float32 else 2e-2  # bf16: rounded once, either way
    # A kernel that rounds the activations too (int8_gemm.W8A8GEMM) names its own, wider tolerance.
    tol = max(
        [tol, *(getattr(k, "probe_tolerance", 0.0) for k in getattr(forward.kernel, "kernels", [forward.kernel]))]
    )
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()) + 1e-6):
        raise RuntimeError(
            f"{forward.kernel.name} linear disagrees with F.linear by {float((got - want).abs().max()):.3g}"
        )


class KernelFailed(RuntimeError):
    """Packing with ``kernel`` failed (it cannot pack a weight, ran out of memory, or disagrees with
    ``F.linear``); the cause is ``__cause__``."""

    def __init__(self, kernel: GemmKernel, cause: BaseException) -> None:
        super().__init__(f"{kernel.name}: {cause}")
        self.kernel = kernel


def _pack_units(units, kernel_of: Callable[[int], Optional[GemmKernel]]) -> list[PackedForward]:
    """Pack every unit with ``kernel_of(unit index)`` (None: left to F.linear), nothing installed
    yet; each kernel probed once against ``F.linear``. Raises :class:`KernelFailed` when packing
    fails or a kernel disagrees (fused groups that cannot be packed run their members on their own)."""
    forwards, probed = [], set()
    for index, unit in enumerate(units):
        kernel = kernel_of(index)
        if kernel is None:
            continue
        try:
            if len(unit) == 1:
                members = [PackedForward(unit[0], kernel)]
            else:
                members = [PackedForward(m, kernel, pack=False) for m in unit]
                if form_group(members, kernel) is None:
                    members = [PackedForward(m, kernel) for m in unit]
            names = getattr(kernel, "names", (kernel.name,))  # a DispatchGEMM: its kernels together
            if names not in probed:
                _probe(members[0])
                probed.add(names)
        except RuntimeError as exc:  # kernel errors and out-of-memory surface as RuntimeError
            for f in forwards:
                f.disable()
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
    choices: Optional[LinearChoices] = None,
    release_weights: bool = False,
    quantization: Optional[QuantScheme] = None,
    layout: Optional[ModelLayout] = None,
) -> Optional[PackedLinears]:
    """Pack the model's float32 (and, where a kernel has a bf16 path, bfloat16) CPU ``nn.Linear``
    weights for a faster GEMM, or do nothing.

    Args:
        model: the model (modified only through instance attributes; see the package docstring).
        mode: a ``linear_backend`` name (``config.LINEAR_BACKENDS``): ``"torch"`` (do nothing), a
            packed kernel's registry name (``"native"``, ``"onednn"``: raise if impossible) or
            ``"auto"``: the kernel of each shape class chosen by timing the available ones on this
            CPU (``choices`` from :func:`~hf_contbatch.kernels.linears.linear_choices.tune_linears`,
            run here when not given; a shape ``F.linear`` wins is not packed), only when the packed
            copy takes at most a quarter of the available host memory. A probe output must match
            ``F.linear`` before anything is installed.
        available_bytes: returns the available host memory in bytes (None when unknown).
        exclude: modules left as they are (LoRA's A and B matrices, which ``kernels.lora`` reads).
        fuse: fuse sibling projections (q/k/v, gate/up) into one GEMM while packing
            (:mod:`~hf_contbatch.kernels.linears.fused`); with "auto" their fused shape is the one tuned.
        max_rows: the most rows a call has (the token budget): the row buckets "auto" times.
        max_head_rows: the most rows the model's output embedding (LM head) sees, when fewer.
        tuner: the ``KernelTuner`` for "auto" when ``choices`` is not given (default: one over the
            kernels available here, its timings cached on disk per CPU).
        choices: the "auto" choices made beforehand (same model, ``exclude`` and ``fuse``).
        release_weights: drop each float weight the packed copy gives back bit for bit (not shared
            with another module) until :meth:`PackedLinears.restore` (see ``packed_forward``). Off by
            default: while released, a weight cannot be read, written through ``.data`` or converted
            with ``module.to(dtype)``.
        quantization: None (float kernels over the plain float linears; a linear whose weight is
            a tensor subclass is left to its own ``F.linear``), or a
            :class:`~hf_contbatch.config.QuantScheme`: the kernels of its weight and activation
            dtypes (``registry.QUANTIZED_KERNELS``; a forced ``mode`` "native"/"torch" names
            ours/torch's). Weight-only int8 ("int8"): every float linear and every torchao int8
            weight-only one served by a weight-only int8 kernel
            (:mod:`~hf_contbatch.kernels.linears.int8_gemm`); int8 activations too ("w8a8"): the
            same linears with their inputs quantized to int8 per row (``int8_gemm.W8A8GEMM``,
            ``w8a8_torch.TorchW8A8GEMM``); without ``quantize_float_weights``
            (``config.TORCHAO_INT8``): only the torchao int8 weight-only ones, repacked exactly.
            Always packed (never left to ``F.linear``), whatever the memory.
        layout: the model's walk (``kernels.model_layout``; default: walked here).

    Returns:
        The packed modules (``kernel_names`` names the kernels used; ``choices`` holds the "auto"
        choices), or None when nothing was packed.

    Raises:
        RuntimeError: a named kernel that cannot run here (no working C compiler for "native", no
            oneDNN ops for "onednn"), or the probe disagrees (not for ``"auto"``, which falls back).
    """
    if mode == UNPACKED and quantization is None:
        return None
    if mode != AUTO:
        if quantization is not None:
            mode = forced_quantized_kernel(quantization, mode)
        kernel = make_kernel(mode)
        layout = layout or ModelLayout.of(model)
        modules = packable_modules(model, exclude, quantization, layout)
        units = linear_units(model, modules, fuse, layout)
        forwards = _pack_units(units, lambda i: kernel if kernel.supports(units[i][0].weight) else None)
        return _install(model, forwards, weight_bytes(modules), None, release_weights, quantization)
    if choices is None:
        choices = tune_linears(
            model,
            tuner,
            available_bytes=available_bytes,
            exclude=exclude,
            fuse=fuse,
            max_rows=max_rows,
            max_head_rows=max_head_rows,
            quantization=quantization,
            layout=layout,
        )
        if choices is None:
            return None
    # A kernel that fails is left out and everything chosen again without it (two kernels for a
    # shape: one each from then on).
    candidates = choices.tuner.candidates
    while True:
        try:
            forwards = _pack_units(choices.units, choices.kernel_of)
        except KernelFailed as exc:
            if isinstance(exc.kernel, DispatchGEMM):
                choices.allow_dual = False
            else:
                candidates.pop(exc.kernel.name, None)
            logger.info("packed linears: %s; choosing again without it", exc)
            if len(candidates) == 1:  # only F.linear is left
                if quantization is not None:
                    raise RuntimeError(f"no int8 kernel can serve this model here: {exc}") from exc
                logger.warning("packed linears unavailable (%s); using F.linear", exc)
                return None
            choices.choose()
            continue
        logger.info("%s", choices.report())
        total = weight_bytes([m for u in choices.units for m in u])
        return _install(model, forwards, total, choices, release_weights, quantization)


def _install(
    model: torch.nn.Module,
    forwards: list[PackedForward],
    total: int,
    choices: Optional[LinearChoices],
    release: bool,
    quantization: Optional[QuantScheme] = None,
) -> Optional[PackedLinears]:
    """Install the packed forwards and, with ``release``, release the float weights the packed
    copies give back exactly, except weights shared with another module (an LM head tied to the
    input embedding: the embedding still reads it)."""
    if not forwards:
        return None
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for f in forwards:
        f.module.__dict__["forward"] = f
        f.releasable = release and uses[id(f.module.weight)] == 1
    for f in forwards:
        if f.group is None:
            f.release()
        elif f is f.group.members[0]:
            f.group.release_weights()
    kernels = {f.group.kernel if f.group else f.kernel for f in forwards}
    names = sorted({n for k in kernels for n in getattr(k, "names", (k.name,))})
    return PackedLinears(forwards, total, tuple(names), choices, quantization)
