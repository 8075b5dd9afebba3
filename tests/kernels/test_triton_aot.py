"""Ahead-of-time compile check: the kernel variants the launchers produce compile for sm_75, sm_80,
sm_86 and sm_90 with the triton wheel's ptxas, fit each arch's shared memory, and do not spill.

No GPU needed (see ``hf_contbatch/kernels/attention/triton_aot.py``). The sampled plan runs here; the full
plan and its table: ``python benchmarks/triton_compile_table.py``. The compiles run in fresh worker
processes (no ``TRITON_INTERPRET``) with a new, empty Triton cache each run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from hf_contbatch.kernels.attention import triton_aot, triton_tiles  # noqa: E402
from hf_contbatch.kernels.attention import triton_kernels as tk  # noqa: E402

_ELEM_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


pytestmark = pytest.mark.slow  # the module fixture compiles a sample of kernels for NVIDIA archs


@pytest.fixture(scope="module")
def sampled_results():
    return triton_aot.run_plan_subprocess("sampled", triton_aot.ARCHS, workers=2, timeout=2700)


@pytest.mark.timeout(3000)
def test_sampled_plan_covers_every_arch_and_kernel(sampled_results):
    assert len(sampled_results) == len(triton_aot.plan("sampled"))
    seen = {(r["arch"], k["name"]) for r in sampled_results for k in r.get("kernels", [])}
    for arch in triton_aot.ARCHS:
        for name in ("_store_kv_kernel", "_paged_decode_kernel", "_decode_reduce_kernel", "_paged_prefill_kernel"):
            assert (arch, name) in seen


@pytest.mark.timeout(3000)
def test_every_sampled_variant_compiles_and_fits_shared_memory(sampled_results):
    for r in sampled_results:
        assert "error" not in r, f"sm_{r['arch']} {r['label']}: {r['error']}"
        if "refused" in r:
            continue
        assert r["kernels"], r["label"]
        for k in r["kernels"]:
            assert k["shared"] <= r["limit"] == tk.ARCH_SHARED_MEMORY[r["arch"]], (r["arch"], r["label"], k)
            c = k["constexprs"]
            if k["name"] in ("_paged_decode_kernel", "_paged_prefill_kernel"):
                # The estimate tiles are admitted with bounds Triton's real allocation, so variants
                # outside the sample stay within the limit too.
                rows = c.get("BLOCK_M", c.get("BLOCK_G"))
                estimate = triton_tiles.shared_memory_estimate(
                    rows, c["BLOCK_N"], c["BLOCK_D"], _ELEM_BYTES[r["case"]["dtype"]], k["num_stages"]
                )
                assert k["shared"] <= estimate + triton_tiles.SHARED_MARGIN, (r["arch"], r["label"], k, estimate)


@pytest.mark.timeout(3000)
def test_no_sampled_variant_spills_registers(sampled_results):
    for r in sampled_results:
        for k in r.get("kernels", []):
            assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (r["arch"], r["label"], k)


@pytest.mark.timeout(3000)
def test_tensor_cores_from_sm80_for_half_precision_and_bf16_refused_on_sm75(sampled_results):
    for r in sampled_results:
        half = r["case"]["dtype"] in ("fp16", "bf16")
        uses_bf16 = "bf16" in (r["case"]["dtype"], r["case"]["key_dtype"])
        if r["arch"] < 80 and uses_bf16:
            assert "sm_75" in r.get("refused", "") and "torch.float16" in r["refused"], r
            continue
        assert "refused" not in r, r
        for k in r["kernels"]:
            if k["name"] in ("_paged_decode_kernel", "_paged_prefill_kernel"):
                # Decode's 16-row tiles use mma.sync even on sm_90 (wgmma needs 64 rows).
                expected = ("wgmma", "mma") if half and r["arch"] >= 80 else ("none",)
                assert k["tensor_cores"] in expected, (r["arch"], r["label"], k)
