"""A compiled CPU kernel for paged prefill attention (prompt chunks over their context, float32 or
bfloat16 pools), built on first use with the system C compiler, and the timing that decides whether
it serves on this CPU.

Why: the torch path (``torch_paged``) gathers each prefill request's context out of the pool and runs
``scaled_dot_product_attention`` per request, with a boolean mask whenever the chunk does not start
at position 0 (chunked prefill, prefix-cache hits) and a repeat of K/V for softcap; on CPU that runs
far below the FMA peak at prompt lengths of a few hundred tokens. The kernel (``cpu_prefill.c``) is
FlashAttention's tiled online softmax (Dao et al., 2022) reading K/V in place through the block
table, with all query heads of a KV head sharing each key and value load. Same build and cache as
the decode kernel (``native_build``; plain C, no torch headers, torch's OpenMP runtime); without a
compiler, or if the build fails, the torch path serves and one warning says why.

Set ``HF_CONTBATCH_CPU_KERNEL=0`` (all compiled attention kernels) or ``HF_CONTBATCH_CPU_PREFILL=0``
(this one only) to keep the torch path.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from ..native_build import LoadedOnce, build_library
from ..tuning import attention_choice_key, attention_tuner
from .cpu_kernel import allowed_by_env as _all_kernels_allowed
from .kv_quant import quantize_kv
from .metadata import AttentionMetadata

PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill.c")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-strict-aliasing", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""KV pool dtypes the kernel reads (bfloat16 and float16 widened to float32 as it reads: exact;
float16 where the build has it, :meth:`CPUPrefillKernel.reads`)."""
_POOL_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 3}  # cpu_prefill.c's DT_* codes


def build_prefill_library() -> Path:
    """Path of the compiled prefill kernel, compiled now when the cache has none for this source,
    compiler and CPU (errors as ``native_build.build_library``)."""
    return build_library(PREFILL_SOURCE, _FLAGS)


def _load(path: Path):
    """(float prefill attention, int8 prefill attention) functions of the built library, and whether
    it reads float16 pools."""
    lib = ctypes.CDLL(str(path))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    tail = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, f32, i64, i64, ptr, i64, i64]
    fn = lib.hf_contbatch_paged_prefill
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, *tail]
    fn.restype = i64
    fn_q8 = lib.hf_contbatch_paged_prefill_q8
    fn_q8.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, *tail, i64]
    fn_q8.restype = i64
    return fn, fn_q8, bool(lib.hf_contbatch_prefill_has_f16())


def allowed_by_env() -> bool:
    """False when ``HF_CONTBATCH_CPU_KERNEL=0`` or ``HF_CONTBATCH_CPU_PREFILL=0`` is set: the torch
    path serves prefill attention and nothing is built."""
    return _all_kernels_allowed() and os.environ.get("HF_CONTBATCH_CPU_PREFILL", "1") != "0"


