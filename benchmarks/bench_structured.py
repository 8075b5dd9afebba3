"""Structured outputs in the batch: 64 JSON-schema constrained requests against the same requests
unconstrained, and against ``generate`` with xgrammar's transformers processor one prompt at a
time (the way users constrain outputs with transformers today), in one command, with ratios.

    python benchmarks/bench_structured.py                       # embedded model, then "small"
    python benchmarks/bench_structured.py --models embedded --requests 64 --baseline-prompts 16

Per model (the embedded 4M-parameter Llama, and the random-weight "small" anchor Llama of
``workload.py`` with the embedded tokenizer, whose 8,192 logits the grammar masks):

* constrained: 64 greedy requests, each ``structured_outputs={"json": SCHEMA}``, all submitted at
  once (grammar compiled beforehand: the cache is warm); they stop where the grammar ends.
* unconstrained: the same prompts, each with ``max_new_tokens`` set to the length its constrained
  run produced and EOS ignored, so both runs generate the same tokens per request and the batch
  drains the same way: the ratio isolates what the grammar costs (target: at least 0.85x).
* mask time per step: seconds inside ``GrammarMatchers.mask_rows`` (fill one bitmask for every
  constrained row, apply it in one op) per step that had constrained rows, and per row.
* compile: a new schema against the model's tokenizer (cold; xgrammar's tokenizer info is built
  before, once per engine), and the same schema again (warm cache).
* baseline: ``model.generate(logits_processor=[xgrammar.contrib.hf.LogitsProcessor(compiled)])``
  prompt by prompt on the first ``--baseline-prompts`` prompts; its tokens are compared with ours,
  and both sides' outputs with ``json.loads`` (the baseline compiles the schema as given, so its
  length-bounded strings may hold raw control characters: see ``engine/structured/specs.py``).

Throughput = generated tokens / wall seconds; after one warm-up run, constrained and unconstrained
runs alternate ``--repeats`` times and the median of each is reported. Run on an otherwise idle
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from workload import build_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["function", "class", "module", "statement"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "source": {
            "type": "object",
            "properties": {
                "file": {"type": "string", "maxLength": 20},
                "line": {"type": "integer", "minimum": 1, "maximum": 9999},
            },
            "required": ["file", "line"],
        },
        "public": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "tags", "source", "public"],
}
SUBJECTS = [
    "the for statement",
    "a class",
    "exceptions",
    "the import system",
    "lambda",
    "a dictionary",
    "generators",
    "the with statement",
]


def prompts(tok, n: int) -> list[list[int]]:
    return [tok(f"Record {i} about {SUBJECTS[i % len(SUBJECTS)]} as JSON:")["input_ids"] for i in range(n)]


def load(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_contbatch.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    if name == "embedded":
        return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval(), tok
    return build_model(name), tok  # the anchor model: the embedded tokenizer's 4,096 ids fit its 8,192 rows


def run_engine(model, tok, ids, max_new, constrained: bool):
    """(wall seconds, outputs, mask seconds, steps with mask, masked rows, compile cold s, warm s)."""
    from hf_contbatch import EngineConfig, LLMEngine, SamplingParams
    from hf_contbatch.engine.structured import GrammarSpec

    engine = LLMEngine(model, EngineConfig(), tokenizer=tok)
    try:
        compilation = engine.grammars.compilation
        compilation.compile(GrammarSpec.parse({"json": {"type": "boolean"}})).result()  # tokenizer info, once
        spec = GrammarSpec.parse({"json": SCHEMA})
        t0 = time.perf_counter()
        engine.grammars.compilation.compile(spec).result()
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.grammars.compilation.compile(spec).result()
        warm = time.perf_counter() - t0
        mask = {"seconds": 0.0, "steps": 0, "rows": 0}
        inner = engine.grammars.mask_rows

        def timed(scores, rows, requests, **kwargs):
            t = time.perf_counter()
            inner(scores, rows, requests, **kwargs)
            mask["seconds"] += time.perf_counter() - t
            mask["steps"] += 1
            mask["rows"] += len(rows)

        engine.grammars.mask_rows = timed
        engine.submit(ids[0][:4], SamplingParams(max_new_tokens=2, ignore_eos=True)).result()  # warm-up
        t0 = time.perf_counter()
        handles = []
        for p, n in zip(ids, max_new):
            if constrained:
                sp = SamplingParams(
                    max_new_tokens=n, eos_token_ids=(tok.eos_token_id,), structured_outputs={"json": SCHEMA}
                )
            else:
                sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
            handles.append(engine.submit(p, sp))
        outs = [h.result().output_token_ids for h in handles]
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    return wall, outs, mask, cold, warm


def run_generate(model, tok, ids, max_new: int):
    """``generate`` with xgrammar's transformers processor, one prompt at a time."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.get_output_embeddings().weight.shape[0])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    outs = []
    t0 = time.perf_counter()
    for p in ids:
        x = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
                logits_processor=[LogitsProcessor(compiled)],
            )
        outs.append(out[0, len(p) :].tolist())
    return time.perf_counter() - t0, outs


