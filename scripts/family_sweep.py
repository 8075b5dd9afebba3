#!/usr/bin/env python
"""Walk transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and serve a tiny random model of every type.

For each model type: a config built from the type's own config class with its sizes shrunk (hidden
64, 2 layers, vocabulary 256, 4 experts...), a float32 random model with a fixed seed, two prompts
(5 and 23 tokens) x 16 greedy tokens through the model's own ``generate`` and through ``LLMEngine``,
batched and then one request at a time (every decode step one row).
Each type ends in one status:

- ``exact``: the engine's tokens equal ``generate``'s, both prompts.
- ``refused``: the engine raised a one-line ``ValueError`` at construction, or its attention
  function did at the first step ("at the first step: ..."); the message is shown.
- ``wrong``: the engine served different tokens.
- ``error``: anything else the engine raised (or its time box ran out).
- ``skip``: not a decoder-only text model (multimodal, an encoder run as a decoder, a seq2seq
  model's decoder half), or transformers itself cannot build or run it from the shrunken config
  (its ``generate`` failed): the reason is shown.

Types run in chunks, each chunk in its own subprocess (memory from dozens of models is returned
between chunks) and each type under a time box (``--time-box`` seconds, SIGALRM).

Usage (from the repository root)::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/family_sweep.py              # every type
    PYTHONPATH=$PWD python scripts/family_sweep.py --types gpt2,phi --verbose      # a few
    PYTHONPATH=$PWD python scripts/family_sweep.py --json sweep.json               # keep the table
    PYTHONPATH=$PWD python scripts/family_sweep.py --from-json sweep.json --markdown docs/model_families.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 23)
VOCAB = 256

# Config fields shrunk when the type's config has them (names as the configs spell them; a
# config's ``attribute_map`` aliases such as ``n_embd`` -> ``hidden_size`` are covered by listing both).
SHRINK = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "n_head_kv": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "max_seq_len": 256,
    "seq_length": 256,
    # MoE: few small experts.
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # Latent attention (DeepSeek V2/V3, GLM-DSA, Kimi): small ranks.
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    # Sliding windows shorter than the longest prompt, so they mask something.
    "sliding_window": 8,
    # Recurrent / hybrid layers: small states.
    "state_size": 8,
    "mamba_d_state": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_conv": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


# Hybrid recurrent types whose configs derive their layer kinds from fields SHRINK does not size (a
# period and offset, an attention index list, a property), or check that the Mamba heads fill the
# expanded width: their tiny configs spelled out (hidden 64, vocabulary 256, an attention layer
# beside the recurrent ones, 8 Mamba heads of 16 channels with states of 8).
_TINY_ATTENTION = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
_TINY_MAMBA = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    mamba_n_groups=1,
)
HAND_TINY = {
    "mamba2": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=8,
        num_heads=8,
        head_dim=16,
        expand=2,
        n_groups=1,
        conv_kernel=4,
        chunk_size=8,
    ),
    "jamba": dict(
        _TINY_ATTENTION,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
    ),
    "nemotron_h": dict(
        _TINY_ATTENTION,
        head_dim=16,
        layers_block_type=["linear_attention", "full_attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=1,
        expand=2,
        chunk_size=8,
        conv_kernel=4,
    ),
    "bamba": dict(_TINY_ATTENTION, num_hidden_layers=3, attn_layer_indices=[1], **_TINY_MAMBA),
    "falcon_h1": dict(_TINY_ATTENTION, num_hidden_layers=2, mamba_d_ssm=128, head_dim=16, **_TINY_MAMBA),
    "granitemoehybrid": dict(
        _TINY_ATTENTION,
        num_hidden_layers=2,
        layer_types=["linear_attention", "attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        **_TINY_MAMBA,
    ),
    "lfm2_moe": dict(
        _TINY_ATTENTION,
        num_hidden_layers=3,
        num_dense_layers=1,
        layer_types=["conv", "full_attention", "conv"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
}


def skip_reason(model_type: str):
    """Why ``model_type`` is not a decoder-only text model (a string), or None."""
    from transformers import CONFIG_MAPPING

    cfg_cls = CONFIG_MAPPING[model_type]
    sub = getattr(cfg_cls, "sub_configs", None) or {}
    if any(k not in ("text_config", "attn_config", "ffn_config") for k in sub) or (
        "text_config" in sub and not model_type.endswith("_text")
    ):
        return f"multimodal or composite (sub-configs: {', '.join(sorted(sub))})"
    cfg = cfg_cls()
    if getattr(cfg, "is_encoder_decoder", False) or hasattr(cfg, "encoder_layers"):
        return "decoder half of a seq2seq model"
    if hasattr(cfg, "add_cross_attention") and hasattr(cfg, "type_vocab_size"):
        return "encoder run as a decoder (BERT-style)"
    return None


def tiny_config(model_type: str):
    """The type's own config with ``SHRINK``'s sizes where the config has those fields (``HAND_TINY``'s
    config for the types listed there)."""
    from transformers import CONFIG_MAPPING

    cfg_cls = CONFIG_MAPPING[model_type]
    if model_type in HAND_TINY:
        ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        names = set(cfg_cls().to_dict())
        return cfg_cls(**HAND_TINY[model_type], **{k: v for k, v in ids.items() if k in names})
    default = cfg_cls()
    names = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    kw = {k: v for k, v in SHRINK.items() if k in names}
    if "qk_rope_head_dim" in names:
        # Latent attention: the config derives its rotary head size itself, and K/V heads are not grouped.
        kw.pop("head_dim", None)
        kw.pop("num_key_value_heads", None)
    if "rotary_dim" in names and getattr(default, "rotary_dim", None):
        kw["rotary_dim"] = 8  # GPT-J, CodeGen: rotary channels of the (16-wide) head
    if model_type == "gpt_neo":
        kw["attention_types"] = [[["global", "local"], 1]]  # one global and one local layer
    # Layer-kind lists sized for the default depth are rebuilt from the new depth by the config.
    for key in ("layer_types", "mlp_layer_types", "layers_block_type", "attn_layer_indices"):
        if isinstance(getattr(cfg_cls, key, None), property):
            continue  # derived from another field (Bamba, Falcon-H1)
        if key in names and getattr(default, key, None) is not None and isinstance(getattr(default, key), list):
            kinds = list(getattr(default, key))
            if key == "attn_layer_indices":
                kw[key] = [1]
            else:
                # Two layers of different kinds where the stack mixes kinds (sliding and full, attention and recurrent).
                kw[key] = [kinds[0], next((k for k in kinds if k != kinds[0]), kinds[0])]
    if "full_attn_idxs" in names:
        kw["full_attn_idxs"], kw["layer_types"] = [1], ["conv", "full_attention"]  # LFM2: a convolution layer too
    for key, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if key in names:
            kw[key] = value
    return cfg_cls(**kw)


def build_tiny(model_type: str):
    """A float32 random ``ForCausalLM`` of ``model_type`` in eval mode (seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return model


def prompts():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def reference(model, prompt):
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def served(model, prompts_, max_num_seqs: int = 256):
    """The engine's greedy tokens for ``prompts_``; ``max_num_seqs=1`` decodes one row per step."""
    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)
    )
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts_]
        return [h.result(timeout=120).output_token_ids for h in handles]
    finally:
        eng.close()


