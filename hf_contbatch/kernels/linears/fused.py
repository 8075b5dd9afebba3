"""One GEMM for sibling projections that read the same input (q/k/v, gate/up), model unmodified.

On CPU a decode step's linears cost per call more than per FLOP. Attention's
``q_proj``/``k_proj``/``v_proj`` and the MLP's ``gate_proj``/``up_proj`` read the same hidden
states, so one GEMM over their concatenated packed weights gives all their outputs: two calls a
layer instead of five. The fused output equals the separate ones bit for bit (neither our GEMM nor
oneDNN's ``_linear_pointwise`` makes the reduction over the input features depend on the number of
output columns; ``tests/kernels/test_fused_linear.py`` checks it), so greedy tokens do not change.

How it is plugged in without touching the model's code: the packed forwards of a group (see
``hf_contbatch.kernels.linears.packed_forward``) share a :class:`FusedGroup`. The first member's call (the *leader*,
``q_proj``/``gate_proj``) runs the fused GEMM, returns its own slice and keeps the others' slices
for the same input tensor; a later member called with that very tensor object takes its slice. A
member called with another input, or before the leader, or twice, computes its own output
(``F.linear``), so any call order stays correct, only slower. A weight changed since packing (the
same version/storage/identity key as the packed linears) repacks the fused weight before its next
use. The outputs are column slices of one buffer (views, not copies).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from ..model_layout import ModelLayout
from .packed_forward import (
    PackedForward,
    check_packable,
    is_placeholder,
    module_tensor,
    release_weight,
    watch_loads,
    weight_key,
)

logger = logging.getLogger(__name__)

#: Sibling ``nn.Linear`` names fused into one GEMM, leader first (the order models call them in).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedGroup:
    """The shared state of one group of packed sibling linears (same input, same in_features)."""

    def __init__(self, members: list[PackedForward], kernel) -> None:
        self.members = members
        self.kernel = kernel  # the kernel chosen for the fused shape (may differ from the members')
        self.sizes = [f.module.out_features for f in members]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(members))]
        self.total = sum(self.sizes)
        self.keys: tuple | None = None
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        # (input, outputs not yet taken): replaced as one tuple, so a thread that checked the input
        # reads that input's outputs even if another engine thread shares the model.
        self._pending: tuple | None = None
        # The members' float weights released while packed (see packed_forward), and their keys then.
        self.released_keys: tuple | None = None
        self.restore_from_packed = False  # a deepcopy/pickle of a group whose weights were released
        self._pack()

    def release_weights(self) -> None:
        """Release the members' float weights where every member allows it and the kernel gives
        the fused weight back exactly (``PackedForward.releasable``, ``GemmKernel.exact_unpack``)."""
        if self.released_keys is not None or self.packed is None or not self.kernel.exact_unpack:
            return
        if not all(f.releasable for f in self.members):
            return
        with torch.inference_mode(False), torch.no_grad():
            for f in self.members:
                release_weight(f.module.weight)
                watch_loads(f.module, self._put_back)
        self.released_keys = self.keys = tuple(weight_key(f.module.weight) for f in self.members)

    def _put_back(self) -> None:
        """The members' weights real again (see ``PackedForward._put_back``): each one's rows of the
        unpacked fused weight where still released, or a ``fill_`` of the placeholder made real."""
        mods = [f.module for f in self.members]
        with torch.inference_mode(False), torch.no_grad():
            full = None
            for i, m in enumerate(mods):
                exact = self.restore_from_packed or (
                    is_placeholder(m.weight)
                    and self.released_keys is not None
                    and self.released_keys[i] == weight_key(m.weight)
                )
                if exact and self.packed is not None:
                    if full is None:
                        full = self.kernel.unpack(self.packed)
                    m.weight.data = full[self.offsets[i] : self.offsets[i] + self.sizes[i]].clone()
                elif is_placeholder(m.weight):
                    m.weight.data = m.weight.data.contiguous()
        if self.keys is not None and self.keys == self.released_keys:  # the packed copy still matches
            self.keys = tuple(weight_key(m.weight) for m in mods)
        self.released_keys, self.restore_from_packed = None, False

    def materialize(self) -> None:
        """Put the members' exact float weights back and keep them (a call needs them)."""
        for f in self.members:
            f.releasable = False
        self._put_back()

    def _pack(self) -> None:
        self._put_back()
        mods = [f.module for f in self.members]
        for m in mods:
            check_packable(m.weight, self.kernel)
        keys = tuple(weight_key(m.weight) for m in mods)  # before reading, as in packed_forward
        bias_keys = self._bias_keys()
        with torch.no_grad():
            self.packed = self.kernel.pack(torch.cat([m.weight.detach() for m in mods]))
            biases = [m.bias for m in mods]
            if all(b is None for b in biases):
                self.bias = None
            else:  # a member without a bias (one set to None while open) adds zeros
                self.bias = self.kernel.step_bias(
                    torch.cat(
                        [
                            b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                            for b, m in zip(biases, mods)
                        ]
                    )
                )
        # Keep weights and biases alive: their id() is in the keys.
        self._weights = [m.weight for m in mods] + [b for b in biases if b is not None]
        self.keys, self.bias_keys = keys, bias_keys
        self.release_weights()

    def _bias_keys(self) -> tuple:
        biases = [module_tensor(f.module, "bias") for f in self.members]
        return tuple(None if b is None else weight_key(b) for b in biases)

    def _current(self) -> bool:
        mods = [f.module for f in self.members]
        if self.packed is None or self.keys != tuple(weight_key(module_tensor(m, "weight")) for m in mods):
            return False
        return self.bias_keys == self._bias_keys()  # also a bias added or removed since packing

    def repack_if_changed(self) -> None:
        """Repack the fused weight when a member's weight or bias changed since packing. If that
        fails (out of memory; a copy unpickled where the kernel cannot be built), the members run
        ``F.linear`` from then on, with one warning."""
        if not self._current():
            try:
                self._pack()
            except RuntimeError as exc:
                logger.warning("repacking fused %s failed (%s); they run F.linear from now on", self.sizes, exc)
                for f in list(self.members):
                    f.disable()  # also releases this group

    def __getstate__(self) -> dict:
        # No packed tensor in a deepcopy/pickle (oneDNN's is opaque): the copy repacks on first use.
        return {
            "members": self.members,
            "kernel": self.kernel,
            "sizes": self.sizes,
            "offsets": self.offsets,
            "total": self.total,
            "keys": None,
            # Released weights live only in the packed copy: a copy takes it along and puts them back.
            "packed": self.packed if self.released_keys is not None else None,
            "released_keys": None,
            "restore_from_packed": self.released_keys is not None,
            "bias": None,
            "bias_keys": None,
            "_weights": [],
            "_pending": None,
        }

    def release(self) -> None:
        """Put released member weights back, then free the fused copy."""
        self.materialize()
        self.packed = self.bias = self._pending = None
        self._weights = []

    def __call__(self, member: PackedForward, x: torch.Tensor, verified: bool = False) -> torch.Tensor:
        """``member``'s output for ``x``: the first member called with ``x`` runs the fused GEMM,
        the others take their slices. ``verified``: inside ``PackedLinears.verified_step`` (the
        fused weight is current)."""
        index = member.group_index
        pending = self._pending
        # A slice serves when it was computed for this input and the member's weight is the one
        # packed (written in place since, its slice is stale: compute again, which repacks).
        if (
            pending is not None
            and pending[0] is x
            and pending[2][index]
            and (
                verified
                # Compiled: see PackedLinears.refresh() (and reading the keys here would guard the
                # graph on weight versions: a weight change would compile it again).
                or torch.compiler.is_compiling()
                or self.keys is None
                or weight_key(member.module.weight) == self.keys[index]
            )
        ):
            untaken = pending[2]
            untaken[index] = False
            if not any(untaken) and self._pending is pending:
                self._pending = None  # all taken: drop the references
            return pending[1].narrow(-1, self.offsets[index], self.sizes[index])
        # No fused output for this input yet: whichever member is called first runs the fused GEMM
        # (a model may call its up projection before its gate, as Falcon-H1 does), and the others
        # take their slices. An input no member has seen computes again: correct, only slower,
        # and it never needs the float weights (they may be spilled under int8).
        if verified:
            out = self.kernel.linear_verified(x, self.packed, self.bias, self.total)
        else:
            if not torch.compiler.is_compiling():  # compiled: see PackedLinears.refresh()
                self.repack_if_changed()
                if self.packed is None:  # freed: the repack failed (weights were put back)
                    return torch.nn.functional.linear(x, member.module.weight, member.module.bias)
            out = self.kernel.linear(x, self.packed, self.bias, self.total)
        # Slices are taken when asked for (narrow is cheaper than split).
        untaken = [True] * len(self.sizes)
        untaken[index] = False
        self._pending = (x, out, untaken)
        return out.narrow(-1, self.offsets[index], self.sizes[index])

    def outputs_verified(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, ...]]:
        """Every member's output for ``x`` from one call, in member order: one GEMM and its column
        views, what calling each member's forward with ``x`` returns inside
        ``PackedLinears.verified_step`` (the members' per-call Python and the group's bookkeeping
        of untaken slices skipped: a decoder layer takes its q/k/v or gate/up at once). None,
        nothing computed, unless every member is verified for this thread and takes ``x`` as its
        verified path would (dtype, CPU, input features): the caller then calls them one by one."""
        thread = threading.get_ident()
        if not x.is_cpu or not x.dim():
            return None
        width, dtype = x.shape[-1], x.dtype
        for f in self.members:
            if f.verified_thread != thread or f.dtype != dtype or f.module.in_features != width:
                return None
        out = self.kernel.linear_verified(x, self.packed, self.bias, self.total)
        return out.split_with_sizes(self.sizes, -1)  # one call for all views: a third of the narrows' cost


