"""Kernel timing as its own step: :func:`tune_linears` chooses a kernel per GEMM unit of a model
(``linear_backend="auto"``) before anything is packed, and :func:`~hf_contbatch.kernels.linears.packed_linears.pack_linears`
packs by those choices. The timings are cached on disk (``autotune.KernelTuner``), so a tuning run
before the engine (``hf-contbatch generate``) makes the engine's own a cache read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Collection, Optional

import torch

from ...config import QuantScheme
from ..model_layout import ModelLayout
from .autotune import KernelChoice, KernelTuner, shape_key
from .gemm_kernel import GemmKernel
from .linear_units import Unit, fits_auto, linear_units, packable_modules, unit_shape, weight_bytes
from .registry import available_kernels, available_quantized_kernels

logger = logging.getLogger(__name__)


@dataclass
class LinearChoices:
    """The kernel chosen for each GEMM unit of one model.

    Attributes:
        tuner: the tuner that chose (it is asked again when a chosen kernel fails to pack).
        units: the GEMM units (a fused sibling group or one module each), in packing order.
        rows: per unit, the most rows its calls have (the LM head's may be fewer).
        allow_dual: whether a second kernel's packed copy per shape fits in memory.
        by_unit: per unit index, its :class:`~hf_contbatch.kernels.linears.autotune.KernelChoice`.
        packed_only: ``F.linear`` is no candidate for any unit (int8 weights: the float weight
            would give other numbers); else it may serve a fused unit's buckets it wins beside a
            packed kernel (``KernelTuner.choose``'s ``unpacked_partner``).
    """

    tuner: KernelTuner
    units: list[Unit]
    rows: list[int]
    allow_dual: bool
    by_unit: dict[int, KernelChoice] = field(default_factory=dict)
    packed_only: bool = False

    def choose(self) -> None:
        """(Re)choose every unit with the tuner's current candidates (timings from its cache)."""
        self.by_unit = {
            i: self.tuner.choose(
                *unit_shape(u),
                max_rows=r,
                allow_dual=self.allow_dual,
                packed_only=self.packed_only or len(u) > 1,
                unpacked_partner=not self.packed_only,
            )
            for i, (u, r) in enumerate(zip(self.units, self.rows))
        }

    def kernel_of(self, index: int) -> Optional[GemmKernel]:
        """The kernel object serving unit ``index`` (None: ``F.linear``, left unpacked)."""
        return self.tuner.kernel(self.by_unit[index])

    @property
    def measured_seconds(self) -> float:
        """Wall time spent timing kernels (0 when every timing came from the cache)."""
        return self.tuner.measured_seconds

    def summary(self) -> dict[str, str]:
        """``{"960x5120:float32": "native", ...}``: the kernel label per shape class."""
        return {shape_key(*unit_shape(u)): self.by_unit[i].label for i, u in enumerate(self.units)}

    def report(self) -> str:
        """The tuner's report: the choice per shape class with each kernel's measured ms per call."""
        return self.tuner.report()


def tune_linears(
    model: torch.nn.Module,
    tuner: Optional[KernelTuner] = None,
    *,
    available_bytes: Optional[Callable[[], Optional[int]]] = None,
    exclude: Collection[torch.nn.Module] = (),
    fuse: bool = True,
    max_rows: int = 1024,
    max_head_rows: Optional[int] = None,
    quantization: Optional[QuantScheme] = None,
    layout: Optional[ModelLayout] = None,
) -> Optional[LinearChoices]:
    """Choose the GEMM kernel of every unit of ``model``'s packable linears by timing the kernels
    available here (the ``linear_backend="auto"`` step before packing; no module is changed).

    Args:
        model: the model whose ``nn.Linear`` shapes are tuned.
        tuner: default: a :class:`KernelTuner` over ``registry.available_kernels()``, timings cached
            on disk per CPU.
        available_bytes: returns the available host memory in bytes (None when unknown).
        exclude, fuse, max_rows, max_head_rows, quantization: as
            :func:`~hf_contbatch.kernels.linears.pack_linears`. With a ``quantization`` the
            candidates are its kernels (``registry.quantized_kernels``; default tuner), ``F.linear``
            is none, and the linears are packed whatever the memory (the int8 copy is a quarter of
            float32's).
        layout: the model's walk (``kernels.model_layout``; default: walked here).

    Returns:
        The choices, or None when "auto" packs nothing here (no packable linear, or one packed copy
        would take more than a quarter of the available memory).
    """
    layout = layout or ModelLayout.of(model)
    modules = packable_modules(model, exclude, quantization, layout)
    if not modules:
        return None
    total = weight_bytes(modules)
    pack, dual = fits_auto(total, available_bytes)
    if quantization is not None:  # an int8 copy is one byte a weight (a second kernel's: one more)
        pack, dual = True, fits_auto(sum(m.weight.numel() for m in modules), available_bytes)[1]
    if not pack:
        logger.info(
            "not packing %d linear layers: %.1f GiB is over a quarter of the available memory "
            "(set linear_backend='native' or 'onednn' to force)",
            len(modules),
            total / 2**30,
        )
        return None
    units = linear_units(model, modules, fuse, layout)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows = [max_head_rows if u[0] is head and max_head_rows else max_rows for u in units]
    if tuner is None:
        tuner = KernelTuner(
            available_quantized_kernels(quantization) if quantization is not None else available_kernels()
        )
    choices = LinearChoices(tuner, units, rows, dual, packed_only=quantization is not None)
    choices.choose()
    return choices
