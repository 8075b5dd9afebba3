"""Where an engine step goes: a per-step breakdown of hf_contbatch on the standard workload.

    python benchmarks/bench_breakdown.py                       # tiny and small, default config
    python benchmarks/bench_breakdown.py --model tiny --variants "default;attention_impl=gather"

For each model (and each config variant, interleaved over ``--repeats`` rounds, each run in its own
fresh process) the workload of ``workload.py`` runs twice in the same engine: once plain (the wall
time and tok/s that count) and once with timers around each part of a step:

- ``scheduler``: the rest of ``LLMEngine.step`` (reap, budget, admit, preempt, KV block moves, stats);
- ``inputs``: ``ModelRunner.build_metadata`` (flattened ids, positions, slot mapping, metadata);
- ``linears``: every ``nn.Linear`` forward call (timed by wrapping its forward, not by hooks, which would turn the fused decoder-layer step off; packed or not, fused groups counted per member; "Linear mods" is their number per step), LM head included;
  with ``compile_model=True`` (the modules run inside the compiled graph) the C call of our GEMM
  only, one per fused group (the custom op's Python around it goes to ``model other``);
- ``attention``: the paged attention function (reads the pool);
- ``kv store``: ``AttentionBackend.store_kv`` (writes this step's K/V into its slots);
- ``model other``: the rest of the forward (embedding, norms, rotary, activations, transformers'
  Python modules, logits selection);
- ``sampling``: ``Sampler.sample``;
- ``outputs``: ``Scheduler.proposed_tokens`` and ``update_from_output`` and the engine's per-token
  bookkeeping (``OutputProcessor``: stop decisions, the grammar's advance, streaming).

Figures are ms per step and share of the instrumented step. The timers cost a few µs per call
(about 40 per layer per step), so the instrumented run is a little slower than the plain one;
shares are what to compare. Variants are ``;``-separated lists of ``EngineConfig`` keyword
assignments (``key=value,key=value``; "default" for none; ``cache.FIELD=value`` sets a
``CacheConfig`` field, e.g. ``cache.dtype=int8``); the key ``tree=PATH`` runs that
variant with ``PYTHONPATH=PATH`` (another checkout of hf_contbatch, e.g. ``tree=/work/main``), for
before/after comparisons in one command; the key ``dtype=bfloat16`` (or ``float32``) overrides
``--dtype`` for that variant, so float32 and bfloat16 run interleaved in one command
(``--variants "dtype=float32;dtype=bfloat16"``: "identical outputs" is then bf16's greedy agreement
with float32). ``--emulate-cpu no-bf16`` runs every variant's process as on
a CPU without native bf16 (``emulate_cpu.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
import emulate_cpu

from workload import build_model, workload_for

PARTS = ("scheduler", "inputs", "linears", "attention", "kv store", "model other", "sampling", "outputs")


def _parse_variant(text: str) -> dict:
    if text in ("", "default"):
        return {}
    kwargs = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        for conv in (int, float):
            try:
                value = conv(value)
                break
            except ValueError:
                continue
        if value in ("True", "False", "None"):
            value = {"True": True, "False": False, "None": None}[value]
        kwargs[key.strip()] = value
    return kwargs


class _Timers:
    def __init__(self, clock) -> None:
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.on = False
        self.clock = clock
        self.kind = "decode"  # the kind of the step running now: "prefill" or "decode"
        self.running = defaultdict(bool)  # part name -> a timed call of it is running

    def wrap(self, fn, name):
        perf = self.clock

        def timed(*args, **kwargs):
            # A wrapped function called from another of the same part (in older checkouts
            # ``torch_paged_attention`` called ``_int8_paged_attention`` over an int8 cache) counts
            # once: the outer call.
            if not self.on or self.running[name]:
                return fn(*args, **kwargs)
            self.running[name] = True
            t0 = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += perf() - t0
                self.calls[name] += 1
                self.running[name] = False

        return timed


def _instrument(engine, timers: _Timers) -> None:
    """Wrap the parts of a step with timers (instance attributes and module functions only)."""
    try:
        from hf_contbatch.kernels.attention import torch_paged
    except ImportError:  # a checkout from before the layer folders (``tree=`` variants)
        from hf_contbatch.attention import torch_paged

    sched, runner = engine.scheduler, engine.runner
    outputs = getattr(engine, "outputs", None)  # OutputProcessor; older trees: LLMEngine._on_new_token
    if outputs is not None and hasattr(outputs, "decide"):  # stops decided before the scheduler appends
        outputs.decide = timers.wrap(outputs.decide, "on token")
        outputs.stream = timers.wrap(outputs.stream, "on token")
        sched.proposed_tokens = timers.wrap(sched.proposed_tokens, "update")
    elif outputs is not None:
        outputs.process = timers.wrap(outputs.process, "on token")  # its on_token hook runs inside "update"
    else:
        engine._on_new_token = timers.wrap(engine._on_new_token, "on token")
    engine.step = timers.wrap(engine.step, "step")
    runner.build_metadata = timers.wrap(runner.build_metadata, "inputs")
    timed_execute = timers.wrap(runner.execute, "execute")

    def execute(plan):
        # "prefill" steps hold at least one prefill chunk; "decode" steps only decodes (and drafts).
        timers.kind = "decode" if all(s.is_decode or s.draft_token_ids for s in plan.scheduled) else "prefill"
        timers.calls[f"{timers.kind} steps"] += 1 if timers.on else 0
        return timed_execute(plan)

    runner.execute = execute
    engine.sampler.sample = timers.wrap(engine.sampler.sample, "sampling")
    sched.update_from_output = timers.wrap(sched.update_from_output, "update")
    if hasattr(engine.cache, "backend"):  # the attention backend stores K/V (older checkouts: the cache's update)
        engine.cache.backend.store_kv = timers.wrap(engine.cache.backend.store_kv, "kv store")
    else:
        engine.cache.update = timers.wrap(engine.cache.update, "kv store")
    compiled = not isinstance(runner.model, torch.nn.Module)  # compile_model: a CompiledForward
    if compiled:
        runner.model = _TimedCall(runner.model, timers.wrap(runner.model, "forward"))
    else:
        runner.model.forward = timers.wrap(runner.model.forward, "forward")
    for name in dir(torch_paged):
        if name.endswith("paged_attention") and callable(getattr(torch_paged, name)):
            setattr(torch_paged, name, timers.wrap(getattr(torch_paged, name), "attention"))
    if compiled:
        # Inside a compiled graph module hooks would be traced (and break it): time our GEMM's C
        # call instead, which the opaque custom op looks up at run time.
        from hf_contbatch.kernels.linears import native_gemm

        lookup = native_gemm.native_library

        def timed_library():
            lib = lookup()
            if isinstance(lib, tuple):  # older checkouts (``tree=``): (pack, gemm)
                return lib[0], timers.wrap(lib[1], "linears")
            # A GemmLibrary: its float32 and bfloat16 GEMMs timed, the rest as it is.
            import dataclasses

            timed = {n: timers.wrap(getattr(lib, n), "linears") for n in ("gemm_f32", "gemm_bf16") if getattr(lib, n)}
            return dataclasses.replace(lib, **timed)

        native_gemm.native_library = timed_library
        return
    perf = timers.clock

    def timed_linear(mod, forward):
        def call(x, *args, **kwargs):
            if not timers.on:
                return forward(x, *args, **kwargs)
            t0 = perf()
            out = forward(x, *args, **kwargs)
            dt = perf() - t0
            timers.total["linears"] += dt
            timers.calls["linears"] += 1
            # Per step kind: seconds, FLOPs (2 x rows x in x out) and weight bytes read (once a call).
            rows = x.numel() // mod.in_features
            timers.total[f"linears {timers.kind}"] += dt
            timers.total[f"flops {timers.kind}"] += 2.0 * rows * mod.in_features * mod.out_features
            timers.total[f"weight bytes {timers.kind}"] += mod.weight.numel() * mod.weight.element_size()
            return out

        return call

    # The linears' forwards wrapped as instance attributes, not module hooks: a fused decoder-layer
    # step (kernels/fused_layer) calls the projections' forwards itself and steps aside for hooked modules.
    for m in runner.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = timed_linear(m, m.forward)


class _TimedCall:
    """Stands in for a callable object: calls go through ``timed``, attributes to ``target``."""

    def __init__(self, target, timed) -> None:
        self._target, self._timed = target, timed

    def __call__(self, *args, **kwargs):
        return self._timed(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)


def _breakdown(timers: _Timers, steps: int) -> dict:
    t = timers.total
    forward = t["forward"]
    outputs = t["update"] + t["on token"]
    parts = {
        # Everything in the step outside the model runner and the output handling: reap, budget,
        # admit, preempt, KV block moves, stats.
        "scheduler": t["step"] - t["execute"] - outputs,
        "inputs": t["inputs"],
        "linears": t["linears"],
        "attention": t["attention"],
        "kv store": t["kv store"],
        "model other": forward - t["linears"] - t["attention"] - t["kv store"],
        "sampling": t["sampling"],
    }
    # execute = inputs + forward + sampling + logits handling; the remainder goes to "model other".
    parts["model other"] += t["execute"] - t["inputs"] - forward - t["sampling"]
    parts["outputs"] = outputs
    total = t["step"]
    return {
        "steps": steps,
        "ms_per_step": {k: 1e3 * v / steps for k, v in parts.items()},
        "share": {k: v / total for k, v in parts.items()},
        "step_ms": 1e3 * total / steps,
        "linear_calls_per_step": timers.calls["linears"] / steps,
        "attention_calls_per_step": timers.calls["attention"] / steps,
        # Linears by step kind (eager forwards only: a compiled graph runs no module hooks).
        "by_kind": {
            kind: {
                "steps": timers.calls[f"{kind} steps"],
                "linears_ms_per_step": 1e3 * t[f"linears {kind}"] / max(1, timers.calls[f"{kind} steps"]),
                "gflops": t[f"flops {kind}"] / t[f"linears {kind}"] / 1e9 if t[f"linears {kind}"] else 0.0,
                "weight_gbs": t[f"weight bytes {kind}"] / t[f"linears {kind}"] / 1e9 if t[f"linears {kind}"] else 0.0,
            }
            for kind in ("prefill", "decode")
        },
    }


def run_single(args, variant: str) -> dict:
    from hf_contbatch import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(args.threads)
    kwargs = _parse_variant(variant)
    kwargs.pop("tree", None)
    dtype = kwargs.pop("dtype", args.dtype)  # "dtype=bfloat16": this variant's weights
    model = build_model(args.model, dtype=getattr(torch, dtype), model_type=args.config_type)
    prompts, new_tokens = workload_for(args.model, model.config.vocab_size, args.seed, args.requests)
    cache = {k.removeprefix("cache."): kwargs.pop(k) for k in list(kwargs) if k.startswith("cache.")}
    if cache:  # "cache.dtype=int8": a CacheConfig field
        from hf_contbatch import CacheConfig

        kwargs["cache"] = CacheConfig(**cache)
    t_build = time.perf_counter()
    engine = LLMEngine(model, EngineConfig(**kwargs))
    timers = _Timers(time.thread_time if args.clock == "cpu" else time.perf_counter)
    try:
        _instrument(engine, timers)
        t0 = time.perf_counter()
        engine.submit([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)).result()  # bench_ours' warm-up
        warmup = time.perf_counter() - t0

        def workload():
            t0, c0 = time.perf_counter(), time.process_time()
            hs = [
                engine.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, new_tokens)
            ]
            outs = [h.result().output_token_ids for h in hs]
            return time.perf_counter() - t0, time.process_time() - c0, outs

        if kwargs.get("compile_model"):
            # Compiled graphs for the workload's batch shapes are built on their first use: one
            # untimed pass, counted as warm-up, so the timed passes measure the compiled steps.
            t0 = time.perf_counter()
            workload()
            warmup += time.perf_counter() - t0
            if hasattr(engine, "reset_prefix_cache"):
                engine.reset_prefix_cache()
        wall, cpu, outs = workload()
        # The same prompts again: without this the instrumented pass would reuse the first pass's
        # prompt KV (prefix caching is on by default) and time a pass with almost no prefill.
        # Older checkouts (``tree=``) have no prefix cache on by default, nor this method.
        if hasattr(engine, "reset_prefix_cache"):
            engine.reset_prefix_cache()
        timers.on = True
        calls_before = timers.calls["step"]
        wall_instr, _, outs2 = workload()
        timers.on = False
        steps = timers.calls["step"] - calls_before
    finally:
        engine.close()
    res = _breakdown(timers, steps)
    res.update(
        variant=variant,
        wall_s=wall,
        cpu_s=cpu,
        wall_instrumented_s=wall_instr,
        tok_per_s=sum(new_tokens) / wall,
        engine_build_s=t0 - t_build,
        warmup_s=warmup,
        outputs=outs,
        same_outputs_twice=outs == outs2,
    )
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny,small", help="comma-separated: tiny, small, medium, or saved model paths")
    ap.add_argument("--variants", default="default", help="';'-separated EngineConfig kwargs lists")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds over the variants")
    ap.add_argument(
        "--config-type",
        default="llama",
        help="a transformers model type (qwen3, phi3...) built at --model's sizes from its config class's "
        "defaults (random weights; --model must be tiny, small or medium)",
    )
    ap.add_argument("--requests", type=int, default=None, help="default: 64 (medium: 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's weights")
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="time the parts by wall clock or by the driving thread's CPU time (with --threads 1 "
        "on a shared machine the CPU time is far less noisy); wall and CPU seconds of the "
        "whole workload are reported either way",
    )
    emulate_cpu.add_argument(ap)
    ap.add_argument("--json", default=None, help="write the median runs' figures and greedy outputs here")
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.single:
        res = run_single(args, args.variants)
        with open(args.single, "w") as f:
            json.dump(res, f)
        return 0
    variants = args.variants.split(";")
    report = {}
    from cpu_peak import copy_bandwidth_gbs, cpu_name, fma_peak_gflops

    torch.set_num_threads(args.threads)
    peaks = (fma_peak_gflops(args.threads)[0], copy_bandwidth_gbs())
    print(f"{cpu_name()}: FMA peak {peaks[0]:.0f} GFLOP/s float32, copy {peaks[1]:.1f} GB/s ({args.threads} threads)")
    print("prefill lin: linear ms per step with a prefill chunk, GFLOP/s (share of the FMA peak);")
    print(" decode lin: linear ms per decode-only step, weight GB/s read (share of the copy bandwidth)")
    for model in args.model.split(","):
        runs = defaultdict(list)
        for _ in range(args.repeats):
            for v in variants:  # interleaved: A B A B ... so load drifts hit both
                with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                    cmd = [
                        sys.executable,
                        __file__,
                        "--single",
                        tmp.name,
                        "--model",
                        model,
                        "--variants",
                        v,
                        *(["--requests", str(args.requests)] if args.requests else []),
                        "--seed",
                        str(args.seed),
                        "--threads",
                        str(args.threads),
                        "--dtype",
                        args.dtype,
                        "--config-type",
                        args.config_type,
                        "--clock",
                        args.clock,
                    ]
                    tree = _parse_variant(v).get("tree")
                    env = emulate_cpu.child_env(args.emulate_cpu)
                    if tree:
                        env["PYTHONPATH"] = tree
                    subprocess.run(cmd, check=True, env=env)
                    with open(tmp.name) as f:
                        runs[v].append(json.load(f))
        num_requests = len(runs[variants[0]][0]["outputs"])
        emulated = f", emulating {args.emulate_cpu}" if args.emulate_cpu else ""
        print(
            f"\n== {model} ({args.config_type}): {num_requests} requests, {args.threads} threads, {args.repeats} round(s){emulated} =="
        )
        header = f"{'part':>12} " + " ".join(f"{v[:22]:>24}" for v in variants)
        print(header)
        rows = {}
        for v in variants:
            rs = sorted(runs[v], key=lambda r: r["cpu_s" if args.clock == "cpu" else "wall_s"])
            rows[v] = rs[len(rs) // 2]  # the median run by wall time
        for part in PARTS:
            cells = [f"{rows[v]['ms_per_step'][part]:7.2f} ms {100 * rows[v]['share'][part]:5.1f}%" for v in variants]
            print(f"{part:>12} " + " ".join(f"{c:>24}" for c in cells))
        for label, key, fmt in (
            ("step ms", "step_ms", "{:.2f}"),
            ("steps", "steps", "{}"),
            ("Linear mods", "linear_calls_per_step", "{:.1f}"),
            ("wall s", "wall_s", "{:.2f}"),
            ("cpu s", "cpu_s", "{:.2f}"),
            ("tok/s", "tok_per_s", "{:.0f}"),
            ("warm-up s", "warmup_s", "{:.2f}"),
        ):
            print(f"{label:>12} " + " ".join(f"{fmt.format(rows[v][key]):>24}" for v in variants))
        for kind, what in (("prefill", "gflops"), ("decode", "weight_gbs")):
            unit, peak = ("GFLOP/s", peaks[0]) if what == "gflops" else ("GB/s", peaks[1])
            cells = []
            for v in variants:
                k = rows[v]["by_kind"][kind]
                cells.append(f"{k['linears_ms_per_step']:.1f} ms {k[what]:.0f} {unit[:-2]} ({k[what] / peak:.0%})")
            print(f"{kind + ' lin':>12} " + " ".join(f"{c:>24}" for c in cells))
        walls = {v: [round(r["wall_s"], 2) for r in runs[v]] for v in variants}
        cpus = {v: [round(r["cpu_s"], 2) for r in runs[v]] for v in variants}
        print(f"{'all walls':>12} {walls}")
        print(f"{'all cpu s':>12} {cpus}")
        base = variants[0]
        for v in variants[1:]:
            same = sum(a == b for a, b in zip(rows[base]["outputs"], rows[v]["outputs"]))

            def med(xs):
                return sorted(xs)[len(xs) // 2]

            print(
                f"{v}: {med(walls[base]) / med(walls[v]):.2f}x (wall), {med(cpus[base]) / med(cpus[v]):.2f}x (cpu) "
                f"vs {base}; identical outputs {same}/{num_requests}"
            )
        # Outputs kept too: runs of other dtypes or machines compare their greedy tokens from these files.
        report[model] = {v: dict(rows[v]) for v in variants}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
