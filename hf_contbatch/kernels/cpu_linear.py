"""Packed linear layers for CPU serving: our own GEMM, or oneDNN's.

torch's ``F.linear`` on CPU calls a BLAS ``sgemm`` that is slow at the small row counts of a decode
step (a few to a few dozen tokens): measured here, a 4-layer hidden-256 Llama's 29 linears took
2.3 ms at 10 rows, and 1.05 ms through oneDNN with the weights reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, the ops inductor's CPU
weight-freezing pass emits). Our own kernel (``cpu_gemm.c``, :class:`NativeGEMM`, built with the
system C compiler) streams the weights better still: 1.35-2.0x less time than oneDNN from 1 to 32
rows on the anchor models' layers, about the same at prefill sizes (``benchmarks/bench_gemm.py``). ``linear_backend="auto"``
uses it where it builds, else oneDNN, else ``F.linear``; greedy tokens are unchanged either way.

How it is plugged in: each ``nn.Linear`` *instance* gets a ``forward`` attribute (the class is never
touched) that calls the packed op; :meth:`PackedLinears.restore` deletes the attributes. Modules that
already carry an instance ``forward`` or hooks (accelerate's ``device_map`` offload wraps
``forward`` that way) are left alone. The packed copy costs as much memory as the weights it packs;
``linear_backend="auto"`` packs only when that fits comfortably (see :func:`pack_linears`). A weight
changed in place (``load_state_dict``, an optimizer step: the version counter), given new storage
(``.data = ...``, ``.to(...)``) or replaced by another Parameter is repacked before its next use, so
outputs follow the current weights. Writes through ``.data`` (``w.data.mul_(2)``, as some weight
initialisers do) bypass the version counter and cannot be seen: call :meth:`PackedLinears.repack`
after them. Calls that need autograd (grad enabled and any of input, weight
or bias requiring grad) run ``F.linear``. A deepcopy or pickle of the model drops the packed copy
and repacks on first use.

With oneDNN, row counts are padded to a bounded set of sizes (:func:`padded_rows`). Why: oneDNN builds and
keeps a primitive (JIT code, ~0.6 MB measured here whatever the weight size) for every input shape
it sees, and a serving engine sees every row count from 1 to ``max_num_batched_tokens``. Unpadded,
10,000 short requests grew the process by ~660 MB and kept growing; one linear fed row counts
1..1024 twice grew by 2 GB. Padded, a model holds at most ``distinct (in, out) pairs x 64``
primitives up to 1024 rows; steps of more than 16 rows compute at most 12.5% padding rows. Our
kernel keeps nothing per shape and needs no padding.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import subprocess
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from .native_build import build_library

logger = logging.getLogger(__name__)

_GEMM_SOURCE = Path(__file__).with_name("cpu_gemm.c")
# No -ffast-math: each output must stay one in-order FMA chain (see cpu_gemm.c, "Exactness").
_GEMM_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_GEMM_NR = 16  # output columns per packed panel (NR in cpu_gemm.c)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` float32 weight → oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def _weight_key(weight: torch.Tensor) -> tuple:
    """What identifies the packed values: in-place writes bump the version, ``.data = ...`` and
    ``.to(...)`` change the storage, assigning a new Parameter changes the identity."""
    return (id(weight), weight.data_ptr(), weight._version, weight.dtype)


def padded_rows(m: int) -> int:
    """The row count a ``m``-row input is padded to: ``m`` itself up to 16 (decode steps of a few
    sequences pay nothing), then eight sizes per octave (18, 20, ..., 32, 36, ..., 64, 72, ...), so
    at most 1/8 of the rows are padding and row counts up to ``2**k`` use ``16 + 8 * (k - 4)``
    distinct shapes (64 up to 1024). Why not coarser: at these sizes oneDNN's time grows with the
    rows (measured here: 768x2304 took 0.21 ms at 1 row, 0.72 ms at 8), so padding costs its share."""
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


@functools.cache
def _load_native_library():
    """(pack, gemm) or the exception that prevented them: built once per process, a failure too
    (no compiler: every later engine falls back at once instead of retrying the build)."""
    try:
        lib = ctypes.CDLL(str(build_library(_GEMM_SOURCE, _GEMM_FLAGS)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # no/broken compiler, dlopen failed
        return None, exc
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    pack, gemm = lib.hf_contbatch_gemm_pack_f32, lib.hf_contbatch_gemm_f32
    pack.argtypes, pack.restype = [ptr, i64, i64, ptr], None
    gemm.argtypes, gemm.restype = [ptr, i64, i64, ptr, i64, ptr, ptr, i64], None
    return (pack, gemm), None


def _native_library():
    """The compiled GEMM functions (pack, gemm), shared by the process like any loaded library.

    Raises:
        RuntimeError: the kernel cannot be built here (see ``native_build``); the message names why.
    """
    fns, exc = _load_native_library()
    if exc is not None:
        raise RuntimeError(f"our GEMM cannot be built: {type(exc).__name__}: {exc}") from exc
    return fns


def _native_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int
) -> torch.Tensor:
    """``x @ W.T + b`` with our GEMM: ``x`` ``[..., in]`` float32 CPU, ``packed`` from
    :meth:`NativeGEMM.pack`, ``bias`` ``[out]`` float32 or None; returns ``[..., out]`` float32.

    Raises:
        RuntimeError: ``x`` or ``bias`` of another dtype, device or size than the packed weight
            (the C kernel trusts its arguments, so they are checked here).
    """
    if torch.compiler.is_compiling():
        return torch.ops.hf_contbatch.native_linear(x, packed, bias, out_features)
    k = x.shape[-1] if x.dim() else -1
    panels = packed.shape[0]
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or k != packed.shape[1]
        or not (panels - 1) * _GEMM_NR < out_features <= panels * _GEMM_NR
    ):
        raise RuntimeError(
            f"native linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit a packed float32 CPU "
            f"weight of {out_features} x {packed.shape[1]}"
        )
    if bias is not None:
        if bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.shape != (out_features,):
            raise RuntimeError(
                f"native linear: bias {tuple(bias.shape)} {bias.dtype} on {bias.device} does not fit "
                f"{out_features} float32 CPU outputs"
            )
        bias = bias.contiguous()  # kept in a local: the kernel reads it after this line
    return _native_gemm(x, packed, bias, out_features)


def _native_gemm(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int
) -> torch.Tensor:
    """:func:`_native_linear` without its argument checks, for callers that made them already
    (``x`` float32 CPU with the packed weight's input size, ``bias`` dense float32 ``[out]``)."""
    k = x.shape[-1]
    # A contiguous [..., in] tensor is already the [rows, in] matrix the kernel reads: no reshape
    # (each costs ~3 us, a decode step makes dozens of these calls).
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], out_features))
    if k == 0:  # no input features: the product is zero
        return y.zero_() if bias is None else y.copy_(bias.expand_as(y))
    m = x.numel() // k
    if m:
        # ctypes releases the GIL for the call: engines in other threads keep running.
        _native_library()[1](
            x.data_ptr(),
            m,
            k,
            packed.data_ptr(),
            out_features,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
    return y


class NativeGEMM:
    """Our float32 GEMM (``cpu_gemm.c``): weights packed into panels of 16 output columns,
    ``[ceil(out/16), in, 16]`` (a plain tensor, zero-padded), multiplied by any number of rows with
    torch's thread count. Each output is one in-order multiply-add chain over the input features,
    so a row's result does not depend on the batch it is in.

    Raises:
        RuntimeError: on construction, when the kernel cannot be built (no C compiler, or the
            compile failed).
    """

    name = "native"

    def __init__(self) -> None:
        _native_library()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``[out, in]`` float32 → the packed panels (a new tensor; the weight is only read)."""
        n, k = weight.shape
        w = weight.contiguous()
        out = torch.empty((-(-n // _GEMM_NR), k, _GEMM_NR), dtype=torch.float32)
        _native_library()[0](w.data_ptr(), n, k, out.data_ptr())
        return out

    def linear(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` float32 → ``[..., out_features]`` float32 through ``packed`` (from
        :meth:`pack`), plus ``bias`` ``[out_features]`` if given. Raises RuntimeError when ``x`` or
        ``bias`` does not fit the packed weight (see :func:`_native_linear`)."""
        return _native_linear(x, packed, bias, out_features)

    def linear_verified(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """:meth:`linear` for arguments already checked (see :meth:`PackedLinears.verified_step`)."""
        if torch.compiler.is_compiling():
            return torch.ops.hf_contbatch.native_linear(x, packed, bias, out_features)
        return _native_gemm(x, packed, bias, out_features)


class OneDNNGEMM:
    """oneDNN's inner product over its blocked weight layout, rows padded (:func:`padded_rows`)."""

    name = "onednn"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``[out, in]`` float32 → oneDNN's blocked copy (an opaque tensor)."""
        return _reorder(weight)

    def linear(self, x, packed, bias, out_features: int) -> torch.Tensor:
        """``x`` ``[..., in]`` float32 → ``[..., out_features]`` float32 through ``packed`` (from
        :meth:`pack`), plus ``bias`` ``[out_features]`` if given; oneDNN raises RuntimeError on a
        mismatch."""
        return _padded_linear(x, packed, bias, out_features)

    linear_verified = linear


def _check_packable(weight: torch.Tensor) -> None:
    """Raise RuntimeError unless ``weight`` is float32 on the CPU (what both kernels pack)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise RuntimeError(f"cannot pack a {weight.dtype} weight on {weight.device} (float32 CPU only)")


class _PackedForward:
    """The instance ``forward`` of one packed ``nn.Linear``: input ``[..., in_features]`` →
    ``[..., out_features]``, float32."""

    def __init__(self, module: torch.nn.Linear, kernel) -> None:
        self.module = module
        self.kernel = kernel  # NativeGEMM or OneDNNGEMM
        self.active = True
        self.weight_key: Optional[tuple] = None
        self.packed: Optional[torch.Tensor] = None
        self.group = None  # a hf_contbatch.kernels.fused_linear.FusedGroup computing this output with its siblings
        self.group_index = 0  # this module's place in its group (0: the leader, which runs the GEMM)
        # Set by PackedLinears.verified_step for its duration: the thread whose calls may skip the
        # per-call checks, and the step's bias (detached, dense).
        self.verified_thread: Optional[int] = None
        self.verified_bias: Optional[torch.Tensor] = None
        self._pack()

    def _pack(self) -> None:
        weight = self.module.weight
        _check_packable(weight)
        key = _weight_key(weight)  # before reading: a write during the reorder repacks next call
        with torch.no_grad():
            self.packed = self.kernel.pack(weight.detach())
        # weight_ref keeps the packed weight alive, so its id() in the key cannot be reused.
        self.weight_ref, self.weight_key = weight, key

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
        if self.weight_key != _weight_key(self.module.weight):
            try:
                self._pack()
            except RuntimeError as exc:
                logger.warning("repacking %s failed (%s); it runs F.linear from now on", self.module, exc)
                self.disable()

    def verify(self) -> bool:
        """Whether this module's calls may skip their checks until the end of the step: active
        (packed, or its group's fused weight, for the current weights: :meth:`PackedLinears.refresh`
        ran just before), float32 CPU weight and bias. Sets the step's bias. Called by
        :meth:`PackedLinears.verified_step`."""
        weight, bias = self.module.weight, self.module.bias
        if not self.active or weight.dtype != torch.float32 or not weight.is_cpu:
            return False
        if bias is not None:
            if bias.dtype != torch.float32 or not bias.is_cpu or bias.shape != weight.shape[:1]:
                return False
            bias = bias.detach().contiguous()
        self.verified_bias = bias
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        verified = self.verified_thread
        if (
            verified is not None
            and verified == threading.get_ident()
            and x.dtype == torch.float32
            and x.is_cpu
            and x.dim()
            and x.shape[-1] == self.module.in_features
        ):
            # Inside a verified step (weights checked and repacked once at its start): only the
            # input is checked, ~10 us less per call (a tiny model's step makes 29 of them).
            if self.group is not None:
                return self.group(self, x, verified=True)
            return self.kernel.linear_verified(x, self.packed, self.verified_bias, self.module.out_features)
        weight, bias = self.module.weight, self.module.bias
        if (
            not self.active
            or x.dtype != torch.float32
            or weight.dtype != torch.float32
            or x.device.type != "cpu"
            or weight.device.type != "cpu"
            or x.dim() == 0
            or x.shape[-1] != weight.shape[1]
            or bias is not None
            and (bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.shape != weight.shape[:1])
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
        return self.kernel.linear(x, self.packed, None if bias is None else bias.detach(), weight.shape[0])


def _padded_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int
) -> torch.Tensor:
    """``x @ W.T + b`` through the packed weight, rows padded to :func:`padded_rows` (see the module
    docstring for why). Input ``[..., in]`` float32, output ``[..., out]``."""
    if torch.compiler.is_compiling():
        # Opaque to torch.compile: inductor cannot lower oneDNN's packed layout, and the padding
        # keeps oneDNN's primitives bounded there too.
        return torch.ops.hf_contbatch.onednn_linear(x, packed, bias, out_features)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    rows = padded_rows(m)
    if rows != m:
        padded = x2.new_zeros(rows, k)
        padded[:m] = x2
        x2 = padded
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # oneDNN reads a strided bias as if it were dense (measured: wrong sums)
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y[:m].reshape(*lead, out_features)


# Registered with ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter wraps
# every call in Python autograd and alias-checking layers, measured here at 19.5 us a call under
# inference mode against 7.6 us for a plain ``Library.impl`` kernel (a compiled tiny-model step
# makes 17 of these calls). The ops are inference-only (no autograd formula) and return new tensors.
_OPS = torch.library.Library("hf_contbatch", "FRAGMENT")


def _register_linear_op(name: str, impl: Callable) -> None:
    """``impl(x, packed, bias, out_features)`` registered as ``torch.ops.hf_contbatch.<name>``, so
    compiled forwards call it as one opaque op: inductor cannot lower our packed layouts, and the
    kernels keep their own row handling there too."""
    _OPS.define(f"{name}(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
    _OPS.impl(name, impl, "CompositeExplicitAutograd")

    def fake(x, packed, bias, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    torch.library.register_fake(f"hf_contbatch::{name}", fake, lib=_OPS)


_register_linear_op("onednn_linear", _padded_linear)
_register_linear_op("native_linear", _native_linear)


class PackedLinears:
    """The packed ``nn.Linear`` modules of one model; :meth:`restore` puts their forwards back.
    ``backend`` names the kernel: "native" (ours) or "onednn"."""

    def __init__(self, forwards: list[_PackedForward], packed_bytes: int, backend: str) -> None:
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


def _pack_all(modules: list[torch.nn.Linear], name: str) -> list[_PackedForward]:
    """Pack every module with kernel ``name`` (nothing installed yet), after a probe against
    ``F.linear``. Raises RuntimeError when the kernel is unavailable or disagrees."""
    kernel = _make_kernel(name)
    forwards = [_PackedForward(m, kernel) for m in modules]
    probe = forwards[0]
    x = torch.randn(3, probe.module.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.nn.functional.linear(x, probe.module.weight, probe.module.bias)
        got = probe(x)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-6):
        raise RuntimeError(f"{name} linear disagrees with F.linear by {float((got - want).abs().max()):.3g}")
    return forwards


def pack_linears(
    model: torch.nn.Module, mode: str, available_bytes: Optional[Callable[[], Optional[int]]] = None
) -> Optional[PackedLinears]:
    """Pack the model's float32 CPU ``nn.Linear`` weights for a faster GEMM, or do nothing.

    Args:
        model: the model (modified only through instance attributes; see the module docstring).
        mode: ``"torch"`` (do nothing), ``"native"`` (our GEMM, :class:`NativeGEMM`), ``"onednn"``
            (oneDNN's; both raise if impossible) or ``"auto"`` (ours where it builds, else oneDNN,
            else nothing; only when the packed copy takes at most a quarter of the available host
            memory). A probe output must match ``F.linear`` before anything is installed.
        available_bytes: returns the available host memory in bytes (None when unknown).

    Returns:
        The packed modules (``backend`` names the kernel), or None when nothing was packed.

    Raises:
        RuntimeError: ``mode="native"`` without a working C compiler, ``mode="onednn"`` on a torch
            without the oneDNN ops, or the probe disagrees (not for ``"auto"``, which falls back).
    """
    if mode == "torch":
        return None
    modules = [m for m in model.modules() if _eligible(m)]
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