def _concatenable(weight: torch.Tensor) -> bool:
    return type(weight) in (torch.Tensor, torch.nn.Parameter)


def _base_linear(module):
    """``module``, or the ``nn.Linear`` a LoRA wrapper (``base_layer``) holds."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, torch.nn.Linear) else module


def sibling_groups(
    model: torch.nn.Module, modules: list[torch.nn.Linear], layout: Optional[ModelLayout] = None
) -> list[list[torch.nn.Linear]]:
    """The groups of ``modules`` that can share one GEMM: every member of a :data:`FUSED_GROUPS`
    name tuple a child of the same parent and in ``modules``, with one ``in_features``, one weight
    dtype, and either all or none with a bias. Leaders first. A LoRA wrapper (peft's
    ``lora.Linear``) stands for its base layer: the LoRA delta is added on top of the fused output
    (``hf_contbatch.kernels.lora``). ``layout``: the model's walk (default: walked here)."""
    wanted = {id(m) for m in modules}
    groups = []
    for _, owner in (layout or ModelLayout.of(model)).modules:
        children = dict(owner.named_children())
        for names in FUSED_GROUPS:
            mods = [_base_linear(children.get(n)) for n in names]
            if any(m is None or id(m) not in wanted for m in mods):
                continue
            if len({type(m.weight) for m in mods}) != 1 or not all(_concatenable(m.weight) for m in mods):
                continue  # a torchao int8 weight cannot be concatenated (torch.cat): each runs alone
            if len({(m.in_features, m.weight.dtype) for m in mods}) != 1 or len({m.bias is None for m in mods}) != 1:
                continue
            groups.append(mods)
    return groups


def form_group(members: list[PackedForward], kernel) -> Optional[FusedGroup]:
    """Fuse packed forwards into one :class:`FusedGroup` with ``kernel`` for the fused shape; their
    own packed copies are freed. None, with a warning, when packing the fused weight
    fails (kernel error or out of memory): they then run on their own."""
    if any(f.group is not None for f in members):
        return None
    try:
        group = FusedGroup(members, kernel)
    except RuntimeError as exc:
        logger.warning("could not fuse %s (%s); running them separately", [f.module for f in members], exc)
        return None
    for i, f in enumerate(members):
        f.group, f.group_index = group, i
        f.packed = None  # the fused copy replaces each member's own
    return group
