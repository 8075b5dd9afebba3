"""Apply a grammar's token bitmask to float32 CPU scores with our C kernel (``token_bitmask.c``).

Structured outputs mask every constrained row of a step: the scores of the tokens the row's grammar
refuses become ``-inf``. xgrammar's CPU kernel does it one bit at a time; ours turns each 16 bits
into an AVX-512 lane mask and skips words whose 32 tokens are all allowed
(``benchmarks/bench_structured.py`` measures both per step; docs/benchmarks.md has the figures). The library is built like
the other C kernels (``native_build``: once per source, compiler and CPU, cached); where it cannot be
built, or the scores are not a float32 CPU tensor with unit stride in the vocabulary, callers use
xgrammar's kernel (:meth:`TokenBitmaskKernel.apply` returns False).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional, Sequence

import torch

from .native_build import LoadedOnce, build_library

SOURCE = Path(__file__).with_name("token_bitmask.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
"""No ``-ffast-math``: the kernel writes infinities."""


def build_bitmask_library(extra_flags: Sequence[str] = ()) -> Path:
    """Path of the compiled kernel (compiled now when the cache has none for this source, compiler,
    flags and CPU; errors as ``native_build.build_library``). ``extra_flags`` follow the defaults
    (``-mno-avx512f`` builds the portable loop, for tests)."""
    return build_library(SOURCE, [*FLAGS, *extra_flags])


def _load(extra_flags: Sequence[str]) -> tuple:
    """(the apply function, the instruction set it was built for) of the built library."""
    lib = ctypes.CDLL(str(build_bitmask_library(extra_flags)))
    fn = lib.hf_contbatch_apply_token_bitmask
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64]
    fn.restype = None
    lib.hf_contbatch_bitmask_isa.restype = ctypes.c_char_p
    return fn, lib.hf_contbatch_bitmask_isa().decode()


class TokenBitmaskKernel:
    """Our bitmask kernel, loaded on first use; one per owner (no module state).

    Args:
        extra_flags: compiler flags after the defaults (tests build the portable loop with
            ``("-mno-avx512f",)``).
    """

    def __init__(self, extra_flags: Sequence[str] = ()) -> None:
        self._library = LoadedOnce(lambda: _load(extra_flags), "compiled token-bitmask kernel", "xgrammar's")

    @property
    def isa(self) -> Optional[str]:
        """The instruction set of the build, ``avx512f`` or ``generic``; None where the kernel cannot
        be built (built now on first use)."""
        loaded = self._library.get()
        return loaded[1] if loaded is not None else None

    @property
    def error(self) -> Optional[str]:
        """Why the kernel cannot be built here (None when it was, or before the first try)."""
        return self._library.error

    def _get(self):
        """The kernel's function (built and loaded now on the first call), or None."""
        loaded = self._library.get()
        return loaded[0] if loaded is not None else None

    def serves(self, scores: torch.Tensor) -> bool:
        """True when :meth:`apply` takes ``scores`` (a 2-D float32 CPU tensor with unit stride along
        the vocabulary) and the kernel is built here (built now on the first call)."""
        return (
            scores.dtype == torch.float32
            and scores.device.type == "cpu"
            and scores.dim() == 2
            and scores.stride(1) == 1
            and self._get() is not None
        )

    def apply(self, scores: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], vocab_size: int) -> bool:
        """Set ``scores[r, t]`` to ``-inf`` for every ``r`` in ``rows`` and ``t < vocab_size`` whose
        bit ``t % 32`` of ``bitmask[r, t // 32]`` is 0; other scores are untouched. That is
        ``xgrammar.apply_token_bitmask_inplace(scores, bitmask, vocab_size=vocab_size,
        indices=rows)`` (whose CPU kernel departs from it below 32 tokens of vocabulary).

        Args:
            scores: ``[N, >= vocab_size]`` float32 CPU tensor, unit stride along the vocabulary;
                changed in place.
            bitmask: ``[>= max(rows) + 1, >= ceil(vocab_size / 32)]`` int32 CPU tensor, unit stride
                along the words.
            rows: row indices (the same row of ``scores`` and of ``bitmask``), each in range.
            vocab_size: tokens to mask, from token 0.
        Returns:
            True when done; False when the kernel cannot take these tensors (dtype, device, layout)
            or cannot be built here, and nothing was changed.
        Raises:
            ValueError: a row outside ``scores`` or ``bitmask``, or a bitmask narrower than
                ``vocab_size``.
        """
        if not (self.serves(scores) and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"):
            return False
        if bitmask.dim() != 2 or bitmask.stride(1) != 1:
            return False
        if not rows:
            return True
        if vocab_size > scores.shape[1] or (vocab_size + 31) // 32 > bitmask.shape[1]:
            raise ValueError(
                f"vocab_size {vocab_size} exceeds the scores ({scores.shape[1]}) or the bitmask "
                f"({bitmask.shape[1]} words of 32)"
            )
        if min(rows) < 0 or max(rows) >= min(scores.shape[0], bitmask.shape[0]):
            raise ValueError(f"rows must lie in [0, {min(scores.shape[0], bitmask.shape[0])}), got {list(rows)}")
        fn = self._get()
        index = torch.tensor(list(rows), dtype=torch.int64)
        fn(
            scores.data_ptr(),
            scores.stride(0),
            bitmask.data_ptr(),
            bitmask.stride(0),
            index.data_ptr(),
            len(rows),
            vocab_size,
        )
        return True
