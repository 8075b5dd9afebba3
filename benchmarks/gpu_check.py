"""One-shot GPU check of the Triton paged-attention kernels. Needs a CUDA device; uses only the
torch and triton already installed (no downloads) and finishes in well under 5 minutes.

    python benchmarks/gpu_check.py --out gpu_check.json [--skip-tests] [--skip-e2e] [--e2e-model DIR]

Exit status: 0 all steps fine, 1 some step failed (see the JSON), 2 no CUDA device / no triton.

Steps, each recorded in the JSON written to --out (also when a step fails):
1. the kernel tests run natively: pytest tests/test_triton_kernels.py with TRITON_INTERPRET=0;
2. device copy bandwidth: a large tensor copy, GB/s counted as bytes read + bytes written;
3. decode kernel: batch 64 x context 2048 and batch 256 x context 512 (32 query heads / 8 KV heads,
   head size 128, bf16, block size 16, shuffled block tables): achieved GB/s of K+V read, and its ratio
   to the copy bandwidth (1.0 would mean the kernel streams the cache as fast as a copy moves bytes);
   batch 4 x context 8192 is added to time the flash-decoding (split-context) path;
4. prefill kernel vs torch scaled_dot_product_attention on equal work (8 x 1024 tokens, causal):
   time ratio (ours / SDPA, lower is better) and TFLOP/s of both;
5. END-TO-END HOOK: greedy generation through hf_contbatch.ContinuousBatchingPipeline with the Triton
   and the torch attention backends, from --e2e-model (a local directory) or the embedded default model.
"""

from __future__ import annotations

import os

# Native kernels: must be decided before triton_kernels is imported.
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
TEST_TIMEOUT_S = 170  # leaves the benchmarks room inside 5 minutes


