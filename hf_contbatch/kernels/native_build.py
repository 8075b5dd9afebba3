"""Build and cache our small C kernels with the system C compiler (no torch headers: quick builds).

A library is compiled once per source text, compiler, flags and CPU (``-march=native``) into
``$XDG_CACHE_HOME/hf_contbatch`` (default ``~/.cache``) and reused by later processes; it is
loaded with ctypes and runs on torch's own OpenMP runtime (the same ``libgomp.so.1``). Used by
``hf_contbatch.kernels.attention.cpu_kernel`` (paged decode attention) and ``hf_contbatch.kernels.linears.native_gemm``
(the packed GEMM).

``HF_CONTBATCH_EMULATE_CPU=no-bf16`` (read when a library is built or looked up, so set it before
the process's first engine; :func:`emulation_flags`) builds every one of them as for a CPU without
native half precision (no AVX512-BF16, AVX512-FP16, AMX or AVX-VNNI instructions: an AVX-512 Xeon of
the Cascade Lake / Ice Lake kind), whatever this CPU has: benchmarks and tests run the code such a
CPU gets. Never a default.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/hf_contbatch``, default
    ``~/.cache/hf_contbatch`` (created on the first build)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_contbatch"


EMULATE_CPU_ENV = "HF_CONTBATCH_EMULATE_CPU"
"""The environment variable naming a narrower CPU our C libraries are built for (:data:`EMULATIONS`)."""
EMULATIONS: dict[str, tuple[str, ...]] = {
    # After -march=native: the CPU's other extensions stay (AVX-512, VNNI, F16C conversions).
    "no-bf16": (
        "-mno-avx512bf16",
        "-mno-avx512fp16",
        "-mno-amx-tile",
        "-mno-amx-bf16",
        "-mno-amx-int8",
        "-mno-avxvnni",
    ),
}
"""Emulated CPU name -> the compiler flags that take its missing instructions out of a build."""
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
"""oneDNN's documented cap on the instructions it uses (torch's bf16 matmuls); part of :func:`cpu_id`
because it changes what torch's candidates measure."""


def emulation_flags() -> list[str]:
    """The flags :func:`build_library` appends for ``$HF_CONTBATCH_EMULATE_CPU`` (empty when unset).

    Raises:
        ValueError: the variable names no entry of :data:`EMULATIONS`.
    """
    name = os.environ.get(EMULATE_CPU_ENV, "").strip()
    if not name:
        return []
    if name not in EMULATIONS:
        raise ValueError(f"${EMULATE_CPU_ENV}={name!r}: expected one of {sorted(EMULATIONS)} or unset")
    return list(EMULATIONS[name])


def cpu_id() -> str:
    """The machine and its CPU flags as our kernels and torch see them: what a build or a
    measurement made on this CPU depends on (an emulated narrower CPU, :func:`emulation_flags`, and
    oneDNN's ``$ONEDNN_MAX_CPU_ISA`` are part of it, so their builds and timings are kept apart)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    limits = [f"{v}={os.environ[v]}" for v in (EMULATE_CPU_ENV, ONEDNN_ISA_ENV) if os.environ.get(v, "").strip()]
    return platform.machine() + flags + "".join(f" |{limit}" for limit in limits)


def _fingerprint(path: Path | str) -> dict[str, Any]:
    """Size in bytes and SHA-256 of the file at ``path`` (what is written beside a built library)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def _intact(target: Path) -> bool:
    """Whether the cached library ``target`` is whole: its size and SHA-256 equal the ones written
    beside it when it was built. A library cut short (an interrupted copy, a full disk) would kill the
    process that maps it (SIGBUS on load), so anything that does not match, or has no record, is
    built again."""
    try:
        return target.exists() and read_json(_record_path(target)) == _fingerprint(target)
    except OSError:
        return False


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256.json")


def build_library(source: Path, flags: list[str]) -> Path:
    """Path of the shared library compiled from ``source`` with ``flags``, compiling it when this
    source/compiler/flags/CPU has none yet, or when the cached one does not match the size and
    SHA-256 recorded beside it (``<name>.so.sha256.json``) at its build: a damaged library is
    rebuilt, never loaded. ``$HF_CONTBATCH_EMULATE_CPU``'s flags (:func:`emulation_flags`) follow
    ``flags``.

    Raises:
        ValueError: ``$HF_CONTBATCH_EMULATE_CPU`` names no known CPU.
        RuntimeError: no C compiler (``$CC``, which may carry arguments, else ``cc``, ``gcc`` or
            ``clang``), or the compile failed (the message ends with the compiler's error output).
        OSError, subprocess.CalledProcessError: ``$CC`` names no runnable program.
    """
    flags = [*flags, *emulation_flags()]
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    # $CC may carry arguments ("ccache gcc", "gcc -m64"), as make and setuptools allow.
    cc = shlex.split(os.environ["CC"]) if os.environ.get("CC", "").strip() else [found] if found else None
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *cc, version, " ".join(flags), cpu_id()]).encode())
    target = cache_dir() / f"{source.stem}_{key.hexdigest()[:16]}.so"
    if _intact(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cc)} failed: {proc.stderr.strip()[-500:]}")
        # The record first, then the library: a reader that sees the new library sees its record
        # (a concurrent build of other bytes at worst makes the next process build once more). A
        # damaged library is replaced (a new file), never rewritten in place: a process that has
        # mapped the old one keeps it.
        write_json(_record_path(target), _fingerprint(tmp))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def read_json(path: Path | str) -> Any:
    """The JSON value stored at ``path`` (measurements cached beside the kernels), or None when the
    file is missing, unreadable or not JSON (the caller measures again)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: Path | str, value: Any) -> bool:
    """Store ``value`` as JSON at ``path`` atomically (a temporary file, then ``os.replace``), so a
    process reading it concurrently never sees half a file. False (and logged) when it cannot be
    written: a cache, so nothing fails."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        logger.info("could not cache %s (%s)", path.name, exc)
        return False


class LoadedOnce:
    """What ``load()`` returns (a loaded kernel library's functions), computed on the first
    :meth:`get` of this object, thread-safe, and kept; or None for good when ``load()`` raised, with
    ``error`` saying why and one warning logged ("``what`` unavailable (why); using ``fallback``").

    Args:
        load: builds (``build_library``) and loads the library; any exception means unavailable.
        what: the kernel, for the warning (e.g. "compiled CPU decode attention").
        fallback: what serves instead, for the warning (e.g. "the torch path").
    """

    def __init__(self, load: Callable[[], Any], what: str, fallback: str) -> None:
        self._load, self._what, self._fallback = load, what, fallback
        self._lock = threading.Lock()
        self._value: Any = None
        self._tried = False
        self.error: Optional[str] = None

    def get(self) -> Any:
        """``load()``'s result, or None where it failed (loaded now on the first call)."""
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        self._value = self._load()
                    except Exception as exc:  # noqa: BLE001 - any failure: the fallback serves
                        self.error = f"{type(exc).__name__}: {exc}"
                        logger.warning("%s unavailable (%s); using %s", self._what, self.error, self._fallback)
                    self._tried = True
        return self._value