def parsing(tok, outs) -> str:
    """How many of ``outs`` (token-id lists) ``json.loads`` parses, as "k/n"."""
    ok = 0
    for o in outs:
        try:
            json.loads(tok.decode(o, skip_special_tokens=True))
            ok += 1
        except ValueError:  # e.g. a raw control character in a length-bounded string
            pass
    return f"{ok}/{len(outs)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="embedded,small")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--baseline-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    report = {}
    for name in args.models.split(","):
        model, tok = load(name)
        ids = prompts(tok, args.requests)
        # A first run warms what every engine shares in this process (native kernels, caches); then
        # constrained and unconstrained runs alternate, and the median of each counts.
        _, outs_c, _, _, _ = run_engine(model, tok, ids, [args.max_new_tokens] * len(ids), True)
        lengths = [len(o) for o in outs_c]
        runs_c, runs_u = [], []
        for _ in range(args.repeats):
            runs_u.append(run_engine(model, tok, ids, lengths, False))
            runs_c.append(run_engine(model, tok, ids, [args.max_new_tokens] * len(ids), True))
        wall_u, outs_u, _, _, _ = sorted(runs_u, key=lambda r: r[0])[len(runs_u) // 2]
        wall_c, outs_c, mask, cold, warm = sorted(runs_c, key=lambda r: r[0])[len(runs_c) // 2]
        assert [len(o) for o in outs_c] == lengths, "greedy constrained runs differ between repeats"
        n_base = min(args.baseline_prompts, len(ids))
        wall_g, outs_g = run_generate(model, tok, ids[:n_base], args.max_new_tokens)
        tokens_c, tokens_u = sum(lengths), sum(len(o) for o in outs_u)
        tps_c, tps_u = tokens_c / wall_c, tokens_u / wall_u
        tps_g = sum(len(o) for o in outs_g) / wall_g
        row = {
            "constrained_tok_s": tps_c,
            "unconstrained_tok_s": tps_u,
            "ratio_constrained_over_unconstrained": tps_c / tps_u,
            "generate_xgrammar_tok_s": tps_g,
            "ratio_constrained_over_generate": tps_c / tps_g,
            "tokens": tokens_c,
            "mask_ms_per_step": 1e3 * mask["seconds"] / max(1, mask["steps"]),
            "mask_us_per_row": 1e6 * mask["seconds"] / max(1, mask["rows"]),
            "steps_with_mask": mask["steps"],
            "compile_cold_ms": 1e3 * cold,
            "compile_warm_ms": 1e3 * warm,
            "outputs_parsing": parsing(tok, outs_c),
            "generate_outputs_parsing": parsing(tok, outs_g),
            "equal_to_generate": f"{sum(a == b for a, b in zip(outs_c, outs_g))}/{n_base}",
        }
        report[name] = row
        print(
            f"{name}: constrained {tps_c:.0f} tok/s, unconstrained {tps_u:.0f} tok/s "
            f"(ratio {row['ratio_constrained_over_unconstrained']:.2f}); generate + xgrammar one at a time "
            f"{tps_g:.0f} tok/s (ours {row['ratio_constrained_over_generate']:.2f}x); {tokens_c} tokens; mask "
            f"{row['mask_ms_per_step']:.2f} ms/step ({row['mask_us_per_row']:.1f} us/row, {mask['steps']} steps); "
            f"compile cold {row['compile_cold_ms']:.1f} ms, warm {row['compile_warm_ms']:.3f} ms; "
            f"parsing {row['outputs_parsing']} (generate's {row['generate_outputs_parsing']}); equal to generate "
            f"{row['equal_to_generate']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
