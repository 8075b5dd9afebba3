"""Tile sizing per device and the attention-backend choice, without compiling anything.

The shared-memory estimate these tiles are admitted with is checked against Triton's real
allocation by the compile check (``test_triton_aot.py``); here: every configuration the launchers
can be asked for gets a tile within every arch's limit, and "auto"/"triton" decide as documented.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton")

from hf_contbatch.kernels.attention import resolve_backend, triton_launch, triton_tiles  # noqa: E402
from hf_contbatch.kernels.attention import triton_kernels as tk  # noqa: E402

CUDA = torch.device("cuda", 0)  # a device object only; the limits come from the arch table


@pytest.mark.timeout(150)
@pytest.mark.parametrize("arch", sorted(tk.ARCH_SHARED_MEMORY))
def test_every_supported_shape_gets_tiles_within_the_arch_shared_memory(arch):
    limits = tk.arch_limits(arch)
    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if arch >= 80 else ())
    for dtype in dtypes:
        for head_dim in tk.SUPPORTED_HEAD_SIZES:
            block_d = triton_tiles.next_power_of_2(head_dim)
            for group in range(1, triton_tiles.MAX_GQA_GROUP + 1):
                for cfg, min_rows in (
                    (triton_tiles.decode_tile_config(block_d, group, dtype, limits), 16),
                    (triton_tiles.prefill_tile_config(block_d, group, dtype, limits), 16),
                ):
                    assert cfg.shared_bytes + triton_tiles.SHARED_MARGIN <= tk.ARCH_SHARED_MEMORY[arch]
                    assert cfg.shared_bytes == triton_tiles.shared_memory_estimate(
                        cfg.rows, cfg.block_n, block_d, torch.finfo(dtype).bits // 8, cfg.num_stages
                    )
                    assert 1 <= cfg.heads <= group and cfg.rows >= max(min_rows, cfg.heads)
                    assert cfg.rows & (cfg.rows - 1) == 0 and 16 <= cfg.block_n <= 64


@pytest.mark.timeout(150)
def test_shared_memory_estimate_bounds_the_allocations_measured_for_triton_3_9():
    # Allocations Triton 3.9 made for these kernels before tiles were sized per device (bytes,
    # compiled with triton_aot): prefill fp16 d128 128x64 on sm_75 / sm_80, fp32 d64 128x64 on sm_80,
    # decode fp16 d128 16x64 on sm_80, fp32 d128 prefill 32x32 on sm_80.
    measured = [
        ((128, 64, 128, 2, 2), 98304),
        ((128, 64, 128, 2, 2), 65536),
        ((128, 64, 64, 4, 2), 98304),
        ((16, 64, 128, 2, 2), 38912),
        ((32, 32, 128, 4, 2), 53248),
    ]
    for args, shared in measured:
        assert triton_tiles.shared_memory_estimate(*args) >= shared


@pytest.mark.timeout(150)
def test_tiles_shrink_to_fit_the_device_not_a_fixed_budget():
    # sm_75's 64 KiB: the 96 KiB fp16 prefill tile of sm_80 does not fit, a smaller one is chosen.
    a100 = triton_tiles.prefill_tile_config(128, 1, torch.float16, tk.arch_limits(80))
    t4 = triton_tiles.prefill_tile_config(128, 1, torch.float16, tk.arch_limits(75))
    assert (a100.rows, a100.block_n, a100.num_warps) == (128, 64, 8)
    assert t4.shared_bytes + triton_tiles.SHARED_MARGIN <= 64 * 1024 < a100.shared_bytes
    tiny = tk.DeviceLimits("tiny", (8, 0), 16 * 1024)
    with pytest.raises(ValueError, match="no prefill tile fits the 16 KiB of shared memory per block of tiny"):
        triton_tiles.prefill_tile_config(256, 1, torch.float32, tiny)


@pytest.mark.timeout(150)
def test_arch_table_lookup():
    assert tk.arch_limits(89).shared_memory_per_block == 99 * 1024
    assert tk.arch_limits(120).shared_memory_per_block == 227 * 1024  # newer than the table: sm_90's
    with pytest.raises(ValueError, match="`arch` must be a compute capability >= 75"):
        tk.arch_limits(70)


def _on(monkeypatch, arch):
    monkeypatch.setattr(triton_launch, "_device_limits", lambda device: tk.arch_limits(arch))


@pytest.mark.timeout(150)
def test_auto_takes_triton_on_ampere_and_torch_below_sm80_without_warning(monkeypatch):
    monkeypatch.delenv("HF_CONTBATCH_ATTENTION_BACKEND", raising=False)
    shape = dict(dtype=torch.float16, head_dim=128, num_heads=32, num_kv_heads=8, block_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _on(monkeypatch, 80)
        assert resolve_backend("auto", CUDA, **shape) == "triton"
        _on(monkeypatch, 75)
        assert resolve_backend("auto", CUDA, **shape) == "torch"  # tk.prefers_torch: see its reasoning
        assert resolve_backend("triton", CUDA, **shape) == "triton"  # forced: runs, with sm_75 tiles


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "shape, message",
    [
        (dict(dtype=torch.float16, head_dim=72), "head size 72 is not one of"),
        (dict(dtype=torch.float16, head_dim=64, block_size=12), "block size 12 is not one of"),
        (dict(dtype=torch.float16, head_dim=64, num_heads=130, num_kv_heads=1), "130 query heads over 1 KV heads"),
    ],
)
def test_auto_falls_back_to_torch_with_one_warning_where_triton_cannot_serve(monkeypatch, shape, message):
    monkeypatch.delenv("HF_CONTBATCH_ATTENTION_BACKEND", raising=False)
    _on(monkeypatch, 86)
    with pytest.warns(UserWarning, match=message) as record:
        assert resolve_backend("auto", CUDA, **shape) == "torch"
    assert len(record) == 1
    with pytest.raises(ValueError, match=message):
        resolve_backend("triton", CUDA, **shape)


@pytest.mark.timeout(150)
def test_forced_triton_with_bf16_below_sm80_is_refused_naming_gpu_and_fp16(monkeypatch):
    _on(monkeypatch, 75)
    with pytest.raises(ValueError, match=r"sm_75 \(T4 / RTX 20xx\).*8\.0.*torch\.float16"):
        resolve_backend("triton", CUDA, dtype=torch.bfloat16, head_dim=64)
    assert tk.unsupported_reason(CUDA, dtype=torch.bfloat16, head_dim=64) is not None
    _on(monkeypatch, 80)
    assert tk.unsupported_reason(CUDA, dtype=torch.bfloat16, head_dim=64, num_heads=8, num_kv_heads=8) is None
