"""One request at a time: what a notebook's ``pipe("...")`` feels like, beside transformers' ``generate``.

    python benchmarks/bench_single.py                                # medium model, fp32, bf16, int8
    python benchmarks/bench_single.py --model tiny --repeats 5 --precisions fp32
    python benchmarks/bench_single.py --precisions w8a8 --json single.json

One prompt (default 192 prompt tokens) and 128 new tokens, greedy, EOS ignored, one request in
flight. Every repeat draws a prompt neither engine has seen (so no prefix-cache hit), and both
engines run it in the same process, their order alternating between repeats. Printed per precision,
medians over ``--repeats``:

- TTFT: time to first token, ms. Ours: ``pipe.last_call_stats["ttft_s"]`` (from the request's
  arrival at the engine); ``generate``: from the call to the first new token its streamer receives.
- ITL: ms per output token after the first (``(last token - first token) / (n - 1)``).
- tok/s: new tokens / wall time of the whole call (what the issue's tables count: prefill included).

"ours" is ``hf_contbatch.pipeline`` with the default ``EngineConfig`` (``int8``: ``quantization="int8"``,
weight-only int8 linears; ``w8a8``: int8 weights and activations; both with an int8 KV cache,
``CacheConfig(dtype="int8")``); "generate" is transformers' ``model.generate`` on a second copy of
the same weights (never touched by our engine), ``fp32``/``bf16`` only: transformers has no
quantization of its own to compare the int8 rows with. "same tokens" compares the two engines'
greedy tokens on every repeat's prompt (fp32 must match; bf16 may drift where two logits tie within
bf16's rounding).

``--emulate-cpu no-bf16`` reruns the command in a child process as on a CPU without native bf16
(``emulate_cpu.py``). Models: ``--model tiny|small|medium`` (``workload.MODEL_SIZES``: random-weight Llamas; medium is
SmolLM2-360M's shape) or a saved model's path. Timing on a shared machine is noisy: quote figures
with the machine's load (printed at the end) and rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import emulate_cpu  # noqa: E402

from workload import build_model, build_tokenizer  # noqa: E402

#: precision -> (model dtype, EngineConfig.quantization, CacheConfig.dtype or None for the default)
PRECISIONS = {
    "fp32": (torch.float32, None, None),
    "bf16": (torch.bfloat16, None, None),
    "int8": (torch.float32, "int8", "int8"),
    "w8a8": (torch.float32, "w8a8", "int8"),
}


class _TokenClock:
    """A transformers streamer that notes when each new token arrives (``generate`` hands it the
    prompt first, then one ``[1]`` tensor per new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_generate(model, prompt: list[int], new_tokens: int) -> dict:
    """One greedy ``model.generate`` call of ``new_tokens`` tokens; its TTFT, ITL and tok/s."""
    clock = _TokenClock()
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
    wall = time.perf_counter() - t0
    n = len(clock.times)
    return {
        "ttft_s": clock.times[0] - t0,
        "itl_s": (clock.times[-1] - clock.times[0]) / (n - 1) if n > 1 else None,
        "tok_per_s": n / wall,
        "wall_s": wall,
        "tokens": out[0, len(prompt) :].tolist(),
    }


def run_ours(pipe, prompt: list[int], new_tokens: int) -> dict:
    """One ``pipe(text)`` call (the word-level tokenizer maps the text back to ``prompt`` exactly);
    its TTFT and ITL from ``pipe.last_call_stats``, tok/s from the call's wall time."""
    text = " ".join(f"w{i}" for i in prompt)
    t0 = time.perf_counter()
    (record,) = pipe(text, max_new_tokens=new_tokens, do_sample=False, ignore_eos=True, return_tensors=True)
    wall = time.perf_counter() - t0
    stats = pipe.last_call_stats
    tokens = record["generated_token_ids"][len(prompt) :]
    return {
        "ttft_s": stats["ttft_s"],
        "itl_s": stats["itl_s"],
        "tok_per_s": len(tokens) / wall,
        "wall_s": wall,
        "tokens": tokens,
    }


def _median(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def bench_precision(args, precision: str, rng: random.Random) -> dict:
    """Both engines on ``--repeats`` fresh prompts, interleaved; medians and token agreement."""
    import hf_contbatch
    from hf_contbatch import CacheConfig, EngineConfig

    dtype, quantization, kv_dtype = PRECISIONS[precision]
    ours_model = build_model(args.model, seed=args.seed, dtype=dtype)
    vocab = ours_model.config.vocab_size
    with_generate = quantization is None and not args.no_generate
    # generate's own copy: our engine patches the model it serves (attention, packed linears).
    ref_model = build_model(args.model, seed=args.seed, dtype=dtype) if with_generate else None
    config = EngineConfig(quantization=quantization, cache=CacheConfig(dtype=kv_dtype) if kv_dtype else CacheConfig())
    t0 = time.perf_counter()
    pipe = hf_contbatch.pipeline(
        "text-generation", model=ours_model, tokenizer=build_tokenizer(vocab), engine_config=config
    )

    def fresh_prompt() -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]

    try:
        # Warm-up, untimed: first-call costs (kernel builds, GEMM timings, allocations) at the
        # timed shapes: a full-length prompt, a few decode steps.
        run_ours(pipe, fresh_prompt(), 4)
        if with_generate:
            run_generate(ref_model, fresh_prompt(), 4)
        setup_s = time.perf_counter() - t0
        ours, gen, same = [], [], []
        for r in range(args.repeats):
            prompt = fresh_prompt()
            order = ("generate", "ours") if r % 2 == 0 else ("ours", "generate")
            for engine in order:
                if engine == "ours":
                    ours.append(run_ours(pipe, prompt, args.new_tokens))
                elif with_generate:
                    gen.append(run_generate(ref_model, prompt, args.new_tokens))
            if with_generate:
                same.append(ours[-1]["tokens"] == gen[-1]["tokens"])
    finally:
        pipe.close()
    result = {"precision": precision, "setup_s": setup_s, "same_tokens": same}
    for name, runs in (("ours", ours), ("generate", gen)):
        if runs:
            result[name] = {key: _median(runs, key) for key in ("ttft_s", "itl_s", "tok_per_s", "wall_s")}
            result[name]["runs"] = [{k: v for k, v in run.items() if k != "tokens"} for run in runs]
    return result


def _ms(seconds) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:,.1f}"