class TimeBox(Exception):
    pass


def _alarm(signum, frame):
    raise TimeBox()


def check_type(model_type: str, time_box: int, verbose: bool = False) -> dict:
    """Run one type; returns ``{"type", "status", "detail", "seconds"}``."""
    t0 = time.perf_counter()
    row = {"type": model_type, "status": "skip", "detail": ""}
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(time_box)
    phase = "classify"
    try:
        reason = skip_reason(model_type)
        if reason:
            row["detail"] = reason
            return row
        phase = "build"
        model = build_tiny(model_type)
        ps = prompts()
        phase = "generate"
        refs = [reference(model, p) for p in ps]
        phase = "engine"
        try:
            outs = served(model, ps)
        except ValueError as e:
            row.update(status="refused", detail=str(e).splitlines()[0][:200])
            return row
        if outs == refs:
            outs = served(model, ps, max_num_seqs=1)  # batched, then one request at a time
        if outs == refs:
            row.update(status="exact")
        else:
            first = next(i for i, (a, b) in enumerate(zip(outs, refs)) if a != b)
            k = next(j for j, (a, b) in enumerate(zip(outs[first], refs[first])) if a != b)
            row.update(status="wrong", detail=f"prompt {first} differs from token {k}")
    except TimeBox:
        row.update(
            status="error" if phase == "engine" else "skip", detail=f"time box ({time_box} s) ran out in {phase}"
        )
    except Exception as e:  # noqa: BLE001 - every failure is a row of the table
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        if verbose:
            traceback.print_exc()
        if phase == "engine" and "not served by hf_contbatch" in msg:
            row.update(status="refused", detail=f"at the first step: {msg.split(chr(40), 1)[-1]}"[:200])
        elif phase == "engine":
            row.update(status="error", detail=msg)
        else:
            row.update(status="skip", detail=f"transformers cannot {phase} it tiny: {msg}")
    finally:
        signal.alarm(0)
        row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_chunk(types: list[str], time_box: int, chunk_size: int) -> list[dict]:
    """Each chunk of ``types`` in its own subprocess (``--worker``); a chunk that dies reports its types as errors."""
    rows = []
    for i in range(0, len(types), chunk_size):
        chunk = types[i : i + chunk_size]
        cmd = [sys.executable, __file__, "--worker", "--types", ",".join(chunk), "--time-box", str(time_box)]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=time_box * (len(chunk) + 2))
            got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        except subprocess.TimeoutExpired:
            got = []
        done = {r["type"] for r in got}
        got += [
            {"type": t, "status": "error", "detail": "the worker process died", "seconds": 0}
            for t in chunk
            if t not in done
        ]
        for r in got:
            print(f"{r['type']:28s} {r['status']:8s} {r['seconds']:6.1f}s  {r['detail']}", file=sys.stderr, flush=True)
        rows += got
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated model types (default: every type in the mapping)")
    ap.add_argument("--time-box", type=int, default=90, help="seconds per type")
    ap.add_argument("--chunk", type=int, default=12, help="types per subprocess")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--markdown", help="write the table as Markdown to this file (docs/model_families.md)")
    ap.add_argument("--from-json", help="print (and --markdown) the rows a previous --json run wrote, running nothing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks (in-process)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    types = args.types.split(",") if args.types else all_types()
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
    elif args.worker or args.verbose:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        rows = []
        for t in types:
            row = check_type(t, args.time_box, args.verbose)
            print(json.dumps(row), flush=True)
            rows.append(row)
        if args.worker:
            return 0
    else:
        rows = run_chunk(types, args.time_box, args.chunk)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    text_types = sum(v for k, v in counts.items() if k != "skip")
    print(f"\n{len(rows)} types: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"decoder-only text types transformers runs tiny: {text_types}; served exactly: {counts.get('exact', 0)}")
    for status in ("wrong", "error", "refused", "skip"):
        for r in rows:
            if r["status"] == status:
                print(f"  {status:8s} {r['type']:28s} {r['detail']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows))
    return 0


def markdown_table(rows: list[dict]) -> str:
    """The sweep as docs/model_families.md: counts, then one row per type (status, what decided it)."""
    import torch
    import transformers

    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    text = sum(v for k, v in counts.items() if k != "skip")
    lines = [
        "# Model families: served or refused",
        "",
        f"Generated by `scripts/family_sweep.py --markdown` (transformers {transformers.__version__}, torch "
        f"{torch.__version__}, CPU, float32): every type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` as a tiny "
        f"random model of its own config class, two prompts x {NEW_TOKENS} greedy tokens against `generate`.",
        "",
        f"Of {len(rows)} types, {text} are decoder-only text models that transformers runs on a tiny config: "
        f"**{counts.get('exact', 0)} served exactly**, {counts.get('refused', 0)} refused in one line, "
        f"{counts.get('wrong', 0)} wrong, {counts.get('error', 0)} errors. {counts.get('skip', 0)} are not counted "
        "(multimodal, encoders run as decoders, seq2seq decoder halves, or not buildable tiny).",
        "",
        "| model type | status | detail |",
        "|---|---|---|",
    ]
    order = {"exact": 0, "refused": 1, "wrong": 2, "error": 3, "skip": 4}
    for r in sorted(rows, key=lambda r: (order.get(r["status"], 5), r["type"])):
        detail = r["detail"].replace("|", "\\|")
        lines.append(f"| {r['type']} | {r['status']} | {detail} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
