"""Build the CPU path's C kernels ahead of use, so that a timed run does not time a one-time build.

Engines build them on first use (the GEMM when the linears are packed, decode attention at the
first decode step); a first ``hf-contbatch generate`` on a machine would count those builds in its
tokens/s. :func:`prebuild_cpu_kernels` builds both into the cache (``native_build``), or finds them
there, and says how long that took and whether anything was compiled.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
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


def _build_fused() -> None:
    if fused_library() is None:  # RMSNorm / SiLU-and-mul (fuse_model_ops): the module's ops serve without it
        raise RuntimeError(fused_library_error())


def prebuild_cpu_kernels() -> KernelBuild:
    """Compile (or find in the cache) the CPU kernels an engine uses: decode and prefill attention
    (unless ``HF_CONTBATCH_CPU_KERNEL=0``), the packed linears' GEMM, the fused model ops and the structured outputs'
    token-bitmask kernel, the compilers running side by side on the CPU's cores (a first build took
    20 s one after another on two cores, 11 s side by side: the prefill kernel's alone). The GEMM
    stays loaded for this process. Never raises: a kernel that cannot be built is reported in
    ``errors``."""
    before = _libraries()
    builds = []  # (label, build function), the longest compile first
    if prefill_allowed_by_env():
        builds.append(("prefill attention", build_prefill_library))
    if allowed_by_env():
        builds.append(("decode attention", build_decode_library))
    builds += [("GEMM", native_library), ("fused model ops", _build_fused), ("token bitmask", build_bitmask_library)]
    start = time.monotonic()
    # Each build is a compiler process (the GIL is free meanwhile); its library is written under
    # a temporary name and renamed, so concurrent builds never see a half-written file.
    with ThreadPoolExecutor(max_workers=max(1, min(len(builds), os.cpu_count() or 1))) as pool:
        futures = [(label, pool.submit(build)) for label, build in builds]
    errors = []
    for label, future in futures:
        exc = future.exception()
        if exc is not None:  # no compiler, a failed build: the torch path (or xgrammar's kernel) serves
            errors.append(f"{label}: {type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    return KernelBuild(seconds, tuple(sorted(_libraries() - before)), tuple(errors))
