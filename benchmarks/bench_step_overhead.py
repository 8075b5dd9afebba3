"""The Python around the native calls of one fused decoder layer in a decode step at one request.

    python benchmarks/bench_step_overhead.py --model medium --dtype float32
    python benchmarks/bench_step_overhead.py --trees "/work/main;." --repeats 3   # A/B, interleaved

One request decodes ``--tokens`` tokens; over its decode steps (after ``--skip`` untimed ones) every
call the fused layer step (``kernels.fused_layer.FusedLayerForward``) makes is timed with
``time.perf_counter_ns`` by wrapping it (the layer's ``__call__`` and ``fits``, the C wrappers it
calls (``fused_ops.rms_norm``... by name in older trees, ``UncheckedKernels``' methods now), ``PagedCacheStep.store_and_attend``, and the packed linears'
``PackedForward.__call__``, GEMM included), inside the layer's calls only (the LM head is not
counted). Figures are µs per layer per decode step, inclusive;
``layer rest`` is the layer's time outside the timed calls (its own Python). Each wrapper adds
about 0.2 µs to its caller's figure, the same in every tree. ``step`` is the mean wall time of a
whole decode step (engine step, sampling included) in a separate untimed pass.

``--trees``: ``;``-separated checkouts of hf_contbatch, each run as a fresh process with
``PYTHONPATH`` set to it, interleaved over ``--repeats`` rounds; the table gives each figure's
median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workload import build_model

# The names in kernels.fused_layer's namespace that the layer calls: the C wrappers (older and newer
# trees; the ones a tree lacks are skipped).
LAYER_NAMES = ("rms_norm", "rotary", "add_rms_norm", "silu_mul", "fits")


def _wrap(fn, name, totals, counts, on):
    """``fn`` timed into ``totals[name]`` while ``on`` says so: a decode step is timed
    (``on[0]``) and, but for the layer itself, a fused layer's call is running (``on[1]``)."""
    clock = time.perf_counter_ns
    is_layer = name == "layer"

    def timed(*args, **kwargs):
        if not on[0] or not (on[1] or is_layer):
            return fn(*args, **kwargs)
        if is_layer:
            on[1] = True
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += clock() - t0
            counts[name] += 1
            if is_layer:
                on[1] = False

    return timed


