"""Build the CPU path's C kernels ahead of use, so that a timed run does not time a one-time build.

Engines build them on first use (the GEMM when the linears are packed, decode attention at the
first decode step); a first ``hf-contbatch generate`` on a machine would count those builds in its
tokens/s. :func:`prebuild_cpu_kernels` builds both into the cache (``native_build``), or finds them
there, and says how long that took and whether anything was compiled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .attention.cpu_kernel import allowed_by_env, build_decode_library
from .attention.cpu_prefill import allowed_by_env as prefill_allowed_by_env
from .attention.cpu_prefill import build_prefill_library
from .fused_ops import fused_library, fused_library_error
from .linears.native_gemm import native_library
from .native_build import cache_dir
from .token_bitmask import build_bitmask_library


@dataclass(frozen=True)
class KernelBuild:
    """What :func:`prebuild_cpu_kernels` did.

    Attributes:
        seconds: wall time of the builds or cache look-ups.
        built: file names of the libraries compiled now (empty: every one came from the cache).
        errors: one line per kernel that cannot be built here; the torch paths serve instead (the
            engine warns once when it falls back).
    """

    seconds: float
    built: tuple[str, ...]
    errors: tuple[str, ...]


def _libraries() -> set[str]:
    directory = cache_dir()
    return {p.name for p in directory.glob("*.so")} if directory.is_dir() else set()


def prebuild_cpu_kernels() -> KernelBuild:
    """Compile (or find in the cache) the CPU kernels an engine uses: decode and prefill attention
    (unless ``HF_CONTBATCH_CPU_KERNEL=0``), the packed linears' GEMM, the fused model ops and the structured outputs'
    token-bitmask kernel. The GEMM stays loaded for this process. Never raises: a kernel that
    cannot be built is reported in ``errors``."""
    before = _libraries()
    errors = []
    start = time.monotonic()
    if allowed_by_env():
        try:
            build_decode_library()
        except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: the torch path serves
            errors.append(f"decode attention: {type(exc).__name__}: {exc}")
    if prefill_allowed_by_env():
        try:
            build_prefill_library()
        except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: the torch path serves
            errors.append(f"prefill attention: {type(exc).__name__}: {exc}")
    try:
        native_library()
    except RuntimeError as exc:
        errors.append(f"GEMM: {exc}")
    if fused_library() is None:  # RMSNorm / SiLU-and-mul (fuse_model_ops): the module's ops serve without it
        errors.append(f"fused model ops: {fused_library_error()}")
    try:
        build_bitmask_library()
    except Exception as exc:  # noqa: BLE001 - xgrammar's kernel serves structured outputs instead
        errors.append(f"token bitmask: {type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    return KernelBuild(seconds, tuple(sorted(_libraries() - before)), tuple(errors))
