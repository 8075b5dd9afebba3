"""The C build cache: a damaged cached library is rebuilt, never loaded (issue 48, item 12)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_contbatch.kernels import native_build

_FLAGS = ["-O2", "-shared", "-fPIC"]

# Builds the library from the cache at $XDG_CACHE_HOME and calls it: 2 + 3 must be 5.
_LOAD = textwrap.dedent(
    """
    import ctypes, sys
    from pathlib import Path
    from hf_contbatch.kernels.native_build import build_library
    lib = ctypes.CDLL(str(build_library(Path(sys.argv[1]), sys.argv[2:])))
    print(lib.add_ints(2, 3))
    """
)


def _load_in_subprocess(source: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-c", _LOAD, str(source), *_FLAGS], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.timeout(900)
def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or os.environ.get("CC")):
        pytest.skip("no C compiler")
    source = tmp_path / "adder.c"
    source.write_text("int add_ints(int a, int b) { return a + b; }\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    built = native_build.build_library(source, _FLAGS)
    whole = built.read_bytes()
    assert len(whole) > 4096  # the cut below must remove part of the file
    # What an interrupted copy or a full disk leaves: the first 4,096 bytes. Mapping such a file
    # kills the process by SIGBUS (-7), so it is loaded in a subprocess.
    built.write_bytes(whole[:4096])
    done = _load_in_subprocess(source, cache)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["5"]
    assert built.stat().st_size == len(whole)  # rebuilt in place of the damaged one


@pytest.mark.timeout(900)
def test_a_library_without_its_record_or_with_other_bytes_is_rebuilt(tmp_path, monkeypatch):
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or os.environ.get("CC")):
        pytest.skip("no C compiler")
    source = tmp_path / "adder.c"
    source.write_text("int add_ints(int a, int b) { return a + b; }\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = native_build.build_library(source, _FLAGS)
    whole = built.read_bytes()
    first = built.stat().st_ino
    assert native_build.build_library(source, _FLAGS) == built and built.stat().st_ino == first  # intact: reused
    # Same size, one byte changed: only the checksum can tell.
    built.write_bytes(whole[:100] + bytes([whole[100] ^ 0xFF]) + whole[101:])
    native_build.build_library(source, _FLAGS)
    assert built.read_bytes() == whole
    record = built.with_name(built.name + ".sha256.json")
    record.unlink()
    second = built.stat().st_ino
    native_build.build_library(source, _FLAGS)
    assert built.stat().st_ino != second and record.exists()  # no record: built again, and recorded


def test_the_emulated_cpu_adds_its_flags_to_every_build_and_is_part_of_the_cpu_id(monkeypatch):
    monkeypatch.delenv(native_build.EMULATE_CPU_ENV, raising=False)
    monkeypatch.delenv(native_build.ONEDNN_ISA_ENV, raising=False)
    plain = native_build.cpu_id()
    assert native_build.emulation_flags() == []
    monkeypatch.setenv(native_build.EMULATE_CPU_ENV, "no-bf16")
    assert native_build.emulation_flags() == list(native_build.EMULATIONS["no-bf16"])
    assert "-mno-avx512bf16" in native_build.emulation_flags() and "-mno-amx-tile" in native_build.emulation_flags()
    emulated = native_build.cpu_id()
    monkeypatch.setenv(native_build.ONEDNN_ISA_ENV, "AVX512_CORE_VNNI")
    capped = native_build.cpu_id()
    # Builds and cached timings of the emulated or capped CPU never stand in for this one's.
    assert len({plain, emulated, capped}) == 3 and emulated.startswith(plain)
    monkeypatch.setenv(native_build.EMULATE_CPU_ENV, "no-such-cpu")
    with pytest.raises(ValueError, match="no-bf16"):
        native_build.emulation_flags()


@pytest.mark.timeout(900)
def test_our_gemm_built_for_the_emulated_cpu_has_no_vdpbf16ps_kernel_and_widens_bf16(tmp_path, monkeypatch):
    from hf_contbatch.kernels.linears import native_gemm

    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or os.environ.get("CC")):
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(native_build.EMULATE_CPU_ENV, "no-bf16")
    # The loader's uncached body: the process's cached default build is this CPU's.
    library, exc = native_gemm._load_native_library.__wrapped__(True)
    assert exc is None, exc
    assert library.gemm_bf16 is None and library.pack_bf16 is None  # VDPBF16PS left out, whatever the CPU
    assert Path(library.path).parent == tmp_path / "cache" / "hf_contbatch"
    # The widened kernel serves bfloat16 weights: float32 products of the same bf16 values, one rounding.
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 48, generator=g).bfloat16()
    x = torch.randn(5, 48, generator=g).bfloat16()
    packed = torch.empty((-(-70 // library.nr), 48, library.nr), dtype=torch.bfloat16)
    library.pack_h16(w.data_ptr(), 70, 48, packed.data_ptr())
    got = native_gemm.native_linear(x, packed, None, 70, library)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2.0**-8, atol=1e-5)