def run_one(args) -> dict:
    from hf_contbatch import EngineConfig, LLMEngine, SamplingParams
    from hf_contbatch.kernels import fused_layer, fused_ops
    from hf_contbatch.kernels.linears import packed_forward
    from hf_contbatch.kernels.paged_cache import PagedCacheStep

    torch.set_num_threads(args.threads)
    model = build_model(args.model, dtype=getattr(torch, args.dtype), model_type=args.config_type)
    engine = LLMEngine(model, EngineConfig(**({"quantization": args.quantization} if args.quantization else {})))
    totals, counts, on = defaultdict(int), defaultdict(int), [False, False]
    patched = []

    def patch(owner, attr, name):
        fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        patched.append((owner, attr, fn))
        if isinstance(fn, staticmethod):
            setattr(owner, attr, staticmethod(_wrap(fn.__func__, name, totals, counts, on)))
        else:
            setattr(owner, attr, _wrap(fn, name, totals, counts, on))

    layer_cls = fused_layer.FusedLayerForward
    patch(layer_cls, "__call__", "layer")
    patch(layer_cls, "fits", "layer.fits")
    for attr in ("_forward_fits",):  # newer trees' per-forward part, where present
        if attr in layer_cls.__dict__:
            patch(layer_cls, attr, f"layer.{attr}")
    for name in LAYER_NAMES:
        if name in vars(fused_layer) and name != "fits":
            patch(fused_layer, name, name)  # older trees: the checked wrappers, called by name
    unchecked = getattr(fused_ops, "UncheckedKernels", None)
    for name in ("rms_norm", "rotary", "add_rms_norm", "silu_mul", "rms_norm_rotary"):
        if unchecked is not None and name in unchecked.__dict__:
            patch(unchecked, name, name)
    if "fits" in vars(fused_layer):
        patch(fused_layer, "fits", "fused_ops.fits")
    patch(PagedCacheStep, "store_and_attend", "store_and_attend")
    patch(packed_forward.PackedForward, "__call__", "projection")
    from hf_contbatch.kernels.linears import fused

    if "outputs_verified" in fused.FusedGroup.__dict__:  # newer trees: a fused group's outputs in one call
        patch(fused.FusedGroup, "outputs_verified", "projection")
    try:
        prompt = list(range(5, 5 + args.prompt))
        params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
        engine.submit(prompt, params).result()  # warm-up: builds, tunes
        # Untimed pass: the wall time of a decode step.
        steps = []
        orig_step = engine.step

        def timed_step(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return orig_step(*a, **k)
            finally:
                steps.append(time.perf_counter_ns() - t0)

        engine.step = timed_step
        engine.submit(prompt, params).result()
        engine.step = orig_step
        decode_steps = steps[2 + args.skip : -1] or steps
        # Timed pass: every layer call of the decode steps.
        layers_per_step = sum(1 for _ in engine.model.modules() if isinstance(_.__dict__.get("forward"), layer_cls))
        h = engine.submit(prompt, params)
        orig_step2 = engine.step

        def instrumented_step(*a, **k):
            # The first steps are prefill (and the skipped decodes): timers off there.
            counts["steps seen"] += 1
            on[0] = counts["steps seen"] > 2 + args.skip
            if on[0]:
                counts["decode steps"] += 1
            try:
                return orig_step2(*a, **k)
            finally:
                on[0] = False

        engine.step = instrumented_step
        h.result()
        engine.step = orig_step2
    finally:
        for owner, attr, fn in reversed(patched):
            setattr(owner, attr, fn)
        engine.close()
    n_layer_calls = max(1, counts["layer"])
    per_layer = {k: totals[k] / n_layer_calls / 1e3 for k in totals}
    calls = {k: counts[k] / n_layer_calls for k in counts if k in totals}
    # The layer's direct callees (fused_ops.fits and _forward_fits run inside layer.fits too).
    direct = [k for k in totals if k not in ("layer", "fused_ops.fits", "layer._forward_fits")]
    per_layer["layer rest"] = per_layer.get("layer", 0.0) - sum(per_layer[k] for k in direct)
    return {
        "per_layer_us": per_layer,
        "calls_per_layer": calls,
        "layers_per_step": layers_per_step,
        "layer_calls": counts["layer"],
        "decode_steps": counts["decode steps"],
        "step_ms": statistics.median(decode_steps) / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="medium")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--config-type", default="llama", help="a transformers model type (qwen3, phi3...) at --model's sizes"
    )
    ap.add_argument("--quantization", default=None, help='e.g. "int8"')
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per request")
    ap.add_argument("--skip", type=int, default=2, help="untimed decode steps first")
    ap.add_argument("--trees", default=None, help="';'-separated checkouts to A/B (fresh process each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON result (internal: --trees runs)")
    args = ap.parse_args()
    if not args.trees:
        res = run_one(args)
        if args.json:
            print(json.dumps(res))
            return
        _print({"this tree": [res]})
        return
    trees = [os.path.abspath(t) for t in args.trees.split(";")]
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--trees")
    del argv[i : i + 2]
    results: dict = {t: [] for t in trees}
    for _ in range(args.repeats):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS=str(args.threads))
            out = subprocess.run(
                [sys.executable, __file__, *argv, "--json"], env=env, capture_output=True, text=True, check=True
            )
            results[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    _print(results)


def _print(results: dict) -> None:
    names = sorted({k for runs in results.values() for r in runs for k in r["per_layer_us"]})
    trees = list(results)
    print(f"{'µs per layer per decode step (calls)':40s}" + "".join(f"{os.path.basename(t) or t:>22s}" for t in trees))
    for name in names:
        row = f"{name:40s}"
        for t in trees:
            vals = [r["per_layer_us"].get(name) for r in results[t]]
            vals = [v for v in vals if v is not None]
            calls = results[t][0]["calls_per_layer"].get(name)
            cell = "-" if not vals else f"{statistics.median(vals):8.1f}" + (f" ({calls:.0f})" if calls else "")
            row += f"{cell:>22s}"
        print(row)
    row = f"{'decode step, ms (untimed pass)':40s}"
    for t in trees:
        row += f"{statistics.median(r['step_ms'] for r in results[t]):22.2f}"
    print(row)
    print("layers per step:", {os.path.basename(t) or t: results[t][0]["layers_per_step"] for t in trees})


if __name__ == "__main__":
    main()
