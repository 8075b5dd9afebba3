"""Float weights spilled to disk while their int8 copies serve (``EngineConfig(quantization="int8")``).

Why: weight-only int8 packs a quantized copy of every linear's float weight; keeping the float
weight too (so that ``close()`` can restore the model exactly) costs the float model plus the int8
copy, about 125% of the float model. A :class:`WeightSpill` writes the float weights of the int8
linears to a safetensors file in a private temporary directory (mode 0700, removed by
:meth:`WeightSpill.restore`), frees them, and puts them back bit for bit on restore: the same
``nn.Parameter`` objects, dtype, ``requires_grad`` and values.

While spilled, each such module's ``weight`` is a :class:`SpilledWeight`: a Parameter of the
weight's shape, dtype and device that holds no data (one element, strides 0). Its metadata answers
(``shape``, ``dtype``, ``device``, ``numel()``, ``requires_grad``...: what the engine's packed
forwards and transformers' ``model.device`` read); anything that would read or convert its values
(arithmetic, ``F.linear``, ``.detach()`` and so ``model.state_dict()``/``save_pretrained``,
``.to(...)``/``model.half()``, ``.data``, ``.tolist()``, pickling) raises :class:`SpilledWeightError`,
which names the module and says to close the engine first. A user never reads placeholder values
as if they were weights.

Not spilled: weights shared with another module (an LM head tied to the input embedding: the
embedding reads it), weights that are already a tensor subclass (a torchao model's int8 weights).
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
from typing import Optional

import torch

from ..model_layout import ModelLayout

# Tensor attributes (properties) and methods a SpilledWeight answers: metadata only, never values.
_METADATA = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "is_cpu",
        "is_cuda",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_mkldnn",
        "is_nested",
        "layout",
        "ndim",
        "requires_grad",
        "_version",
        "grad",
        "grad_fn",
        "is_leaf",
        "itemsize",
        "nbytes",
        "names",
        "size",
        "dim",
        "numel",
        "stride",
        "data_ptr",
        "element_size",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "untyped_storage",
        "__hash__",
        "__len__",
    }
)


class SpilledWeightError(RuntimeError):
    """A spilled float weight was read or converted while an engine serves its int8 copy."""


class SpilledWeight(torch.nn.Parameter):
    """A stand-in for a float weight spilled to disk (see the module docstring): the weight's shape,
    dtype, device and ``requires_grad`` over one element of storage (strides 0); every operation on
    its values raises :class:`SpilledWeightError` naming ``name``."""

    name: str = "?"

    @staticmethod
    def make(weight: torch.Tensor, name: str) -> "SpilledWeight":
        base = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
        out = torch.Tensor._make_subclass(SpilledWeight, base, weight.requires_grad)
        out.name = name
        return out

    def error(self, what: str) -> SpilledWeightError:
        return SpilledWeightError(
            f"{self.name}: this float weight is spilled to disk while an hf_contbatch engine serves the model with "
            f"quantization='int8' (its int8 copy computes the layer); {what} needs its values: close() the engine "
            "(it puts every float weight back exactly), or serve without quantization"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: its descriptor's name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        spilled = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, SpilledWeight)), None)
        what = f"torch operation {name or func!r}"
        if spilled is None:  # (never `spilled or ...`: bool() of a tensor is an operation too)
            raise SpilledWeightError(f"a spilled float weight: {what} needs its values: close() the engine first")
        raise spilled.error(what)

    def __repr__(self, *args, **kwargs) -> str:
        return f"SpilledWeight(name={self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}: spilled to disk)"

    def __reduce_ex__(self, protocol):
        raise self.error("pickling or copying the model")

    def __deepcopy__(self, memo):
        raise self.error("copying the model")


class _RefuseApply:
    """An instance ``_apply`` for the modules above a spilled weight: ``module.to(...)``,
    ``.half()``, ``.cpu()`` raise before they convert anything (torch's ``_apply`` converts
    parameter by parameter, so an error at the first spilled weight would leave the model half
    converted). A class, not a closure, so that the error names the weight."""

    def __init__(self, weight: SpilledWeight) -> None:
        self.weight = weight

    def __call__(self, *args, **kwargs):
        raise self.weight.error("converting or moving the model (module.to, .half, .cpu...)")


class WeightSpill:
    """The float weights of one engine's int8 linears, on disk until :meth:`restore`.

    Args:
        model: the served model (its modules named in errors).
        modules: the ``nn.Linear`` modules whose float weight an int8 copy now serves.
        layout: the model's walk (``kernels.model_layout``; default: walked here).

    Raises:
        OSError: the file could not be written (disk full...); nothing is spilled then.
    """

    def __init__(self, model: torch.nn.Module, modules: list[torch.nn.Module], layout=None) -> None:
        walk = (layout or ModelLayout.of(model)).modules
        names = {id(m): n for n, m in walk}
        uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        chosen = []
        for m in modules:
            w = m._parameters.get("weight")
            if (
                isinstance(w, torch.nn.Parameter)
                and type(w) is torch.nn.Parameter  # not a subclass (a quantizer's weight, one of ours)
                and type(w.data) is torch.Tensor
                and w.is_floating_point()
                and uses[id(w)] == 1
            ):
                chosen.append((names.get(id(m), type(m).__name__), m, w))
        self.dir: Optional[str] = None
        self.guarded: list[torch.nn.Module] = []
        self.entries: list[tuple[str, torch.nn.Module, torch.nn.Parameter, SpilledWeight]] = []
        if not chosen:
            return
        from safetensors.torch import save_file

        self.dir = tempfile.mkdtemp(prefix="hf_contbatch_spill_")  # private: mode 0700
        self.path = os.path.join(self.dir, "float_weights.safetensors")
        try:
            save_file({f"{i}": w.detach().contiguous() for i, (_, _, w) in enumerate(chosen)}, self.path)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
            raise
        for i, (name, m, w) in enumerate(chosen):
            stand_in = SpilledWeight.make(w, f"{name}.weight")
            with torch.no_grad():
                w.data = torch.empty(0, dtype=w.dtype, device=w.device)  # frees the values
            m._parameters["weight"] = stand_in
            self.entries.append((str(i), m, w, stand_in))
        self.guarded = []
        spilled = {id(m): s for _, m, _, s in self.entries}
        for _, parent in walk:
            below = next((spilled[id(m)] for m in parent.modules() if id(m) in spilled), None)
            if below is not None and "_apply" not in parent.__dict__:
                parent.__dict__["_apply"] = _RefuseApply(below)
                self.guarded.append(parent)

    @property
    def num_weights(self) -> int:
        return len(self.entries)

    @property
    def spilled_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for _, _, _, s in self.entries)

    def rekey(self, forwards) -> None:
        """Have ``forwards`` (the ``PackedForward`` objects serving the spilled modules, after
        :meth:`__init__` or :meth:`restore`) see the weights now in their modules as the ones they
        packed: the stand-in replaced the Parameter, whose id is in their keys, not the values."""
        from .packed_forward import weight_key

        groups = {}
        for f in forwards:
            if f.group is not None:
                groups[id(f.group)] = f.group
            elif f.active and f.packed is not None:
                f.weight_ref, f.weight_key = f.module.weight, weight_key(f.module.weight)
        for g in groups.values():
            if g.packed is not None:
                g.keys = tuple(weight_key(m.module.weight) for m in g.members)
                g._weights = [m.module.weight for m in g.members] + [
                    m.module.bias for m in g.members if m.module.bias is not None
                ]

    def restore(self) -> None:
        """Put every float weight back into its module (the original Parameter objects, bit for bit)
        and remove the directory; idempotent. A module whose weight was replaced meanwhile keeps
        the new one. If the file cannot be read, the error propagates and the file stays."""
        for parent in self.guarded:
            if isinstance(parent.__dict__.get("_apply"), _RefuseApply):
                del parent.__dict__["_apply"]
        self.guarded = []
        if self.dir is None:
            return
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            for key, m, w, stand_in in self.entries:
                values = f.get_tensor(key)
                with torch.no_grad():
                    w.data = values.to(w.device)
                if m._parameters.get("weight") is stand_in:
                    m._parameters["weight"] = w
        self.entries = []
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
