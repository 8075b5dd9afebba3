#!/usr/bin/env python
"""Train the small Llama-architecture model embedded in ``hf_contbatch/default_model``.

Everything here runs offline: the training text is the Python standard library's own
documentation (``pydoc_data.topics.topics`` plus docstrings parsed -- never imported --
from the stdlib's ``.py`` files), the tokenizer is trained from scratch with the
``tokenizers`` library and the model is a freshly initialised ``LlamaForCausalLM``.

Usage (from the repository root)::

    python scripts/train_default_model.py                 # ~8 min of training on 2 CPU cores
    python scripts/train_default_model.py --minutes 2     # shorter budget
    python scripts/train_default_model.py --steps 300     # fixed step count (bit-for-bit repeatable)

Data order and initialisation are seeded. With ``--minutes`` the cosine LR decay follows
the elapsed fraction of the wall budget (robust to a busy machine), so the number of steps
depends on CPU speed; ``--steps N`` uses a step-indexed schedule instead and repeats a run
exactly on the same Python / torch / tokenizers versions.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "hf_contbatch" / "default_model"

EOS = "<|endoftext|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [EOS, *ROLE_TOKENS]

# Jinja chat template: every message is "<|role|>\n<content>\n"; assistant turns end with
# the eos token so that a trained continuation stops by itself.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

MAX_SIZE_MB = 10.0

# Stdlib folders whose docstrings are skipped (tests, GUI demos, vendored code).
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "__pycache__",
    "ensurepip",
    "tkinter",
    "pydoc_data",
}


# --------------------------------------------------------------------------- corpus
def _paragraphs(text: str, max_chars: int) -> str:
    """Leading paragraphs of ``text`` up to about ``max_chars`` characters."""
    out, total = [], 0
    for para in text.split("\n\n"):
        para = para.rstrip()
        if not para:
            continue
        if out and total + len(para) > max_chars:
            break
        out.append(para)
        total += len(para) + 2
    return "\n\n".join(out)


def _chat(user: str, assistant: str) -> str:
    return f"<|user|>\n{user}\n<|assistant|>\n{assistant}{EOS}\n"


def stdlib_docstrings() -> list[tuple[str, bool, str]]:
    """(dotted name, is_module, docstring) triples, parsed with ``ast`` (no imports, no side effects)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[tuple[str, bool, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("test", "config-", "plat-"))
        )
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("test"):
                continue
            path = Path(dirpath) / fn
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not parts or parts[0].startswith("_"):
                continue  # private top-level modules (_pydecimal, _collections_abc, ...)
            modname = ".".join(parts)
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            mdoc = ast.get_docstring(tree)
            if mdoc and len(mdoc) >= 40:
                docs.append((modname, True, mdoc))
            for node in ast.walk(tree):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.name.startswith("_"):
                        continue
                    d = ast.get_docstring(node)
                    if d and len(d) >= 120:
                        docs.append((f"{modname}.{node.name}", False, d))
    return docs