def print_header(args) -> None:
    print(
        f"\none request: {args.prompt_tokens} prompt tokens + {args.new_tokens} new tokens, greedy, EOS ignored, "
        f"model {args.model}, {torch.get_num_threads()} threads, median of {args.repeats}"
        + (f", emulating {args.emulate_cpu}" if args.emulate_cpu else "")
    )
    head = (
        f"{'precision':<10}{'engine':<10}{'TTFT ms':>10}{'ITL ms':>10}{'tok/s':>9}{'wall s':>9}   ours/generate tok/s"
    )
    print(head)
    print("-" * len(head), flush=True)


def print_rows(res: dict) -> None:
    """One precision's rows (printed as soon as it is measured: a medium run takes minutes)."""
    ratio = ""
    if "generate" in res and res["ours"]["tok_per_s"] and res["generate"]["tok_per_s"]:
        ratio = f"{res['ours']['tok_per_s'] / res['generate']['tok_per_s']:.2f}x"
    for name in ("ours", "generate"):
        if name not in res:
            continue
        m = res[name]
        print(
            f"{res['precision']:<10}{name:<10}{_ms(m['ttft_s']):>10}{_ms(m['itl_s']):>10}"
            f"{m['tok_per_s']:>9.1f}{m['wall_s']:>9.2f}   {ratio if name == 'ours' else ''}"
        )
    if res["same_tokens"]:
        print(f"{'':<10}same tokens on {sum(res['same_tokens'])}/{len(res['same_tokens'])} prompts")
    sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="medium", help="tiny, small, medium, or a saved model's path")
    ap.add_argument("--precisions", default="fp32,bf16,int8", help=f"comma-separated, of {', '.join(PRECISIONS)}")
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="model weights' seed")
    ap.add_argument(
        "--prompt-seed", type=int, default=None, help="prompts' seed (default: the time: new prompts every run)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-generate", action="store_true", help="ours only")
    ap.add_argument("--json", help="also write the figures (every run's, and the medians) here")
    emulate_cpu.add_argument(ap)
    args = ap.parse_args(argv)
    if not emulate_cpu.emulating(args.emulate_cpu):  # the same command again, as on the emulated CPU
        argv = sys.argv[1:] if argv is None else list(argv)
        env = emulate_cpu.child_env(args.emulate_cpu)
        return subprocess.run([sys.executable, __file__, *argv], env=env).returncode
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        ap.error(f"--precisions: unknown {', '.join(unknown)} (known: {', '.join(PRECISIONS)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.prompt_seed if args.prompt_seed is not None else time.time_ns())
    print_header(args)
    results = []
    for precision in precisions:
        results.append(bench_precision(args, precision, rng))
        print_rows(results[-1])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None:
        print(f"load average (1 min) at the end: {load:.2f} on {os.cpu_count()} cores")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results, "load_1min": load}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
