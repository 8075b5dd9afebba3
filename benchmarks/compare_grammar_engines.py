"""xgrammar against llguidance for the engine's structured outputs, in one run: what the choice of
the grammar library rests on (issue 24).

    python benchmarks/compare_grammar_engines.py                  # both tokenizers, 64 rows
    python benchmarks/compare_grammar_engines.py --rows 64 --steps 200 --tokenizers embedded

Measured per tokenizer (the embedded model's 4,096-token byte-level BPE, and a 32,000-token
byte-level BPE trained here on the Python standard library's sources, cached under
``~/.cache/hf_contbatch``):

* tokenizer set-up: ``xgr.TokenizerInfo.from_huggingface`` / ``llguidance.hf.from_tokenizer`` (once
  per engine);
* compile time per schema, cold (a fresh compiler, so no cache) and warm (the same schema again);
* mask time per step at ``--rows`` rows: every row has its own matcher walking a valid JSON
  document of the schema (the tokenizer's own tokens); a step fills one ``[rows, vocab/32]``
  bitmask for all rows (one by one, and with the library's batched/parallel call) and applies it
  to ``[rows, vocab]`` float32 logits in one op (the same kernel for both), then every matcher
  accepts its next token;
* correctness: random walks through each matcher (a uniformly drawn allowed token each step, 60
  walks per schema) and whether the text ``json.loads`` parses and ``jsonschema`` accepts.

Timings are medians over ``--repeats`` runs of the loop; run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SCHEMAS = {
    "person (nested object, enum, bounded int, array maxItems)": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "role", "tags", "address"],
        "additionalProperties": False,
    },
    "order (20 properties, numbers, booleans, nested array of objects)": {
        "type": "object",
        "properties": {
            **{f"field_{i}": {"type": ["string", "number", "boolean"][i % 3]} for i in range(16)},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "maxItems": 4,
            },
            "total": {"type": "number"},
            "paid": {"type": "boolean"},
            "note": {"type": ["string", "null"]},
        },
        "required": [f"field_{i}" for i in range(16)] + ["items", "total", "paid", "note"],
        "additionalProperties": False,
    },
}


# --- tokenizers -------------------------------------------------------------------------------------
def embedded_tokenizer():
    from transformers import AutoTokenizer

    from hf_contbatch.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def bpe_32k_tokenizer():
    """A 32,000-token byte-level BPE trained on the standard library's ``.py`` files (offline),
    cached after the first run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(os.path.expanduser("~/.cache/hf_contbatch"), "bench_bpe_32k.json")
    if not os.path.exists(path):
        stdlib = sysconfig.get_paths()["stdlib"]
        files = sorted(
            f for f in glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True) if "site-packages" not in f
        )
        random.Random(0).shuffle(files)
        chosen, size = [], 0
        for f in files:  # about 24 MB of text is enough for 32k merges
            chosen.append(f)
            size += os.path.getsize(f)
            if size > 24_000_000:
                break
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=32000,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        t0 = time.perf_counter()

        def texts():  # a few test files of the standard library are not UTF-8
            for f in chosen:
                with open(f, encoding="utf-8", errors="ignore") as fh:
                    yield fh.read()

        tok.train_from_iterator(texts(), trainer)
        print(f"trained the 32k BPE on {size / 1e6:.0f} MB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tok.save(path)
    return PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>")


TOKENIZERS = {"embedded": embedded_tokenizer, "bpe32k": bpe_32k_tokenizer}


# --- documents the matchers walk --------------------------------------------------------------------
def instance(schema: dict, rng: random.Random):
    """A random valid instance of the (small subset of JSON schema used in) ``SCHEMAS``."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "object":
        return {k: instance(v, rng) for k, v in schema["properties"].items()}
    if kind == "array":
        return [instance(schema["items"], rng) for _ in range(rng.randint(0, schema.get("maxItems", 3)))]
    if kind == "string":
        words = ["alpha", "beta", "zip", "code", "x", "Paris", "list", "value"]
        return " ".join(rng.choice(words) for _ in range(3))[: schema.get("maxLength", 40)]
    if kind == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 1000))
    if kind == "number":
        return round(rng.uniform(-100, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    return None


def documents(tok, schema, n, seed=0):
    """``n`` token-id lists, each a valid document in the compact layout both grammars accept."""
    rng = random.Random(seed)
    return [
        tok.encode(json.dumps(instance(schema, rng), separators=(",", ":")), add_special_tokens=False) for _ in range(n)
    ]


# --- the two libraries behind one small interface ----------------------------------------------------
class Xgr:
    name = "xgrammar"

    def __init__(self, tok, vocab):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.vocab = vocab
        self.batch = xgr.BatchGrammarMatcher()

    def compiler(self):
        return self.xgr.GrammarCompiler(self.info)

    def compile(self, compiler, schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, rows):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill_serial(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def fill_batched(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, m, token):
        return m.accept_token(token)

    def reset(self, m):
        m.reset()


class Llg:
    name = "llguidance"

    def __init__(self, tok, vocab):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llt = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab
        self.executor = llguidance.LLExecutor()

    def compiler(self):
        return None  # llguidance compiles lazily inside the matcher; there is no compile cache object

    def compile(self, compiler, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        )
        m = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def allocate(self, rows):
        return self.llt.allocate_token_bitmask(rows, self.vocab)

    def fill_serial(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            self.llt.fill_next_token_bitmask(m, bitmask, i)

    def fill_batched(self, matchers, bitmask):
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def apply(self, logits, bitmask):
        # The bitmask layout is the same ([rows, ceil(vocab / 32)] int32, bit set = allowed), and
        # llguidance's own apply is a torch.compile'd kernel (compiled per shape): both apply with
        # the same C++ kernel here, so the "apply" column compares like with like.
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, m, token):
        return m.consume_token(token)

    def reset(self, m):
        m.reset()


LIBRARIES = (Xgr, Llg)


# --- measurements -------------------------------------------------------------------------------------
def compile_times(lib, schemas, repeats):
    out = {}
    for name, schema in schemas.items():
        cold = []
        for _ in range(repeats):
            comp = lib.compiler()
            t0 = time.perf_counter()
            lib.compile(comp, schema)
            cold.append(time.perf_counter() - t0)
        comp = lib.compiler()
        compiled = lib.compile(comp, schema)
        t0 = time.perf_counter()
        lib.compile(comp, schema)
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        lib.matcher(compiled)
        out[name] = (statistics.median(cold), warm, time.perf_counter() - t0)
    return out


def mask_step_times(lib, schema, docs, rows, steps, repeats):
    """Median seconds per step of (fill, apply, accept) with serial and batched fills."""
    compiled = lib.compile(lib.compiler(), schema)
    results = {}
    for mode in ("serial", "batched"):
        per_step = []
        for _ in range(repeats):
            matchers = [lib.matcher(compiled) for _ in range(rows)]
            pos = [0] * rows
            which = list(range(rows))
            bitmask = lib.allocate(rows)
            logits = torch.randn(rows, lib.vocab)
            fill = lib.fill_serial if mode == "serial" else lib.fill_batched
            t_fill = t_apply = t_accept = 0.0
            for _ in range(steps):
                t0 = time.perf_counter()
                fill(matchers, bitmask)
                t1 = time.perf_counter()
                lib.apply(logits, bitmask)
                t2 = time.perf_counter()
                for i, m in enumerate(matchers):
                    doc = docs[which[i] % len(docs)]
                    if pos[i] == len(doc):  # document done: the row starts the next one
                        lib.reset(m)
                        which[i] += rows
                        pos[i] = 0
                        doc = docs[which[i] % len(docs)]
                    if not lib.accept(m, doc[pos[i]]):
                        raise RuntimeError(f"{lib.name} rejected a valid document's token")
                    pos[i] += 1
                t3 = time.perf_counter()
                t_fill, t_apply, t_accept = t_fill + t1 - t0, t_apply + t2 - t1, t_accept + t3 - t2
            per_step.append((t_fill / steps, t_apply / steps, t_accept / steps))
        results[mode] = tuple(statistics.median(x[k] for x in per_step) for k in range(3))
    return results


def random_walks(lib, tok, schema, walks, max_tokens=300, seed=0):
    """(parsed and valid, invalid JSON, schema violations, unfinished) over ``walks`` walks."""
    import jsonschema

    compiled = lib.compile(lib.compiler(), schema)
    eos = tok.eos_token_id
    shifts = torch.arange(32, dtype=torch.int32)
    rng = random.Random(seed)
    counts = {"valid": 0, "invalid_json": 0, "schema_violation": 0, "unfinished": 0}
    for _ in range(walks):
        m = lib.matcher(compiled)
        bitmask = lib.allocate(1)
        out, finished = [], False
        for _ in range(max_tokens):
            lib.fill_serial([m], bitmask)
            allowed = ((bitmask[0][:, None] >> shifts) & 1).flatten()[: lib.vocab].nonzero()[:, 0].tolist()
            t = rng.choice(allowed)
            if t == eos:
                finished = True
                break
            lib.accept(m, t)
            out.append(t)
        if not finished:
            counts["unfinished"] += 1
            continue
        try:
            value = json.loads(tok.decode(out))
        except ValueError:
            counts["invalid_json"] += 1
            continue
        try:
            jsonschema.validate(value, schema)
            counts["valid"] += 1
        except jsonschema.ValidationError:
            counts["schema_violation"] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--walks", type=int, default=60)
    ap.add_argument("--tokenizers", default="embedded,bpe32k")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    report = {}
    for tname in args.tokenizers.split(","):
        tok = TOKENIZERS[tname]()
        vocab = len(tok)
        print(f"\n=== tokenizer {tname}: {vocab} tokens; {args.rows} rows, {args.steps} steps ===")
        for cls in LIBRARIES:
            t0 = time.perf_counter()
            lib = cls(tok, vocab)
            setup = time.perf_counter() - t0
            print(f"{lib.name}: tokenizer set-up {setup * 1e3:.0f} ms")
            entry = report.setdefault(tname, {}).setdefault(lib.name, {"tokenizer_setup_s": setup})
            for sname, (cold, warm, matcher) in compile_times(lib, SCHEMAS, args.repeats).items():
                print(
                    f"  compile {sname[:40]:40s} cold {cold * 1e3:8.2f} ms  warm {warm * 1e3:8.2f} ms  "
                    f"new matcher {matcher * 1e6:7.1f} us"
                )
                entry.setdefault("compile", {})[sname] = {"cold_s": cold, "warm_s": warm, "matcher_s": matcher}
            for sname, schema in SCHEMAS.items():
                docs = documents(tok, schema, 4 * args.rows)
                times = mask_step_times(lib, schema, docs, args.rows, args.steps, args.repeats)
                for mode, (fill, apply, accept) in times.items():
                    print(
                        f"  step {sname[:30]:30s} {mode:8s} fill {fill * 1e6:8.0f} us  apply {apply * 1e6:6.0f} us  "
                        f"accept {accept * 1e6:6.0f} us  total {(fill + apply + accept) * 1e6:8.0f} us"
                    )
                    entry.setdefault("step", {}).setdefault(sname, {})[mode] = {
                        "fill_s": fill,
                        "apply_s": apply,
                        "accept_s": accept,
                    }
                if args.walks:
                    counts = random_walks(lib, tok, schema, args.walks)
                    print(f"  walks {sname[:30]:30s} {counts}")
                    entry.setdefault("walks", {})[sname] = counts
        for sname in SCHEMAS:
            x = report[tname]["xgrammar"]["step"][sname]
            g = report[tname]["llguidance"]["step"][sname]
            best = {k: min(sum(v[m].values()) for m in v) for k, v in (("xgrammar", x), ("llguidance", g))}
            print(f"  {sname[:40]:40s} best step: xgrammar/llguidance = {best['xgrammar'] / best['llguidance']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
