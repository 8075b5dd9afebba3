"""A compiled CPU kernel for paged decode attention (float32 or bfloat16 pools), built on first use
with the system C compiler.

Why: the plain-torch decode path gathers every request's keys out of the pool each layer and runs
small batched matmuls (two query rows per KV head). The kernel reads keys and values in place, each
key and value row loaded once for all its query heads, with the head dimension a compile-time
constant and the next page prefetched. A request's keys are cut into partitions of 64 tokens whose
partial softmax results are combined at the end (split-K, as flash-decoding): with many requests
one OpenMP task per request, with few one per partition (and KV head), so that one long context
spreads over every thread. Outputs are unchanged (``benchmarks/bench_breakdown.py`` compares the two paths,
variants ``default;tree=PATH``). The kernel (``cpu_decode.c``) is plain C with no torch headers, so
it compiles quickly (``cc -O3 -march=native -ffast-math -fopenmp``), is cached per source, compiler
and CPU (``hf_contbatch.kernels.native_build``), and runs on torch's own OpenMP runtime. Without a C
compiler, or if the build fails, the torch path serves and one warning says why.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Optional

import torch

from ..native_build import LoadedOnce, build_library

DECODE_SOURCE = Path(__file__).with_name("cpu_decode.c")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def build_decode_library() -> Path:
    """Path of the compiled decode kernel, compiled now when the cache has none for this source,
    compiler and CPU (errors as ``native_build.build_library``)."""
    return build_library(DECODE_SOURCE, _FLAGS)


def _load(path: Path):
    """(decode attention, KV store, int8 decode attention, int8 KV store) functions of the built
    library, and whether it reads float16 pools."""
    lib = ctypes.CDLL(str(path))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    fn = lib.hf_contbatch_paged_decode
    # (q, pools..., tables, lens, seqs, max blocks, heads, KV heads, head dim, block, scale, softcap,
    # window, split heads, split context, threads, out): cpu_decode.c's order.
    sizes = [i64] * 6 + [f32, f32] + [i64] * 4
    fn.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, *sizes, ptr]
    fn.restype = i64
    store = lib.hf_contbatch_store_kv
    store.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    store.restype = None
    fn_q8 = lib.hf_contbatch_paged_decode_q8
    fn_q8.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, *sizes, ptr]
    fn_q8.restype = i64
    store_q8 = lib.hf_contbatch_store_kv_q8
    store_q8.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
    store_q8.restype = None
    return fn, store, fn_q8, store_q8, bool(lib.hf_contbatch_decode_has_f16())


def allowed_by_env() -> bool:
    """False when ``HF_CONTBATCH_CPU_KERNEL=0`` is set: the torch paths serve, nothing is built."""
    return os.environ.get("HF_CONTBATCH_CPU_KERNEL", "1") != "0"


POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""KV pool dtypes the kernel reads (bfloat16 and float16 widened to float32 as it reads: exact;
float16 where the build has it, :meth:`CPUDecodeKernel.reads`)."""
_POOL_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 3}  # cpu_decode.c's DT_* codes
_Q8_INPUTS = (torch.float32, torch.bfloat16)  # what the int8 store quantizes from


