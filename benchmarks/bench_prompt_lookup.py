"""Prompt-lookup speculative decoding on an input-grounded workload: hf_contbatch with and without
drafts, against transformers' ``generate`` with and without ``prompt_lookup_num_tokens``, in one run.

    python benchmarks/bench_prompt_lookup.py                 # embedded model, k = 4
    python benchmarks/bench_prompt_lookup.py --k 8 --model small

Workload: 16 prompts that each hold a short Python snippet and then ask for it again (the answer
copies from the prompt, as in editing, extraction or "continue this code"); greedy, up to
``--max-new-tokens`` each, EOS honoured. transformers' assisted generation runs one prompt at a time
(it requires batch size 1), so ours runs both ways: every request submitted at once (the engine's
normal use) and one at a time (like for like). Throughput = generated tokens / wall time; each
engine runs in its own fresh process after a cool-down (see ``workload.run_in_own_process``).
Greedy outputs of every engine are compared with plain ``generate``'s and the agreement printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workload import build_model, run_in_own_process  # noqa: E402

ENGINES = ("generate", "generate_lookup", "ours", "ours_lookup", "ours_serial", "ours_lookup_serial")

NAMES = ["total", "count", "scale", "merge", "parse", "clip", "shift", "norm"]
OPS = ["a + b", "a * b - 1", "max(a, b)", "a // (b or 1)", "[a] * b", "a - b * 2"]


def make_prompts(tok, n: int = 16) -> list[list[int]]:
    """Token ids of ``n`` prompts: a snippet, then a request to write it again, and its first line."""
    prompts = []
    for i in range(n):
        name = NAMES[i % len(NAMES)] + str(i)
        lines = [
            f"def {name}(a, b):",
            f'    """Return {OPS[i % len(OPS)]} for the two arguments."""',
            f"    result = {OPS[i % len(OPS)]}",
            f"    return result + {i}",
            "",
            f"values = [{name}(x, {i + 1}) for x in range(10)]",
        ]
        code = "\n".join(lines)
        text = f"{code}\n\n# The same code again:\n{lines[0]}\n"
        prompts.append(tok(text)["input_ids"])
    return prompts


def load(args):
    """(model, tokenizer): the embedded model, or the random "small" anchor Llama with the embedded
    tokenizer (its 4,096 ids fit small's 8,192-row embedding; not tiny's 2,048)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_contbatch.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    if args.model == "embedded":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tok
    return build_model(args.model), tok


def run_generate(model, prompts, args, lookup: bool):
    outs, t0 = [], time.perf_counter()
    kw = {"prompt_lookup_num_tokens": args.k} if lookup else {}
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False, **kw
            )
        outs.append(out[0, len(p) :].tolist())
    return time.perf_counter() - t0, outs, None


def run_ours(model, prompts, args, k: int, serial: bool):
    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(model, EngineConfig(cache=CacheConfig(num_blocks=1024, block_size=16), prompt_lookup_num_tokens=k))
    eos = tuple([model.generation_config.eos_token_id] if model.generation_config.eos_token_id is not None else [])
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    try:
        eng.submit(prompts[0], SamplingParams(max_new_tokens=4)).result(120)  # warm-up
        eng.reset_prefix_cache()  # the timed pass must not reuse the warm-up's prompt KV
        before = eng.stats()
        t0 = time.perf_counter()
        if serial:
            outs = [eng.submit(p, sp).result(600).output_token_ids for p in prompts]
        else:
            handles = [eng.submit(p, sp) for p in prompts]
            outs = [h.result(600).output_token_ids for h in handles]
        wall = time.perf_counter() - t0
        st = eng.stats()
        drafts = st.num_draft_tokens - before.num_draft_tokens
        accepted = st.num_accepted_draft_tokens - before.num_accepted_draft_tokens
        return (
            wall,
            outs,
            {"drafts": drafts, "accepted": accepted, "iterations": st.num_iterations - before.num_iterations},
        )
    finally:
        eng.close()


def run_single(engine: str, args) -> dict:
    torch.manual_seed(0)
    model, tok = load(args)
    prompts = make_prompts(tok, args.num_prompts)
    if engine.startswith("generate"):
        wall, outs, extra = run_generate(model, prompts, args, lookup=engine == "generate_lookup")
    else:
        k = args.k if "lookup" in engine else 0
        wall, outs, extra = run_ours(model, prompts, args, k, serial=engine.endswith("serial"))
    tokens = sum(len(o) for o in outs)
    return {"engine": engine, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "outputs": outs, "spec": extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded", choices=["embedded", "small"])
    ap.add_argument("--k", type=int, default=4, help="prompt_lookup_num_tokens")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--cooldown", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    engines = args.engines.split(",")
    if args.single:
        with open(args.single, "w") as f:
            json.dump(run_single(engines[0], args), f)
        return
    results = {}
    for i, e in enumerate(engines):
        results[e] = run_in_own_process(__file__, e, sys.argv[1:], cooldown_s=args.cooldown if i else 0.0)
        r = results[e]
        extra = ""
        if r["spec"] and r["spec"]["drafts"]:
            s = r["spec"]
            extra = f"  drafts {s['drafts']}, accepted {s['accepted']} ({s['accepted'] / s['drafts']:.0%}), iterations {s['iterations']}"
        print(f"{e:20s} {r['tokens']:5d} tokens in {r['wall_s']:6.2f} s = {r['tok_s']:7.1f} tok/s{extra}", flush=True)
    ref = results.get("generate")
    if ref:
        for e, r in results.items():
            same = sum(a == b for a, b in zip(r["outputs"], ref["outputs"]))
            print(f"{e:20s} greedy outputs equal to plain generate: {same}/{len(ref['outputs'])}")

    def ratio(a, b):
        if a in results and b in results:
            print(f"{a} / {b}: {results[a]['tok_s'] / results[b]['tok_s']:.2f}x")

    ratio("ours_lookup", "ours")
    ratio("ours_lookup", "generate_lookup")
    ratio("ours_lookup_serial", "generate_lookup")
    ratio("ours_serial", "generate")
    ratio("generate_lookup", "generate")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({e: {k: v for k, v in r.items() if k != "outputs"} for e, r in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
