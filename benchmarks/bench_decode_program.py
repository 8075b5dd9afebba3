"""The decode program (``kernels/decode_program``: every layer of a float32 or bfloat16 decode
step in one native call) against the layer-by-layer fused path, in one engine, interleaved.

    python benchmarks/bench_decode_program.py                        # tiny; 1, 6 and 64 requests
    python benchmarks/bench_decode_program.py --model small --requests 1 8 --tokens 128
    python benchmarks/bench_decode_program.py --dtype bfloat16

For each request count, ``--rounds`` rounds each run the same decode twice, once with the program
and once without (``DecodeProgram.usable`` switched off: each layer's fused step, one by one), and
report the median decode step in ms (wall time of the requests' decode divided by the tokens each
made; prompts of 4 tokens, so the steps are decodes), and transformers' own ``generate`` at one
request as the baseline (ms per new token, greedy, same model and thread count).

First it shows why the program pays: one small native call (the fused RMSNorm of one row) timed
in a loop, and again with 1-12 MB of memory copied between calls, as a decode step's weights and
K/V stream through the caches between the layer's calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from cpu_peak import cpu_name

from workload import build_model


def cold_call_us() -> dict:
    """µs per call of the float32 RMSNorm of one 256-wide row with ``mb`` MB copied between calls."""
    from hf_contbatch.kernels.fused_ops import unchecked_kernels

    kernels = unchecked_kernels(torch.float32)
    if kernels is None:
        return {}
    x, w = torch.randn(1, 1, 256), torch.randn(256)
    src = torch.randn(3 * 1024 * 1024)
    dst = torch.empty_like(src)
    out = {}
    for mb in (0, 1, 4, 12):
        n = mb * 1024 * 1024 // 4
        times = []
        for _ in range(400):
            if n:
                dst[:n].copy_(src[:n])
            t = time.perf_counter_ns()
            kernels.rms_norm(x, w, 1e-6, True)
            times.append(time.perf_counter_ns() - t)
        out[mb] = statistics.median(times) / 1e3
    return out


def decode_ms(engine, n: int, tokens: int, salt: int) -> float:
    from hf_contbatch import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    handles = [engine.submit([10 + i + salt, 20, 30, 40 + i], params) for i in range(n)]
    for h in handles:
        h.result(timeout=3600)
    return 1e3 * (time.perf_counter() - t0) / tokens


def generate_ms(model, tokens: int) -> float:
    ids = torch.tensor([[10, 20, 30, 40]])
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return 1e3 * (time.perf_counter() - t0) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a workload.py size or a saved model's path")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 6, 64])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from hf_contbatch import EngineConfig, LLMEngine

    print(f"{cpu_name()}, {args.threads} threads, model {args.model} ({args.dtype})")
    cold = cold_call_us()
    if cold:
        timings = ", ".join(f"{v:.1f} with {mb} MB copied between" for mb, v in cold.items())
        print(f"one small native call (fused RMSNorm, 1 x 256), µs: {timings}")
    model = build_model(args.model, dtype=getattr(torch, args.dtype))
    engine = LLMEngine(model, EngineConfig())
    try:
        fused = engine.patches.fused_model
        program = None if fused is None else fused.base_forward.program
        if program is None or not program.usable:
            sys.exit("the decode program does not serve this model here (no fused model forward, or another form)")
        decode_ms(engine, 1, 4, 0)  # warm-up
        print(f"{'requests':>9} {'program ms':>11} {'layers ms':>10} {'speed-up':>9}")
        for n in args.requests:
            on, off = [], []
            for r in range(args.rounds):
                for use, out in ((True, on), (False, off)):
                    program.usable = use
                    served = program.served
                    out.append(decode_ms(engine, n, args.tokens, 100 * r + use))
                    if use and program.served == served:
                        sys.exit("the program served no step (a linear not on our GEMM, or the torch decode attention)")
            program.usable = True
            a, b = statistics.median(on), statistics.median(off)
            print(f"{n:>9} {a:>11.3f} {b:>10.3f} {b / a:>8.2f}x")
    finally:
        engine.close()
    print(f"transformers generate, 1 request: {generate_ms(model, args.tokens):.3f} ms per token")


if __name__ == "__main__":
    main()