class CPUDecodeKernel:
    """Per-engine handle on the compiled kernel (the build is cached on disk; each engine loads it
    on its first decode step). ``available`` is False where the kernel cannot serve: no compiler,
    a failed build, or ``HF_CONTBATCH_CPU_KERNEL=0`` in the environment."""

    def __init__(self) -> None:
        self._kernel = LoadedOnce(
            lambda: _load(build_decode_library()), "compiled CPU decode attention", "the torch path"
        )
        self.enabled = allowed_by_env()

    @property
    def available(self) -> bool:
        return self.enabled and self._kernel.get() is not None

    @property
    def built_ok(self) -> bool:
        """Whether the library is usable at all (the KV store serves even where the decode path chose
        the torch attention); False under ``HF_CONTBATCH_CPU_KERNEL=0``."""
        return allowed_by_env() and self._kernel.get() is not None

    @property
    def error(self) -> Optional[str]:
        return self._kernel.error

    def reads(self, dtype: torch.dtype) -> bool:
        """Whether the built kernel reads pools of ``dtype`` (float32 and bfloat16; float16 where
        the compiler has ``_Float16``); False where it is not built."""
        lib = self._kernel.get()
        return lib is not None and dtype in POOL_DTYPES and (dtype != torch.float16 or lib[4])

    def entry_points(self) -> Optional[tuple[int, int]]:
        """Addresses of the built float-pool decode attention and K/V store functions (the C entry
        points ``hf_contbatch_paged_decode`` and ``hf_contbatch_store_kv``), for native callers
        (``kernels.decode_program``); None where the kernel is not :attr:`available`."""
        lib = self._kernel.get() if self.enabled else None
        if lib is None:
            return None
        return ctypes.cast(lib[0], ctypes.c_void_p).value, ctypes.cast(lib[1], ctypes.c_void_p).value

    def can_serve(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
        """CPU tensors, the query float32 or of the pools' dtype, pools of a dtype the kernel
        :meth:`reads` (float32, bfloat16, float16), both contiguous and of one shape (the kernel
        reads them as dense ``[blocks, block_size, KVH, D]`` arrays), and the kernel built."""
        return (
            self.reads(k_pool.dtype)
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

    def can_serve_int8(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
        """As :meth:`can_serve` for int8 pools (their float32 scales are contiguous
        ``[blocks, block_size, KVH, 1]`` tensors, as ``PagedKVCache`` allocates them)."""
        return (
            k_pool.dtype == torch.int8
            and v_pool.dtype == torch.int8
            and query.dtype in (torch.float32, torch.bfloat16)
            and query.is_cpu
            and k_pool.is_cpu
            and v_pool.is_cpu
            and k_pool.is_contiguous()
            and v_pool.is_contiguous()
            and v_pool.shape == k_pool.shape
            and self.available
        )

    def store_int8(self, key, value, k_pool, v_pool, k_scale, v_scale, slot_mapping) -> bool:
        """Quantize this step's K and V rows (``kv_quant``'s scheme) and write them and their scales
        into their slots in one call, if this kernel can: ``key``/``value`` ``[T, KVH, D]`` float32 or
        bfloat16 (unit stride in D), int8 pools, float32 scales ``[blocks, block_size, KVH, 1]``,
        all contiguous on the CPU, ``slot_mapping`` int64 ``[T]``. Returns False (nothing written)
        where it cannot: the caller stores them itself."""
        lib = self._kernel.get() if self.built_ok else None
        pools = (k_pool, v_pool, k_scale, v_scale)
        if (
            lib is None
            or key.dtype not in _Q8_INPUTS
            or value.dtype != key.dtype
            or k_pool.dtype != torch.int8
            or v_pool.dtype != torch.int8
            or k_scale.dtype != torch.float32
            or v_scale.dtype != torch.float32
            or not all(t.is_cpu and t.is_contiguous() for t in pools)
            or not (key.is_cpu and value.is_cpu)
            or key.stride(-1) != 1
            or value.stride(-1) != 1
            or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous()
            or key.shape != value.shape
            or key.shape[1:] != k_pool.shape[2:]
            or k_scale.shape[:3] != k_pool.shape[:3]
            or v_scale.shape != k_scale.shape
        ):
            return False
        t, kvh, d = key.shape
        lib[3](
            key.data_ptr(),
            value.data_ptr(),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            k_scale.data_ptr(),
            v_scale.data_ptr(),
            slot_mapping.data_ptr(),
            t,
            kvh,
            d,
            int(key.dtype == torch.bfloat16),
        )
        return True

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
        (float32, bfloat16 or float16: a copy), CPU, ``slot_mapping`` int64 ``[T]``. Returns False (nothing
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
        k_scale: Optional[torch.Tensor] = None,
        v_scale: Optional[torch.Tensor] = None,
        split_context: Optional[bool] = None,
    ) -> torch.Tensor:
        """Decode attention of ``query`` ``[b, H, D]`` over the paged pools ``[blocks, block_size,
        KVH, D]``, with ``block_tables`` ``[b, max_blocks]`` and ``seq_lens`` ``[b]`` (int32 and
        contiguous is what the kernel reads; other integer tensors are converted per call);
        ``scale`` multiplies q.k, ``softcap``/``sliding_window`` as in the torch path.

        Each sequence's attended keys are cut into partitions of 64 tokens whose partial softmax
        results are combined (``cpu_decode.c``, "Partitions"), so a sequence's output has the same
        bits whichever work split ran and whatever else is in the batch. Work split, chosen by the
        kernel from the batch and ``torch.get_num_threads()`` where None: ``split_context``, one
        task per partition instead of per sequence (default: fewer than four sequences per thread,
        so one long context spreads over the threads); ``split_heads``, each task cut further into
        one per KV head (default: still fewer than four tasks per thread).
        Pools float32, bfloat16 or float16; or int8 with float32 ``k_scale``/``v_scale`` ``[blocks,
        block_size, KVH, 1]`` (contiguous; each key's dot product and each value's weight times
        its token-head scale). The query is computed with in float32 and the result returned
        in the query's dtype, ``[b, H, D]``. Call only when :meth:`can_serve` is True (otherwise
        there is no kernel to call and this raises ``TypeError``).

        Raises:
            MemoryError: the kernel's scratch (a few KB per task) could not be allocated.
        """
        lib = self._kernel.get()
        # Conversions only where needed: this runs once per layer per step.
        q = query if query.dtype == torch.float32 and query.is_contiguous() else query.to(torch.float32).contiguous()
        tables, lens = block_tables, seq_lens
        if tables.dtype != torch.int32 or not tables.is_contiguous():
            tables = tables.to(torch.int32).contiguous()
        if lens.dtype != torch.int32 or not lens.is_contiguous():
            lens = lens.to(torch.int32).contiguous()
        b, num_heads, head_dim = q.shape
        _, block_size, kvh, _ = k_pool.shape
        out = torch.empty((b, num_heads, head_dim))
        sizes = (
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
            -1 if split_heads is None else int(split_heads),  # -1: the kernel decides
            -1 if split_context is None else int(split_context),
            torch.get_num_threads(),
            out.data_ptr(),
        )
        if k_scale is None:
            failed = lib[0](q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), _POOL_KIND[k_pool.dtype], *sizes)
        else:
            k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()  # held until the call returns
            failed = lib[2](
                q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), *sizes
            )
        if failed:
            raise MemoryError("paged decode attention: the kernel could not allocate its scratch")
        return out if query.dtype == torch.float32 else out.to(query.dtype)
