"""Ahead-of-time compile check of the Triton kernels for NVIDIA GPUs, on a machine without one.

Triton's interpreter (``TRITON_INTERPRET=1``, what the CPU tests use) accepts what real hardware
refuses: shared memory over the per-block limit, bf16 conversions on sm_75, register spills. This
module compiles, for a given compute capability, exactly the kernel variants the launchers in
:mod:`hf_contbatch.kernels.attention.triton_kernels` would launch there, down to a cubin with the ptxas that
ships in the ``triton`` wheel, and reports for each variant:

* ``shared``: bytes of shared memory the launch requests (``CompiledKernel.metadata.shared``),
  checked against the arch's opt-in per-block limit (:data:`triton_kernels.ARCH_SHARED_MEMORY`);
* ``registers`` / ``spill_stores`` / ``spill_loads``: from ``ptxas -v``;
* ``tensor_cores``: whether the PTX uses tensor-core instructions (``mma``/``wgmma``).

How a variant is obtained: the real launcher (``store_kv``, ``paged_decode_attention``,
``paged_prefill_attention``) is called on small CPU tensors with the ``@triton.jit`` kernels
replaced by recorders and the device limits replaced by the target arch's table entry, so grid,
constexprs, ``num_warps``/``num_stages`` and pointer dtypes are what a GPU run would get. The
recorded call is then bound and specialised as ``JITFunction.run`` does (Triton's private
``create_function_from_signature`` and ``_pack_args``, so the Triton range is pinned in
pyproject.toml) and compiled with ``triton.compile(..., target=GPUTarget("cuda", arch, 32))``.

The kernels must be real ``JITFunction`` objects, so this runs in its own process without
``TRITON_INTERPRET`` (:func:`run_plan` starts worker processes with a clean environment and a
fresh, temporary Triton cache: nothing compiled by an earlier run can hide a failure).

Command line (``python -m hf_contbatch.kernels.attention.triton_aot --plan sampled|full --arch 75 80``)
prints one JSON object per variant; ``benchmarks/triton_compile_table.py`` prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Optional

import torch

ARCHS = (75, 80, 86, 90)
"""Compute capabilities the check covers: T4, A100, A10 / RTX 30xx, H100 / H200."""

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Case:
    """One launcher call. ``kernel`` is "store_kv", "decode" or "prefill"; ``dtype`` the cache (and
    query) dtype; ``key_dtype`` the dtype of the keys stored by store_kv; ``num_splits`` forces the
    decode split (1 = single pass; > 1 also launches the reduce kernel); ``kv_int8``: an int8 cache
    with float32 scales (``dtype`` is then the query's and the stored keys' dtype)."""

    kernel: str
    dtype: str
    head_dim: int
    group: int = 1
    num_kv_heads: int = 1
    block_size: int = 16
    window: bool = False
    softcap: bool = False
    num_splits: int = 1
    key_dtype: Optional[str] = None
    kv_int8: bool = False

    def label(self) -> str:
        parts = [self.kernel, self.dtype, f"d{self.head_dim}"]
        if self.kernel == "store_kv":
            parts += [f"kvh{self.num_kv_heads}", f"from_{self.key_dtype or self.dtype}"]
        else:
            parts.append(f"g{self.group}")
            parts += (["window"] if self.window else []) + (["softcap"] if self.softcap else [])
            if self.kernel == "decode" and self.num_splits > 1:
                parts.append("split")
        parts.append(f"bs{self.block_size}")
        if self.kv_int8:
            parts.append("kv_int8")
        return "/".join(parts)


def _cases(head_dims, groups, dtypes, flags, block_sizes, kv_heads) -> list:
    cases = []
    for dtype in dtypes:
        for d in head_dims:
            for g in groups:
                for window, softcap in flags:
                    for bs in block_sizes:
                        cases.append(Case("prefill", dtype, d, g, block_size=bs, window=window, softcap=softcap))
                        for splits in (1, 4):
                            cases.append(
                                Case(
                                    "decode",
                                    dtype,
                                    d,
                                    g,
                                    block_size=bs,
                                    window=window,
                                    softcap=softcap,
                                    num_splits=splits,
                                )
                            )
            for kvh in kv_heads:
                for key_dtype in dtypes:
                    cases.append(Case("store_kv", dtype, d, num_kv_heads=kvh, key_dtype=key_dtype))
    return cases


def plan(name: str, archs: Iterable[int] = ARCHS) -> list:
    """The ``(case, arch)`` jobs of plan ``name`` for ``archs``.

    "full": every supported head size, GQA groups 1-64 (powers of two), window and softcap off and
    both on, both decode modes, all three dtypes, store_kv from every dtype into every dtype - about
    900 cases per arch, for ``benchmarks/triton_compile_table.py``.
    "corners": every head size and dtype at GQA groups 1, 7 and 64 with window, softcap and the
    split decode on (~140 per arch).
    "sampled": the corners that decide shared memory, registers and dtype support, for the test
    suite (about 30 compiles for the four archs): on every arch the common
    fp16 prefill (head size 128), the widest bf16 prefill (256, 64 query heads per KV head, window
    and softcap), the widest decode tile with its split reduce, and a bf16 store_kv conversion; the
    fp32 (FMA-path) tiles on sm_75 and sm_86, the archs with the least shared memory (fp32 tiles do
    not depend on the arch from sm_80 on); a bf16 decode with window and softcap on the
    tensor-core archs sm_80 and sm_90; on every arch the int8 KV cache's fp16 prefill, split
    decode and quantizing store.
    """
    archs = tuple(archs)
    if name == "full":
        cases = _cases(
            (16, 32, 64, 80, 96, 128, 256),
            (1, 2, 4, 8, 16, 32, 64),
            tuple(_DTYPES),
            ((False, False), (True, True)),
            (16,),
            (1, 8, 32),
        )
        return [(c, a) for a in archs for c in cases]
    if name == "corners":
        cases = [
            Case(kernel, dtype, d, g, window=True, softcap=True, num_splits=4 if kernel == "decode" else 1)
            for dtype in _DTYPES
            for d in (16, 32, 64, 80, 96, 128, 256)
            for g in (1, 7, 64)
            for kernel in ("prefill", "decode")
        ]
        cases += [
            Case("store_kv", dtype, d, num_kv_heads=8, key_dtype=key)
            for dtype in _DTYPES
            for key in _DTYPES
            for d in (64, 256)
        ]
        cases += [  # the int8 KV cache (CacheConfig(dtype="int8")): tiles dequantized into the query's dtype
            Case(
                kernel, dtype, d, g, window=True, softcap=True, num_splits=4 if kernel == "decode" else 1, kv_int8=True
            )
            for dtype in _DTYPES
            for d in (64, 128, 256)
            for g in (1, 8)
            for kernel in ("prefill", "decode", "store_kv")
        ]
        return [(c, a) for a in archs for c in cases]
    if name == "sampled":
        every = [
            Case("prefill", "fp16", 128, 1),
            Case("prefill", "bf16", 256, 64, window=True, softcap=True),
            Case("decode", "fp16", 256, 64, num_splits=4),
            Case("store_kv", "bf16", 128, num_kv_heads=8, key_dtype="fp16"),
            Case("prefill", "fp16", 128, 4, kv_int8=True),
            Case("decode", "fp16", 128, 8, window=True, softcap=True, num_splits=4, kv_int8=True),
            Case("store_kv", "fp16", 128, num_kv_heads=8, kv_int8=True),
        ]
        fp32 = [
            Case("prefill", "fp32", 256, 64),
            Case("prefill", "fp32", 64, 1),
            Case("decode", "fp32", 128, 1, num_splits=4),
            Case("store_kv", "fp16", 256, num_kv_heads=32, key_dtype="fp32"),
        ]
        tensor = [Case("decode", "bf16", 128, 8, window=True, softcap=True)]
        jobs = [(c, a) for a in archs for c in every]
        jobs += [(c, a) for a in archs if a in (75, 86) for c in fp32]
        jobs += [(c, a) for a in archs if a in (80, 90) for c in tensor]
        return jobs
    raise ValueError(f"`plan` must be 'full' or 'sampled', got {name!r}")


# ----------------------------------------------------------------------------------------------
# Recording the launches a case makes.
# ----------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.fn, grid, args, kwargs))

        return launch


# Each kernel by the module whose launcher looks it up (where it is replaced by a _Recorder).
_KERNEL_NAMES = (
    ("triton_launch", "_store_kv_kernel"),
    ("triton_decode", "_paged_decode_kernel"),
    ("triton_decode", "_decode_reduce_kernel"),
    ("triton_prefill", "_paged_prefill_kernel"),
)
# The host functions that ask the device, replaced so that a launcher runs as on ``arch``.
_DEVICE_QUERIES = (
    ("triton_launch", "_check_device"),
    ("triton_launch", "_device_limits"),
    ("triton_launch", "_is_interpreted"),
)


def record_launches(case: Case, arch: int) -> list:
    """Call the real launcher for ``case`` as on a device of compute capability ``arch``.

    Returns ``[(jit_function, grid, args, kwargs), ...]``. Raises what the launcher raises (for
    example the ValueError refusing bf16 below sm_80).
    """
    import importlib

    from . import triton_kernels as tk

    launches: list = []
    limits = tk.arch_limits(arch)
    modules = {name: importlib.import_module(f"{__package__}.{name}") for name, _ in _KERNEL_NAMES + _DEVICE_QUERIES}
    saved = {(m, name): getattr(modules[m], name) for m, name in _KERNEL_NAMES + _DEVICE_QUERIES}
    stand_ins = {
        "_check_device": lambda tensors: None,
        "_device_limits": lambda device: limits,
        "_is_interpreted": lambda: False,
    }
    try:
        for m, name in _KERNEL_NAMES:
            setattr(modules[m], name, _Recorder(saved[(m, name)], launches))
        for m, name in _DEVICE_QUERIES:
            setattr(modules[m], name, stand_ins[name])
        _call_launcher(tk, case)
    finally:
        for (m, name), value in saved.items():
            setattr(modules[m], name, value)
    return launches


def _call_launcher(tk, case: Case) -> None:
    dtype = _DTYPES[case.dtype]
    kvh = case.num_kv_heads
    heads = kvh * case.group
    d, bs = case.head_dim, case.block_size
    k_cache = torch.zeros(4, bs, kvh, d, dtype=torch.int8 if case.kv_int8 else dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = {}
    if case.kv_int8:
        scales = {"k_scale": torch.zeros(4, bs, kvh, 1), "v_scale": torch.zeros(4, bs, kvh, 1)}
    if case.kernel == "store_kv":
        key = torch.zeros(3, kvh, d, dtype=_DTYPES[case.key_dtype or case.dtype])
        tk.store_kv(key, key.clone(), k_cache, v_cache, torch.arange(3, dtype=torch.int64), **scales)
        return
    window = 64 if case.window else None
    softcap = 30.0 if case.softcap else None
    block_tables = torch.zeros(2, 4, dtype=torch.int32)
    seq_lens = torch.tensor([3, 2], dtype=torch.int32)
    if case.kernel == "decode":
        query = torch.zeros(2, heads, d, dtype=dtype)
        tk.paged_decode_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            d**-0.5,
            sliding_window=window,
            softcap=softcap,
            max_seq_len=4 * bs,
            num_splits=case.num_splits,
            **scales,
        )
    elif case.kernel == "prefill":
        query = torch.zeros(5, heads, d, dtype=dtype)
        qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
        tk.paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            qsl,
            3,
            d**-0.5,
            sliding_window=window,
            softcap=softcap,
            **scales,
        )
    else:
        raise ValueError(f"unknown kernel {case.kernel!r}")


# ----------------------------------------------------------------------------------------------
# Compiling a recorded launch.
# ----------------------------------------------------------------------------------------------

_PTXAS_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_launch(fn, args, kwargs, arch: int) -> dict:
    """Compile one recorded launch for ``sm_{arch}``; returns name, shared, registers, spills,
    tensor_cores, num_warps, num_stages and constexprs. Compile errors propagate."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    # What JITFunction.run adds before binding (Triton 3.9).
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True
    with contextlib.redirect_stdout(log):
        ck = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    text = log.getvalue()
    regs = [int(m) for m in _PTXAS_RE.findall(text)]
    spills = [(int(a), int(b)) for a, b in _SPILL_RE.findall(text)]
    ptx = ck.asm["ptx"]
    names = [p.name for p in fn.params]
    return {
        "name": fn.__name__,
        "shared": int(ck.metadata.shared),
        "registers": max(regs) if regs else None,
        "spill_stores": max((s for s, _ in spills), default=0),
        "spill_loads": max((s for _, s in spills), default=0),
        "tensor_cores": "wgmma" if "wgmma" in ptx else ("mma" if re.search(r"\bmma\.sync", ptx) else "none"),
        "num_warps": options.num_warps,
        "num_stages": options.num_stages,
        "constexprs": {names[k[0]]: v for k, v in constexprs.items() if isinstance(v, (int, bool))},
    }


