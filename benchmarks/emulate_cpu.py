"""Run a benchmark's child process as on a narrower CPU than this one: ``--emulate-cpu no-bf16``.

    python benchmarks/bench_breakdown.py --model medium --dtype bfloat16 --emulate-cpu no-bf16
    python benchmarks/bench_single.py --precisions fp32,bf16 --emulate-cpu no-bf16

``no-bf16`` is a CPU with AVX-512 and VNNI but no native half precision (no AVX512-BF16, AVX512-FP16
or AMX: a Cascade Lake / Ice Lake Xeon, the CPU issue 47 measured bfloat16 models 2.4x slower than
float32 on). The child process gets:

- our C libraries built without those instructions: ``HF_CONTBATCH_EMULATE_CPU`` (read by trees that
  know it, ``hf_contbatch.kernels.native_build.emulation_flags``) and the same flags in ``$CC`` (for
  older trees, ``tree=`` variants: GCC lets an explicit ``-mno-*`` win over ``-march=native``
  whatever their order);
- oneDNN, which serves torch's bfloat16 matmuls, capped by its documented
  ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI`` (no bf16, no AMX). Measured on a Sapphire Rapids core
  (torch 2.13, one thread, ``F.linear`` 960 -> 2560): bf16 at 32 rows 0.39 -> 4.47 ms (float32 1.42 ms),
  at 256 rows 1.0 -> 33 ms (float32 6.8 ms): torch's bf16 path slows down as on such a CPU;
  ATen's own vectorized kernels (``AVX512`` capability) use no bf16 instructions, so they need no cap;
- its own kernel cache (``$XDG_CACHE_HOME/emulate-<name>``): kernel builds and the tuner's timings
  of the emulated CPU never mix with this CPU's, whatever tree runs.

The emulation's compiler flags are read from this checkout's ``native_build.py`` (stdlib only), so
every tree benchmarked gets the same ones.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
from pathlib import Path

ONEDNN_ISA = {"no-bf16": "AVX512_CORE_VNNI"}
"""Emulated CPU -> oneDNN's ``ONEDNN_MAX_CPU_ISA`` value for it."""


def _native_build():
    path = Path(__file__).resolve().parent.parent / "hf_contbatch" / "kernels" / "native_build.py"
    spec = importlib.util.spec_from_file_location("_bench_native_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_argument(parser) -> None:
    """``--emulate-cpu NAME`` on a benchmark's argument parser (default: none, this CPU)."""
    parser.add_argument(
        "--emulate-cpu",
        default=None,
        choices=sorted(ONEDNN_ISA),
        help="run as on a narrower CPU (see benchmarks/emulate_cpu.py): no-bf16 = AVX-512 without "
        "AVX512-BF16/FP16 or AMX, for our C libraries and oneDNN",
    )


def child_env(name: str | None, base: dict | None = None) -> dict:
    """The environment of a child process emulating CPU ``name`` (``base``, default ``os.environ``,
    unchanged when ``name`` is None).

    Raises:
        ValueError: ``name`` is not an emulated CPU, or no C compiler is found for ``$CC``.
    """
    env = dict(os.environ if base is None else base)
    if name is None:
        return env
    if name not in ONEDNN_ISA:
        raise ValueError(f"unknown CPU to emulate {name!r} (known: {sorted(ONEDNN_ISA)})")
    build = _native_build()
    flags = build.EMULATIONS[name]
    cc = shlex.split(env["CC"]) if env.get("CC", "").strip() else [shutil.which("cc") or shutil.which("gcc") or ""]
    if not cc[0]:
        raise ValueError("no C compiler to emulate a CPU with (cc or gcc on PATH, or $CC)")
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env.update(
        {
            build.EMULATE_CPU_ENV: name,
            "CC": shlex.join([*cc, *flags]),
            build.ONEDNN_ISA_ENV: ONEDNN_ISA[name],
            "XDG_CACHE_HOME": os.path.join(cache, f"emulate-{name}"),
        }
    )
    return env


def emulating(name: str | None) -> bool:
    """Whether this process already runs under ``name``'s emulation (set by :func:`child_env`)."""
    return name is None or os.environ.get(_native_build().EMULATE_CPU_ENV) == name