def run_kernel_tests() -> dict:
    """pytest on the kernel tests, compiled for the GPU instead of interpreted.

    Compiling ~50 kernel variants dominates, so the test ids are split over parallel pytest
    processes (no pytest-xdist needed); Triton's on-disk cache is safe to share between them.
    """
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    base = [sys.executable, "-m", "pytest", "tests/test_triton_kernels.py", "-p", "no:cacheprovider"]
    start = time.time()
    collected = subprocess.run(
        base + ["--collect-only", "-q"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    test_ids = [line.strip() for line in collected.stdout.splitlines() if "::" in line]
    if not test_ids:
        tail = (collected.stdout + collected.stderr)[-3000:]
        return {"passed": False, "error": "no tests collected", "output_tail": tail}
    num_shards = max(1, min(8, (os.cpu_count() or 2) // 2, len(test_ids)))
    shards = [test_ids[i::num_shards] for i in range(num_shards)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for ids in shards
    ]
    summaries, failures, timed_out = [], [], False
    for proc in procs:
        remaining = max(1.0, TEST_TIMEOUT_S - (time.time() - start))
        try:
            output, _ = proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            timed_out = True
        lines = output.strip().splitlines()
        summaries.append(lines[-1] if lines else "")
        if proc.returncode != 0:
            failures.append(output[-3000:])
    return {
        "passed": not failures and not timed_out,
        "tests": len(test_ids),
        "shards": num_shards,
        "shard_summaries": summaries,
        "timed_out": timed_out,
        "seconds": round(time.time() - start, 1),
        "failure_output_tails": failures,
    }


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def measure_copy_bandwidth(device) -> dict:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 255)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))  # noqa: F821 - run before the del below
    gbps = 2 * src.numel() / (ms * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 1 << 30, "ms": ms, "gb_per_s_read_plus_write": gbps}


def make_paged_kv(batch, context, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
    # shuffled, as after many admissions and frees
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, seq_lens


def dense_kv(cache, block_tables, b, context):
    """[num_heads, context, head_dim]: request b's keys or values gathered and repeated per query head."""
    rows = cache[block_tables[b].long()].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:context]
    return rows.transpose(0, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=0)


def bench_decode(batch, context, copy_gbps, device) -> dict:
    import torch.nn.functional as F

    from hf_contbatch.kernels.attention import triton_kernels as tk

    k_cache, v_cache, block_tables, seq_lens = make_paged_kv(batch, context, device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    def run():
        tk.paged_decode_attention(
            query,
            k_cache,  # noqa: F821 - run before the del below
            v_cache,  # noqa: F821
            block_tables,
            seq_lens,
            scale,
            out=out,
            max_seq_len=context,
        )

    run()
    torch.cuda.synchronize()
    errors = []
    for b in (0, batch - 1):  # sanity: never time a wrong answer
        keys, values = dense_kv(k_cache, block_tables, b, context), dense_kv(v_cache, block_tables, b, context)
        expected = F.scaled_dot_product_attention(query[b][:, None].float(), keys.float(), values.float(), scale=scale)
        errors.append((out[b].float() - expected[:, 0]).abs().max().item())
    ms = bench_ms(run)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    result = {
        "batch": batch,
        "context": context,
        "num_splits": tk.decode_num_splits(batch, NUM_KV_HEADS, context, device),
        "ms": ms,
        "kv_bytes": kv_bytes,
        "kv_read_gb_per_s": gbps,
        "ratio_to_copy_bandwidth": gbps / copy_gbps,
        "max_abs_err_vs_sdpa": max(errors),
    }
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return result


def bench_prefill(device, batch=8, seq=1024) -> dict:
    import torch.nn.functional as F

    from hf_contbatch.kernels.attention import triton_kernels as tk

    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(batch, NUM_HEADS, seq, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, seq, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    v = torch.randn(batch, NUM_KV_HEADS, seq, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    scale = HEAD_DIM**-0.5

    # the same tokens in the paged layout, written by store_kv through a shuffled slot mapping
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv(batch, seq, device, seed=2)
    positions = torch.arange(seq, device=device)
    slot_mapping = (block_tables.long()[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).reshape(-1)
    flat_k = k.transpose(1, 2).reshape(batch * seq, NUM_KV_HEADS, HEAD_DIM)
    flat_v = v.transpose(1, 2).reshape(batch * seq, NUM_KV_HEADS, HEAD_DIM)
    tk.store_kv(flat_k, flat_v, k_cache, v_cache, slot_mapping)
    store_ms = bench_ms(lambda: tk.store_kv(flat_k, flat_v, k_cache, v_cache, slot_mapping))
    query = q.transpose(1, 2).reshape(batch * seq, NUM_HEADS, HEAD_DIM).contiguous()
    query_start_loc = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=device)
    out = torch.empty_like(query)

    def ours():
        tk.paged_prefill_attention(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq, scale, out=out
        )

    try:  # GQA inside SDPA (torch >= 2.5); otherwise expand K/V once, outside the timing
        F.scaled_dot_product_attention(q[:1, :, :16], k[:1, :, :16], v[:1, :, :16], is_causal=True, enable_gqa=True)
        k_sdpa, v_sdpa, gqa_kw = k, v, {"enable_gqa": True}
    except TypeError:
        group = NUM_HEADS // NUM_KV_HEADS
        k_sdpa, v_sdpa, gqa_kw = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), {}

    def sdpa():
        return F.scaled_dot_product_attention(q, k_sdpa, v_sdpa, is_causal=True, scale=scale, **gqa_kw)

    ours()
    expected = sdpa().transpose(1, 2).reshape(batch * seq, NUM_HEADS, HEAD_DIM)
    max_err = (out.float() - expected.float()).abs().max().item()
    ours_ms, sdpa_ms = bench_ms(ours), bench_ms(sdpa)
    flops = 2 * batch * NUM_HEADS * seq * seq * HEAD_DIM  # 4 * B*H*S*S*D, halved by the causal mask
    kv_store_bytes = 2 * 2 * flat_k.numel() * flat_k.element_size()  # read + write, K and V
    return {
        "batch": batch,
        "seq": seq,
        "triton_ms": ours_ms,
        "sdpa_ms": sdpa_ms,
        "time_ratio_triton_over_sdpa": ours_ms / sdpa_ms,
        "triton_tflops": flops / (ours_ms * 1e-3) / 1e12,
        "sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
        "sdpa_gqa_native": bool(gqa_kw),
        "max_abs_err_vs_sdpa": max_err,
        "store_kv_ms": store_ms,
        "store_kv_gb_per_s": kv_store_bytes / (store_ms * 1e-3) / 1e9,
    }


# ================================ END-TO-END HOOK ================================
# Generates with hf_contbatch.ContinuousBatchingPipeline on the GPU, once with the Triton kernels and
# once with the plain-torch attention, from a LOCAL checkpoint only: --e2e-model, or else the small
# model embedded in the package (hf_contbatch/default_model). Nothing is downloaded (HF_HUB_OFFLINE=1).
# Skipped when the pipeline is not importable. Adjust here if the pipeline's API changes; nothing
# else in this script depends on it.
E2E_PROMPTS, E2E_NEW_TOKENS = 64, 64


def end_to_end_hook(model_path) -> dict:
    try:
        from hf_contbatch import ContinuousBatchingPipeline, EngineConfig
    except ImportError as exc:
        return {"status": "skipped", "reason": f"hf_contbatch.ContinuousBatchingPipeline not importable: {exc}"}
    if not model_path:
        import hf_contbatch

        model_path = str(Path(hf_contbatch.__file__).resolve().parent / "default_model")
    prompts = [f"def function_number_{i}(x):" for i in range(E2E_PROMPTS)]
    result = {"status": "ran", "model": model_path, "prompts": E2E_PROMPTS, "max_new_tokens": E2E_NEW_TOKENS}
    texts = {}
    for backend in ("triton", "torch"):
        pipe = ContinuousBatchingPipeline(
            model_path, device="cuda", dtype=DTYPE, engine_config=EngineConfig(attention_backend=backend)
        )
        try:
            pipe(prompts[:2], max_new_tokens=4, do_sample=False, progress_bar=False)  # warm-up: compile kernels
            torch.cuda.synchronize()
            start = time.time()
            outputs = pipe(prompts, max_new_tokens=E2E_NEW_TOKENS, do_sample=False, progress_bar=False)
            torch.cuda.synchronize()
            seconds = time.time() - start
        finally:
            pipe.close()
        texts[backend] = [out[0]["generated_text"] for out in outputs]
        result[f"{backend}_seconds"] = seconds
        # an upper bound: a request that hits EOS early generates fewer tokens
        result[f"{backend}_approx_tokens_per_s"] = E2E_PROMPTS * E2E_NEW_TOKENS / seconds
    # bf16 rounding differs between the two attention paths, so greedy texts may diverge late; report, don't assert
    result["identical_greedy_texts"] = sum(a == b for a, b in zip(texts["triton"], texts["torch"]))
    return result


# ============================== END END-TO-END HOOK ==============================


def run_step(results, name, fn):
    start = time.time()
    try:
        results[name] = fn()
    except Exception as exc:  # record and go on: one failing step should not hide the others
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    print(f"[{time.time() - start:6.1f}s] {name}: {json.dumps(results[name], default=str)[:400]}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--skip-tests", action="store_true", help="skip the native pytest run")
    parser.add_argument(
        "--e2e-model", default=None, help="local model directory for the end-to-end hook (default: the embedded model)"
    )
    parser.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end hook")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); "
            "this check needs an NVIDIA GPU. Nothing was run.",
            file=sys.stderr,
        )
        return 2
    try:
        import triton
    except ImportError:
        print("gpu_check: triton is not installed; the kernels cannot run.", file=sys.stderr)
        return 2

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    if props.major < 8:  # bfloat16 needs sm_80; the kernels refuse it below (float16 is the alternative)
        global DTYPE
        DTYPE = torch.float16
    results = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "shared_memory_per_block_optin": props.shared_memory_per_block_optin,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": str(DTYPE),
        },
    }
    started = time.time()
    if not args.skip_tests:
        run_step(results, "kernel_tests", run_kernel_tests)
    run_step(results, "copy_bandwidth", lambda: measure_copy_bandwidth(device))
    copy_gbps = results["copy_bandwidth"].get("gb_per_s_read_plus_write", float("nan"))
    for batch, context in ((64, 2048), (256, 512), (4, 8192)):  # the last one takes the flash-decoding path
        run_step(
            results,
            f"decode_b{batch}_ctx{context}",
            lambda batch=batch, context=context: bench_decode(batch, context, copy_gbps, device),
        )
    run_step(results, "prefill_vs_sdpa", lambda: bench_prefill(device))
    if not args.skip_e2e:
        run_step(results, "end_to_end", lambda: end_to_end_hook(args.e2e_model))
    results["total_seconds"] = round(time.time() - started, 1)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")
    failed = [k for k, v in results.items() if isinstance(v, dict) and ("error" in v or v.get("passed") is False)]
    if failed:
        print(f"gpu_check: steps with problems: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