def build_corpus(seed: int) -> list[str]:
    """Documents of the training corpus, in a seeded, shuffled order."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    docs: list[str] = []

    # 1. pydoc topics (the language reference), twice: it is the core of the corpus.
    topic_docs = [topics[k].strip() for k in sorted(topics)]
    docs += topic_docs * 2

    # 2. stdlib docstrings.
    std = stdlib_docstrings()
    docs += [d for _, _, d in std]

    # 3. a few chat-formatted examples so that chat-template prompts look familiar.
    questions = [
        "What is {}?",
        "Explain {}.",
        "Tell me about {}.",
        "Describe {}.",
        "How does {} work?",
    ]
    for key in sorted(topics):
        text = topics[key].strip()
        title = text.split("\n", 1)[0].strip()
        body = text.split("\n", 1)[1].lstrip("*\n ") if "\n" in text else text
        answer = _paragraphs(body, 600)
        if answer:
            docs.append(_chat(rng.choice(questions).format(title), answer))
    for modname, is_module, d in std:
        if not is_module:
            continue
        answer = _paragraphs(d, 400)
        if len(answer) >= 40:
            docs.append(_chat(rng.choice(questions).format(f"the {modname} module"), answer))

    rng.shuffle(docs)
    return docs


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    # Train on the raw text (role tokens removed so that no merge swallows them).
    def texts():
        for d in docs:
            for t in SPECIAL_TOKENS:
                d = d.replace(t, " ")
            yield d

    tok.train_from_iterator(texts(), trainer=trainer, length=len(docs))

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def check_roundtrip(tok) -> None:
    samples = [
        "The for statement is used to iterate over the elements of a sequence.",
        "  leading spaces\ttabs\n\nnewlines  ",
        "Unicode: naïve café — 你好, мир! 🐍 \u0000\x7f",
        "def f(x: int) -> dict[str, list[int]]:\n    return {'a': [x ** 2]}\n",
    ]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False)
        back = tok.decode(ids)
        if back != s:
            raise SystemExit(f"tokenizer round-trip failed: {s!r} -> {back!r}")


# --------------------------------------------------------------------------- model
def build_model(tok, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    eos_id = tok.convert_tokens_to_ids(EOS)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    return model


def lr_at(
    step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1, progress: float | None = None
) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio * peak``.

    The decay follows ``step / total``, or ``progress`` (a 0..1 fraction) when given.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = progress if progress is not None else (step - warmup) / max(1, total - warmup)
    prog = min(1.0, max(0.0, prog))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def make_batch(data: torch.Tensor, g: torch.Generator, bsz: int, seq: int) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq - 1, (bsz,), generator=g)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def train_step(model, opt, batch, lr) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    logits = model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, seq: int, max_windows: int = 32) -> float:
    model.eval()
    n = min(max_windows, (data.numel() - 1) // seq)
    losses = []
    for i in range(0, n, 8):
        rows = [data[j * seq : j * seq + seq + 1] for j in range(i, min(n, i + 8))]
        batch = torch.stack(rows)
        logits = model(input_ids=batch[:, :-1]).logits
        losses.append(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1)
            ).item()
        )
    model.train()
    return sum(losses) / max(1, len(losses))


def make_optimizer(model, lr, wd):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def folder_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.suffix != ".py") / 1e6


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=None, help="fixed number of steps (overrides --minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()

    # ---- corpus + tokenizer
    docs = build_corpus(args.seed)
    n_chars = sum(len(d) for d in docs)
    print(
        f"corpus: {len(docs)} documents, {n_chars / 1e6:.2f} M characters (python {sys.version.split()[0]})", flush=True
    )
    tok = train_tokenizer(docs, args.vocab)
    check_roundtrip(tok)
    eos_id = tok.convert_tokens_to_ids(EOS)
    print(
        f"tokenizer: byte-level BPE, {len(tok)} tokens, eos/bos/pad id {eos_id} ({time.time() - t0:.1f}s)", flush=True
    )

    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    data = torch.tensor(ids, dtype=torch.long)
    n_val = max(args.seq * 32 + 1, data.numel() // 50)
    train_data, val_data = data[:-n_val], data[-n_val:]
    print(
        f"tokens: {data.numel():,} ({n_chars / data.numel():.2f} chars/token), "
        f"train {train_data.numel():,}, val {val_data.numel():,}",
        flush=True,
    )

    # ---- model
    model = build_model(tok, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: LlamaForCausalLM, {n_params / 1e6:.2f} M parameters (tied embeddings)", flush=True)
    model.train()

    # ---- train
    # --steps N: a step-indexed schedule, bit-for-bit repeatable (same seed, same versions).
    # --minutes M (default): train until the wall budget is spent; the LR schedule follows
    # the elapsed fraction of the budget, so the run ends on a fully decayed LR even when
    # other processes slow the CPU down (the step count reached is printed at the end).
    budget_s = args.minutes * 60.0
    opt = make_optimizer(model, args.lr, args.weight_decay)
    g = torch.Generator().manual_seed(args.seed)
    init_val = eval_loss(model, val_data, args.seq)
    mode = f"{args.steps} steps" if args.steps else f"{args.minutes:g} min wall budget"
    print(f"step 0: val loss {init_val:.3f}; training for {mode}", flush=True)
    t_train = time.time()
    recent: list[float] = []
    step, last_log = 0, t_train
    while True:
        elapsed = time.time() - t_train
        if args.steps is not None:
            if step >= args.steps:
                break
            lr = lr_at(step, args.steps, args.lr, args.warmup)
        else:
            if elapsed >= budget_s:
                break
            lr = lr_at(step, 0, args.lr, args.warmup, progress=elapsed / budget_s)
        loss = train_step(model, opt, make_batch(train_data, g, args.batch, args.seq), lr)
        recent = (recent + [loss])[-20:]
        step += 1
        now = time.time()
        if now - last_log >= 20 or step == args.steps:
            last_log = now
            print(
                f"step {step}: loss {loss:.3f} (avg20 {sum(recent) / len(recent):.3f}) "
                f"lr {lr:.2e} {now - t_train:.0f}s",
                flush=True,
            )
    total_steps = step
    train_time = time.time() - t_train
    final_train = sum(recent) / len(recent)
    final_val = eval_loss(model, val_data, args.seq)
    tokens_seen = total_steps * args.batch * args.seq
    print(
        f"final training loss (mean of last {len(recent)} steps): {final_train:.3f}; "
        f"held-out loss: {final_val:.3f} (ppl {math.exp(final_val):.1f}); "
        f"{total_steps} steps, {tokens_seen:,} tokens, {train_time / 60:.1f} min",
        flush=True,
    )

    # ---- save
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # Replace only the generated artefacts; README.md, __init__.py etc. stay.
    generated = {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
    }
    for f in out.iterdir():
        if f.is_file() and (
            f.name in generated or f.suffix == ".safetensors" or f.name == "model.safetensors.index.json"
        ):
            f.unlink()
    model.eval()
    model.generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=64,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    fp32_mb = n_params * 4 / 1e6
    save_dtype = torch.float32 if fp32_mb <= MAX_SIZE_MB - 0.5 else torch.bfloat16
    model.to(save_dtype).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    size = folder_size_mb(out)
    print(
        f"saved to {out} as {str(save_dtype).replace('torch.', '')}: {size:.2f} MB "
        f"({', '.join(sorted(f.name for f in out.iterdir()))})",
        flush=True,
    )
    if size > MAX_SIZE_MB:
        raise SystemExit(f"default model folder is {size:.2f} MB > {MAX_SIZE_MB} MB")

    # ---- reload from disk and sample
    m2 = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    t2 = AutoTokenizer.from_pretrained(out)
    check_roundtrip(t2)
    print(
        f"reloaded: {type(m2).__name__} ({next(m2.parameters()).dtype}), {type(t2).__name__}; "
        f"held-out loss after reload: {eval_loss(m2, val_data, args.seq):.3f}",
        flush=True,
    )
    prompts = ["The for statement", "A dictionary is"]
    for prompt in prompts:
        enc = t2(prompt, return_tensors="pt")
        gen = m2.generate(**enc, max_new_tokens=48)
        print(f"--- greedy: {prompt!r}\n{t2.decode(gen[0], skip_special_tokens=True)}", flush=True)
    chat = t2.apply_chat_template(
        [{"role": "user", "content": "What is the while statement?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    gen = m2.generate(**chat, max_new_tokens=48)
    print(
        "--- greedy chat: 'What is the while statement?'\n"
        + t2.decode(gen[0][chat["input_ids"].shape[1] :], skip_special_tokens=True),
        flush=True,
    )
    print(f"total time {(time.time() - t0) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