def check_case(case: Case, arch: int) -> dict:
    """Record and compile ``case`` for ``arch``. Returns a dict with the case, arch, the shared-memory
    limit, and either ``kernels`` (one result per launch) or ``refused`` (the launcher's ValueError)
    or ``error`` (a compile failure)."""
    from . import triton_kernels as tk

    result = {
        "case": dataclasses.asdict(case),
        "label": case.label(),
        "arch": arch,
        "limit": tk.arch_limits(arch).shared_memory_per_block,
    }
    try:
        launches = record_launches(case, arch)
    except ValueError as e:
        result["refused"] = str(e)
        return result
    kernels = []
    for fn, _grid, args, kwargs in launches:
        try:
            kernels.append(compile_launch(fn, args, kwargs, arch))
        except Exception as e:  # noqa: BLE001 - reported, the caller asserts on it
            result["error"] = f"{fn.__name__}: {type(e).__name__}: {str(e)[:2000]}"
            break
    result["kernels"] = kernels
    return result


def _worker(job) -> dict:
    case, arch = job
    return check_case(case, arch)


def _init_worker() -> None:
    torch.set_num_threads(1)


def iter_plan(jobs: Iterable[tuple], workers: Optional[int] = None):
    """Check every ``(case, arch)`` job in a pool of fresh processes, yielding results in job order.

    The workers run without ``TRITON_INTERPRET`` and with a new, empty ``TRITON_CACHE_DIR`` that is
    deleted afterwards, so nothing compiled by an earlier run can hide a failure. From a process
    that set ``TRITON_INTERPRET=1`` (the interpreter tests) use :func:`run_plan_subprocess`.
    """
    import multiprocessing

    jobs = list(jobs)
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    saved = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_INTERPRET")}
    with tempfile.TemporaryDirectory(prefix="hf_contbatch_triton_aot_") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        os.environ.pop("TRITON_INTERPRET", None)
        try:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker) as pool:
                yield from pool.map(_worker, jobs, chunksize=1)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def run_plan(jobs: Iterable[tuple], workers: Optional[int] = None) -> list:
    """:func:`iter_plan` as a list."""
    return list(iter_plan(jobs, workers))


def run_plan_subprocess(
    plan_name: str, archs: Iterable[int] = ARCHS, workers: Optional[int] = None, timeout: Optional[float] = None
) -> list:
    """:func:`run_plan` for plan ``plan_name`` in a child Python process with a clean environment
    (safe to call from a process that set ``TRITON_INTERPRET=1``). Returns the results."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    cmd = [
        sys.executable,
        "-m",
        "hf_contbatch.kernels.attention.triton_aot",
        "--plan",
        plan_name,
        "--arch",
        *map(str, archs),
    ]
    if workers:
        cmd += ["--workers", str(workers)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="sampled", choices=("sampled", "corners", "full"))
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    for result in iter_plan(plan(args.plan, args.arch), args.workers):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
