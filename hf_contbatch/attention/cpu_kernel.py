"""A compiled CPU kernel for paged decode attention, built on first use with the system C compiler.

Why: the plain-torch decode path gathers every request's keys out of the pool each layer and runs
small batched matmuls (two query rows per KV head); measured here (2 threads) it took 0.8 ms a
layer for 12 requests of 100-400 tokens (tiny model shapes) and 2.6 ms for 32. Reading keys and
values in place, one OpenMP task per request, each key and value row loaded once for all its query
heads, takes 0.38 and 1.1 ms; whole workloads 1.22x (tiny) and 1.07x (small) tokens/s, outputs
unchanged (``benchmarks/bench_breakdown.py``, variants ``default;tree=PATH``). The kernel (``cpu_decode.c``) is plain C with no torch headers,
so it compiles in about a second (``cc -O3 -march=native -fopenmp``), is cached per source, compiler
and CPU under ``$XDG_CACHE_HOME/hf_contbatch`` (default ``~/.cache``), and runs on torch's own
OpenMP runtime (the same ``libgomp.so.1``). Without a C compiler, or if the build fails, the torch
path serves and one warning says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class _Kernel:
    """The loaded library, or why there is none (built once per process, on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fn = None
        self._tried = False
        self.error: Optional[str] = None

    def get(self):
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        self._fn = _load(_build())
                    except Exception as exc:  # noqa: BLE001 - any failure means the torch path serves
                        self.error = f"{type(exc).__name__}: {exc}"
                        logger.warning(
                            "compiled CPU decode attention unavailable (%s); using the torch path", self.error
                        )
                    self._tried = True
        return self._fn


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_contbatch"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> Path:
    """Path of the compiled library, compiling it if this source/compiler/CPU has none yet."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), cc, version, " ".join(_FLAGS), _cpu_id()]).encode())
    target = _cache_dir() / f"cpu_decode_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path):
    lib = ctypes.CDLL(str(path))
    fn = lib.hf_contbatch_paged_decode_f32
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, f32, i64, ptr]
    fn.restype = None
    return fn


class CPUDecodeKernel:
    """Per-engine handle on the compiled kernel (the build is cached on disk; each engine loads it
    on its first decode step). ``available`` is False where the kernel cannot serve: no compiler,
    a failed build, or ``HF_CONTBATCH_CPU_KERNEL=0`` in the environment."""

    def __init__(self) -> None:
        self._kernel = _Kernel()
        self.enabled = os.environ.get("HF_CONTBATCH_CPU_KERNEL", "1") != "0"

    @property
    def available(self) -> bool:
        return self.enabled and self._kernel.get() is not None

    @property
    def error(self) -> Optional[str]:
        return self._kernel.error

    def can_serve(self, query: torch.Tensor, k_pool: torch.Tensor) -> bool:
        """float32 CPU tensors, a contiguous pool, and the kernel built."""
        return (
            query.dtype == torch.float32
            and k_pool.dtype == torch.float32
            and query.device.type == "cpu"
            and k_pool.device.type == "cpu"
            and k_pool.is_contiguous()
            and self.available
        )

    def __call__(
        self,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        softcap: Optional[float] = None,
        sliding_window: Optional[int] = None,
    ) -> torch.Tensor:
        """Decode attention of ``query`` ``[b, H, D]`` over the paged pools ``[blocks, block_size,
        KVH, D]`` (float32), with int32 ``block_tables`` ``[b, max_blocks]`` and ``seq_lens``
        ``[b]``; ``scale`` multiplies q.k, ``softcap``/``sliding_window`` as in the torch path.
        Returns ``[b, H, D]`` float32. Call only when :meth:`can_serve` is True (otherwise there
        is no kernel to call and this raises ``TypeError``)."""
        fn = self._kernel.get()
        q = query.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        b, num_heads, head_dim = q.shape
        _, block_size, kvh, _ = k_pool.shape
        out = torch.empty_like(q)
        fn(
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            b,
            tables.shape[1],
            num_heads,
            kvh,
            head_dim,
            block_size,
            float(scale),
            float(softcap) if softcap else 0.0,
            int(sliding_window) if sliding_window else 0,
            out.data_ptr(),
        )
        return out
