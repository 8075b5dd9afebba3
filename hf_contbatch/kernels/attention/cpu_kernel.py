"""A compiled CPU kernel for paged decode attention (float32 or bfloat16 pools), built on first use
with the system C compiler.

Why: the plain-torch decode path gathers every request's keys out of the pool each layer and runs
small batched matmuls (two query rows per KV head). The kernel reads keys and values in place, one
OpenMP task per request (or per KV head when there are few requests), each key and value row
loaded once for all its query heads, with the head dimension a compile-time constant and the next
page prefetched; outputs are unchanged (``benchmarks/bench_breakdown.py`` compares the two paths,
variants ``default;tree=PATH``). The kernel (``cpu_decode.c``) is plain C with no torch headers, so
it compiles quickly (``cc -O3 -march=native -ffast-math -fopenmp``), is cached per source, compiler
and CPU (``hf_contbatch.kernels.native_build``), and runs on torch's own OpenMP runtime. Without a C
compiler, or if the build fails, the torch path serves and one warning says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from ..native_build import build_library, cache_dir, cpu_id

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
                        self._fn = _load(build_decode_library())
                    except Exception as exc:  # noqa: BLE001 - any failure means the torch path serves
                        self.error = f"{type(exc).__name__}: {exc}"
                        logger.warning(
                            "compiled CPU decode attention unavailable (%s); using the torch path", self.error
                        )
                    self._tried = True
        return self._fn


def build_decode_library() -> Path:
    """Path of the compiled decode kernel, compiled now when the cache has none for this source,
    compiler and CPU (errors as ``native_build.build_library``)."""
    return build_library(_SOURCE, _FLAGS)


def _load(path: Path):
    """(decode attention, KV store) functions of the built library."""
    lib = ctypes.CDLL(str(path))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    fn = lib.hf_contbatch_paged_decode
    fn.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, f32, i64, i64, ptr]
    fn.restype = i64
    store = lib.hf_contbatch_store_kv
    store.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    store.restype = None
    return fn, store


POOL_DTYPES = (torch.float32, torch.bfloat16)
"""KV pool dtypes the kernel reads (bfloat16 widened to float32 as it reads: exact)."""


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
    def built_ok(self) -> bool:
        """Whether the library is usable at all (the KV store serves even where the decode path chose
        the torch attention); False under ``HF_CONTBATCH_CPU_KERNEL=0``."""
        return os.environ.get("HF_CONTBATCH_CPU_KERNEL", "1") != "0" and self._kernel.get() is not None

    @property
    def error(self) -> Optional[str]:
        return self._kernel.error

    def can_serve(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
        """CPU tensors, the query float32 or of the pools' dtype, pools of float32 or bfloat16, both
        contiguous and of one shape (the kernel reads them as dense ``[blocks, block_size, KVH, D]``
        arrays), and the kernel built."""
        return (
            k_pool.dtype in POOL_DTYPES
            and v_pool.dtype == k_pool.dtype
            and query.dtype in (torch.float32, k_pool.dtype)
            and query.is_cpu
            and k_pool.is_cpu
            and v_pool.is_cpu
            and k_pool.is_contiguous()
            and v_pool.is_contiguous()
            and v_pool.shape == k_pool.shape
            and self.available
        )

    def store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> bool:
        """Write this step's K and V rows into their slots in one call, if this kernel can: ``key``
        and ``value`` ``[T, KVH, D]`` (views with unit stride in D), of the dense pools' dtype
        (float32 or bfloat16), CPU, ``slot_mapping`` int64 ``[T]``. Returns False (nothing
        written) where it cannot: the caller stores them itself. Works whether or not the decode
        path chose the kernel (storing is a copy: same bits either way)."""
        lib = self._kernel.get() if self.built_ok else None
        if (
            lib is None
            or key.dtype != k_pool.dtype
            or value.dtype != k_pool.dtype
            or k_pool.dtype not in POOL_DTYPES
            or v_pool.dtype != k_pool.dtype
            or not (key.is_cpu and value.is_cpu and k_pool.is_cpu and v_pool.is_cpu)
            or key.stride(-1) != 1
            or value.stride(-1) != 1
            or not (k_pool.is_contiguous() and v_pool.is_contiguous())
            or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous()
            or key.shape != value.shape
            or key.shape[1:] != k_pool.shape[2:]
        ):
            return False
        t, kvh, d = key.shape
        lib[1](
            key.data_ptr(),
            value.data_ptr(),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            slot_mapping.data_ptr(),
            t,
            kvh,
            d,
            key.element_size(),
        )
        return True

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
        split_heads: Optional[bool] = None,
    ) -> torch.Tensor:
        """Decode attention of ``query`` ``[b, H, D]`` over the paged pools ``[blocks, block_size,
        KVH, D]`` (float32), with int32 ``block_tables`` ``[b, max_blocks]`` and ``seq_lens``
        ``[b]``; ``scale`` multiplies q.k, ``softcap``/``sliding_window`` as in the torch path.
        ``split_heads``: one task per (sequence, KV head) instead of per sequence; default: when
        there are fewer than four sequences per thread (the decode tail), so all threads work.
        Pools float32 or bfloat16; the query is computed with in float32 and the result returned
        in the query's dtype, ``[b, H, D]``. Call only when :meth:`can_serve` is True (otherwise
        there is no kernel to call and this raises ``TypeError``).

        Raises:
            MemoryError: the kernel's scratch (``H * seq_len`` floats per task) could not be allocated.
        """
        fn = self._kernel.get()[0]
        q = query.to(torch.float32).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        b, num_heads, head_dim = q.shape
        _, block_size, kvh, _ = k_pool.shape
        out = torch.empty_like(q)
        if split_heads is None:
            split_heads = b < 4 * torch.get_num_threads()
        failed = fn(
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            int(k_pool.dtype == torch.bfloat16),
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
            int(bool(split_heads)),
            out.data_ptr(),
        )
        if failed:
            raise MemoryError("paged decode attention: the kernel could not allocate its score scratch")
        return out if query.dtype == torch.float32 else out.to(query.dtype)


def _decode_batch(
    num_seqs: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
):
    """A synthetic decode step (query, pools, metadata) of ``num_seqs`` sequences of ``context`` tokens."""
    from ..paged_cache import AttentionMetadata

    blocks = -(-context // block_size)
    g = torch.Generator().manual_seed(0)
    pool_shape = (num_seqs * blocks, block_size, num_kv_heads, head_dim)
    k_pool = torch.randn(pool_shape, generator=g).to(dtype)
    v_pool = torch.randn(pool_shape, generator=g).to(dtype)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(dtype)
    tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    lens = [context] * num_seqs
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.long),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=num_seqs,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc_cpu=list(range(num_seqs + 1)),
        seq_lens_cpu=lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
    )
    return query, k_pool, v_pool, meta


def measure_decode_paths(
    kernel: CPUDecodeKernel, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
) -> dict[str, float]:
    """Seconds per call of the compiled kernel and of the torch path for one layer's decode
    attention, summed over two steps: 16 sequences of 256 tokens and 2 of 512 (a full batch and the
    tail). Minimum of 3 calls each, the two paths interleaved."""
    from .torch_paged import torch_paged_attention

    totals = {"kernel": 0.0, "torch": 0.0}
    for num_seqs, context in ((16, 256), (2, 512)):
        q, k, v, meta = _decode_batch(num_seqs, context, num_heads, num_kv_heads, head_dim, block_size, dtype)
        best = {"kernel": float("inf"), "torch": float("inf")}
        paths = {"kernel": kernel, "torch": None}
        with torch.inference_mode():
            for _ in range(4):  # the first round warms both up
                for name, decode_kernel in paths.items():
                    meta._derived.clear()  # a step's derived tensors are built once per step, as here
                    t0 = time.perf_counter()
                    torch_paged_attention(q, k, v, meta, head_dim**-0.5, decode_kernel=decode_kernel)
                    best[name] = min(best[name], time.perf_counter() - t0)
        for name in totals:
            totals[name] += best[name]
    return totals


def choose_decode_path(
    kernel: CPUDecodeKernel, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
) -> str:
    """Turn ``kernel`` off where the torch path is faster for this geometry on this CPU (measured by
    :func:`measure_decode_paths` once per CPU, torch version and kernel build, cached beside the
    C kernels). Returns a line saying what was chosen and the times, for the engine's log."""
    if not kernel.available:
        return f"decode attention: torch path ({kernel.error or 'kernel disabled'})"
    source = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    geometry = (num_heads, num_kv_heads, head_dim, block_size, str(dtype), torch.get_num_threads())
    key = "|".join(map(str, (cpu_id(), torch.__version__, source, *geometry)))
    path = cache_dir() / f"decode_choice_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        times = json.loads(path.read_text())
    except (OSError, ValueError):
        times = measure_decode_paths(kernel, num_heads, num_kv_heads, head_dim, block_size, dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(times))
        except OSError:
            pass
    kernel.enabled = times["kernel"] <= times["torch"]
    chosen = "compiled kernel" if kernel.enabled else "torch path"
    return (
        f"decode attention: {chosen} (per layer, 16 x 256 + 2 x 512 tokens: kernel {1e3 * times['kernel']:.3f} ms, "
        f"torch {1e3 * times['torch']:.3f} ms)"
    )