class CPUPrefillKernel:
    """Per-engine handle on the compiled prefill kernel (the build is cached on disk and loaded on
    first use). ``enabled`` is what :func:`choose_prefill_path` decided (default: the environment
    allows it); ``available`` is False where the kernel cannot serve: no compiler, a failed build, or
    turned off by the environment or the timing."""

    def __init__(self) -> None:
        self._kernel = LoadedOnce(
            lambda: _load(build_prefill_library()), "compiled CPU prefill attention", "the torch path"
        )
        self.enabled = allowed_by_env()

    @property
    def available(self) -> bool:
        return self.enabled and self._kernel.get() is not None

    @property
    def error(self) -> Optional[str]:
        return self._kernel.error

    def reads(self, dtype: torch.dtype) -> bool:
        """Whether the built kernel reads pools of ``dtype`` (float32 and bfloat16; float16 where
        the compiler has ``_Float16``); False where it is not built."""
        lib = self._kernel.get()
        return lib is not None and dtype in POOL_DTYPES and (dtype != torch.float16 or lib[2])

    def can_serve(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
        """CPU tensors, a floating-point query with unit stride in the head dimension, pools of a
        dtype the kernel :meth:`reads` (float32, bfloat16, float16), contiguous and of one shape, and
        the kernel built and enabled."""
        return self.reads(k_pool.dtype) and v_pool.dtype == k_pool.dtype and self._layout_ok(query, k_pool, v_pool)

    def can_serve_int8(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
        """As :meth:`can_serve` for int8 pools (their float32 scales are contiguous ``[blocks,
        block_size, KVH, 1]`` tensors, as ``PagedKVCache`` allocates them)."""
        return k_pool.dtype == torch.int8 and v_pool.dtype == torch.int8 and self._layout_ok(query, k_pool, v_pool)

    def _layout_ok(self, query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
        """What both pool dtypes need: a float query with unit last stride, contiguous pools of one
        shape, all on the CPU, and the kernel built and enabled."""
        return (
            query.is_floating_point()
            and query.is_cpu
            and k_pool.is_cpu
            and v_pool.is_cpu
            and query.stride(-1) == 1
            and k_pool.is_contiguous()
            and v_pool.is_contiguous()
            and v_pool.shape == k_pool.shape
            and self.available
        )

    def __call__(
        self,
        query: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        softcap: Optional[float] = None,
        sliding_window: Optional[int] = None,
        out: Optional[torch.Tensor] = None,
        k_scale: Optional[torch.Tensor] = None,
        v_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Attention of the prefill rows of ``query`` ``[T, H, D]`` (requests ``meta.num_decodes``
        onwards; rows ``meta.query_start_loc_cpu[num_decodes]:``) over the paged pools ``[blocks,
        block_size, KVH, D]``, which already hold this step's K/V; ``scale``, ``softcap`` and
        ``sliding_window`` as in ``torch_paged.torch_paged_attention``. Writes those rows of ``out``
        (``[T, H, D]`` in the query's dtype, unit stride in D; allocated when None; decode rows left
        untouched) and returns it. Computed in float32. Call only where :meth:`can_serve` is True;
        or, for int8 pools with float32 ``k_scale``/``v_scale`` ``[blocks, block_size, KVH, 1]``
        (``kv_quant``'s layout: each row dequantized as ``q * scale`` in float32 as it is read),
        where :meth:`can_serve_int8` is.

        Raises:
            MemoryError: the kernel's task list or per-thread scratch could not be allocated.
        """
        fn, fn_q8, _ = self._kernel.get()
        nd = meta.num_decodes
        if out is None:
            out = torch.empty_like(query)
        row0 = meta.query_start_loc_cpu[nd]
        if row0 == query.shape[0]:
            return out
        tables, qsl, lens = meta.derived(
            ("prefill_kernel",),
            lambda: (
                meta.block_tables.to(torch.int32).contiguous(),
                meta.query_start_loc.to(torch.int32).contiguous(),
                meta.seq_lens.to(torch.int32).contiguous(),
            ),
        )
        direct = query.dtype == torch.float32 and out.dtype == torch.float32 and out.stride(-1) == 1
        if direct:  # read the query and write the output where they are
            q, dst, base = query, out, 0
        else:
            q = query[row0:].to(torch.float32)
            dst, base = torch.empty(q.shape, dtype=torch.float32), row0
        _, block_size, kvh, head_dim = k_pool.shape
        extra = ()
        if k_scale is not None:
            k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()  # held until the call returns
            fn, pools = fn_q8, (k_pool.data_ptr(), v_pool.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr())
            # A bfloat16 query (widened above: every element still a bfloat16 value) lets the kernel
            # form int8-key scores with bfloat16 dot products (exact products, float32 sums).
            extra = (int(query.dtype == torch.bfloat16),)
        else:
            pools = (k_pool.data_ptr(), v_pool.data_ptr(), _POOL_KIND[k_pool.dtype])
        failed = fn(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            *pools,
            tables.data_ptr(),
            tables.stride(0),
            qsl.data_ptr(),
            lens.data_ptr(),
            nd,
            meta.num_requests,
            base,
            query.shape[1],
            kvh,
            head_dim,
            block_size,
            float(scale),
            float(softcap) if softcap else 0.0,
            int(sliding_window) if sliding_window else 0,
            torch.get_num_threads(),
            dst.data_ptr(),
            dst.stride(0),
            dst.stride(1),
            *extra,
        )
        if failed:
            raise MemoryError("paged prefill attention: the kernel could not allocate its task list or scratch")
        if not direct:
            out[row0:] = dst
        return out


# --- the choice: kernel or torch path, timed on this machine --------------------------------------

PREFILL_SHAPES = ((1, 192, 192), (1, 64, 512), (4, 96, 96))
"""Steps the choice times, as (requests, query tokens each, context each): a fresh prompt, a chunk
after 448 cached tokens (chunked prefill, prefix-cache hit), and four short prompts."""


def _prefill_batch(num_reqs, q_len, seq_len, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """A synthetic prefill step: query, pools, metadata, the step's own K/V ``[KVH, T, D]`` and the
    pools' scales (``dtype`` int8: normal K/V quantized by ``kv_quant``, scales as keywords
    ``k_scale``/``v_scale``, a float32 query; else ``{}``)."""
    blocks = -(-seq_len // block_size)
    g = torch.Generator().manual_seed(0)
    pool_shape = (num_reqs * blocks, block_size, num_kv_heads, head_dim)
    k_pool = torch.randn(pool_shape, generator=g)
    v_pool = torch.randn(pool_shape, generator=g)
    scales = {}
    if dtype == torch.int8:
        # Quantized normal rows, as a model's K/V are stored: random int8 with arbitrary scales
        # would make scores of hundreds, whose softmax underflows into subnormals (slow on x86)
        # in the torch path: a timing of something no model computes.
        (k_pool, k_scale), (v_pool, v_scale) = quantize_kv(k_pool), quantize_kv(v_pool)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        dtype = torch.float32
    else:
        k_pool, v_pool = k_pool.to(dtype), v_pool.to(dtype)
    # The query as the model hands it over: a [T, H, D] view of a [1, H, T, D] tensor.
    query = torch.randn(1, num_heads, num_reqs * q_len, head_dim, generator=g).to(dtype)[0].transpose(0, 1)
    tables = torch.arange(num_reqs * blocks, dtype=torch.int32).view(num_reqs, blocks)
    qsl = [i * q_len for i in range(num_reqs + 1)]
    lens = [seq_len] * num_reqs
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=0,
        max_query_len=q_len,
        max_seq_len=seq_len,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
    )
    # This step's K/V rows as the model passes them ([KVH, T, D]); for a whole-context chunk the
    # torch path reads these instead of gathering from the pool.
    flat_k = k_pool.view(num_reqs, -1, num_kv_heads, head_dim)[:, seq_len - q_len : seq_len]
    flat_v = v_pool.view(num_reqs, -1, num_kv_heads, head_dim)[:, seq_len - q_len : seq_len]
    key = flat_k.reshape(-1, num_kv_heads, head_dim).transpose(0, 1)
    value = flat_v.reshape(-1, num_kv_heads, head_dim).transpose(0, 1)
    return query, k_pool, v_pool, meta, key, value, scales


def measure_prefill_paths(
    kernel: CPUPrefillKernel, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype, rounds: int = 5
) -> dict[str, float]:
    """CPU seconds per layer of the compiled kernel and of the torch path (``dtype`` int8: int8 pools
    with scales, each path's int8 variant), summed over the steps of :data:`PREFILL_SHAPES`: per step the median of ``rounds`` calls each, the two paths interleaved
    (A B A B ...) after one warm-up round.

    Both run on the calling thread alone (torch's thread count set to 1 for the measurement and
    restored) and are timed in that thread's CPU time: what is compared is the work each path does,
    which load from other processes does not change, whereas the wall time of a parallel region on
    a busy machine is mostly the wait for a core (measured at 2 threads under load: milliseconds
    for either path where the work is tens of microseconds). Both paths split their work across
    threads alike (the kernel by (request, KV head, query tile), SDPA by (request, head)).
    """
    from .torch_paged import torch_paged_attention

    totals = {"kernel": 0.0, "torch": 0.0}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for num_reqs, q_len, seq_len in PREFILL_SHAPES:
            q, k, v, meta, key, value, scales = _prefill_batch(
                num_reqs, q_len, seq_len, num_heads, num_kv_heads, head_dim, block_size, dtype
            )
            times: dict[str, list[float]] = {"kernel": [], "torch": []}
            with torch.inference_mode():
                for i in range(rounds + 1):
                    for name in times:
                        meta._derived.clear()  # a step's derived tensors are built once per step, as here
                        t0 = time.thread_time()
                        if name == "kernel":
                            kernel(q, k, v, meta, head_dim**-0.5, **scales)
                        else:
                            torch_paged_attention(q, k, v, meta, head_dim**-0.5, key=key, value=value, **scales)
                        if i:
                            times[name].append(time.thread_time() - t0)
            for name in totals:
                totals[name] += statistics.median(times[name])
    finally:
        torch.set_num_threads(threads)
    return totals


def choose_prefill_path(
    kernel: CPUPrefillKernel, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
) -> str:
    """Turn ``kernel`` off where the torch path is faster for this geometry on this CPU (measured by
    :func:`measure_prefill_paths` once per CPU, torch version, kernel source and geometry, cached
    beside the C kernels). Returns a line for the engine's log."""
    if not kernel.available:
        return f"prefill attention: torch path ({kernel.error or 'kernel disabled'})"
    if dtype != torch.int8 and not kernel.reads(dtype):
        kernel.enabled = False
        return f"prefill attention: torch path (no {dtype} kernel in this build)"
    # Measured on one thread (measure_prefill_paths): the thread count is no part of the key.
    tuner = attention_tuner(PREFILL_SOURCE, 1, "prefill attention")
    winner, times = tuner.fastest(
        attention_choice_key("prefill", num_heads, num_kv_heads, head_dim, block_size, dtype),
        lambda: measure_prefill_paths(kernel, num_heads, num_kv_heads, head_dim, block_size, dtype),
    )
    kernel.enabled = winner == "kernel"
    chosen = "compiled kernel" if kernel.enabled else "torch path"
    return (
        f"prefill attention: {chosen} (per layer, one thread, 192 + 64 of 512 + 4 x 96 tokens: "
        f"kernel {1e3 * times['kernel']:.3f} ms, torch {1e3 * times['torch']:.3f} ms)"
    )
