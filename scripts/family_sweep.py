#!/usr/bin/env python
"""Walk transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and serve a tiny random model of every type.

For each model type: a config built from the type's own config class with its sizes shrunk (hidden
64, 2 layers, vocabulary 256, 4 experts...), a float32 random model with a fixed seed (0), and two
prompts (5 and 23 tokens). The model is first built on the meta device and handed to ``LLMEngine``:
a type the engine does not serve must be refused there, in one line, before any weight is touched.
A type it serves is checked on one real model, each check against transformers' own ``generate``:

- greedy: 16 tokens per prompt, in one engine whose KV pool (10 blocks of 4 tokens: the longer
  request and no more; 6 where a sliding window let 10 hold everything) forces recompute
  preemption, the short prompt's requests arriving at a higher priority after the long one's first
  token; then again one request per step (``max_num_seqs=1``). Every run ends with its KV blocks
  back in the free queue.
- sampled: a seeded request per prompt (``SamplingParams(seed=s)``, temperature 1, no top-k/top-p)
  in the same engine, against ``torch.manual_seed(s)`` + ``generate(do_sample=True)``: the engine
  draws a seeded request's tokens with its own generator seeded with ``s``, one ``multinomial``
  over the full softmax per token, the draw ``generate`` makes from the global generator.
- int8: ``quantization="int8"`` greedy against ``generate`` of a copy whose int8-packed linears
  have the weights quantized and dequantized in plain torch (per output channel, absmax / 127),
  the closeness README documents (the linears left float, such as GPT-2's ``Conv1D`` and MoE
  routers, stay float in the copy too).

Each type ends in one status:

- ``exact``: greedy and sampled tokens equal ``generate``'s, both prompts (``int8`` is its own column).
- ``refused``: the engine raised a one-line ``ValueError`` at construction, or its attention
  function did at the first step ("at the first step: ..."); the message is shown.
- ``wrong``: the engine served different greedy or sampled tokens.
- ``error``: anything else the engine raised (or its time box ran out).
- ``skip``: not a decoder-only text model (multimodal, an encoder run as a decoder, a seq2seq
  model's decoder half), or transformers itself cannot build or run it from the shrunken config
  (its ``generate`` failed): the reason is shown.

``--json`` rows: ``type``, ``status``, ``detail`` (the refusal's message, or what went wrong),
``greedy``/``sampled``/``int8`` ("exact", "wrong: prompt P from token K", "error: ...", or None
where not run), ``preemptions`` (recompute preemptions in the float run), ``refusal_seconds`` (the
meta-model construction), ``seconds``.

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
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 23)
VOCAB = 256

# Config fields shrunk when the type's config has them (names as the configs spell them; a
# config's ``attribute_map`` aliases such as ``n_embd`` -> ``hidden_size`` are covered by listing both).
SHRINK = {
    "vocab_size": VOCAB,
    # Inkling 2's LM head has this many rows (its checkpoints pad the embedding to vocab_size): a
    # wider head would generate ids the shrunken embedding does not have.
    "unpadded_vocab_size": VOCAB,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "n_inner": 128,
    "dff": 128,  # CTRL
    "ffn_dim": 128,  # OPT
    "dense_intermediate_size": 128,  # MiniMax-M3
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
    "shared_intermediate_size": 32,
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
    # Sparse attention's indexer (DeepSeek V3.2's DSA and kin): a top-k shorter than both prompts, so
    # it selects; a second layer reusing the first's top-k where the config has per-layer modes. 4
    # heads: a key every head scores below zero scores exactly 0 (ReLU), so keys tie at the top-k's
    # cut, where only rows laid out as generate's pick what it picks (engine.sparse_indexer).
    "index_topk": 4,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "indexer_types": ["full", "shared"],
    # Sliding windows shorter than the longest prompt, so they mask something.
    "sliding_window": 8,
    # Doge's dynamic mask keeps the keys of largest bias per row past this many: fewer than the
    # window and both prompts, so its top-k selects (its random model's biases all tie at exp(0) = 1,
    # so only rows laid out as generate's pick what it picks: torch_paged.key_biased_attention).
    "keep_window_size": 4,
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
    # DeepSeek V4: one layer of each attention kind (sliding, compressed sparse, heavily compressed),
    # compression rates (4 and 8) and a window (8) well under the prompts, so both compressors emit
    # entries and close windows mid-decode, and an indexer top-k (4) below the compressed sparse
    # layer's entries (up to 9), so it selects.
    "deepseek_v4": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        q_lora_rank=32,
        partial_rotary_factor=0.5,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
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
    if model_type == "inkling2_loop_text":
        # Three layers, the middle one run in two passes (the second with cache layers of its own):
        # the defaults loop layers 6-17, which two layers never reach.
        kw.update(num_hidden_layers=3, n_layers_per_attn_res_block=1, loop_layer_index_start=1)
        kw.update(loop_layer_index_end=2, loop_num_passes=2, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"])
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
    """The two prompts every type is checked on: 5 and 23 token ids in [3, VOCAB) (seed 1; ids 0-2
    are the tiny configs' pad, BOS and EOS)."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _generate(model, prompt, **kwargs):
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=0,
            pad_token_id=0,
            eos_token_id=None,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def reference(model, prompt):
    """transformers' greedy ``generate`` of ``NEW_TOKENS`` tokens after ``prompt`` (ids), EOS ignored."""
    return _generate(model, prompt, do_sample=False)


def reference_sampled(model, prompt, seed: int):
    """What ``generate`` samples after ``torch.manual_seed(seed)``: temperature 1, no top-k or top-p
    (every token drawn from the full softmax), EOS ignored; ``NEW_TOKENS`` ids."""
    import torch

    torch.manual_seed(seed)
    return _generate(model, prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)


def dequantized_copy(model, names):
    """A deep copy of ``model`` whose ``nn.Linear`` modules named in ``names`` have their weight
    replaced by ``round(W / s) * s`` clamped to [-127, 127] steps, ``s = absmax / 127`` per output
    channel (plain torch: the int8 weights README documents, dequantized). A new parameter unties a
    tied LM head, so the input embedding keeps its float values, as in the engine."""
    import copy

    import torch

    ref = copy.deepcopy(model)
    modules = dict(ref.named_modules())
    with torch.no_grad():
        for name in names:
            m = modules[name]
            w = m.weight.detach()
            s = w.abs().amax(1, keepdim=True) / 127
            q = torch.where(s > 0, w / s, 0.0)  # a zero row stays zero
            m.weight = torch.nn.Parameter(q.round().clamp(-127, 127) * s)
    return ref


def refusal(model_type: str):
    """``(message, seconds)`` when ``LLMEngine`` refuses a tiny ``model_type`` model whose weights
    live on the meta device (reading one would fail, so a refusal there came before any weight was
    touched); ``(None, seconds)`` when it does not refuse it (the type is served: build the real
    model). Only the engine's own refusal counts ("not served by hf_contbatch"); any other error
    of the meta model means the capability check passed."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    t0 = time.perf_counter()
    try:
        LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8))).close()
    except ValueError as e:
        if "not served by hf_contbatch" in str(e):
            return str(e), time.perf_counter() - t0
    except Exception:  # noqa: BLE001 - past the capability check, a meta model cannot be packed or run
        pass
    return None, time.perf_counter() - t0


# Seeds of the two sampled requests (one per prompt).
SEEDS = (11, 12)
# KV pool of the float run: blocks of 4 tokens, 10 of them = 40 tokens, the longer request's 23 + 16
# and no more: the four requests (two prompts, greedy and sampled) cannot all keep their KV.
PREEMPT_BLOCK_SIZE = 4
PREEMPT_POOLS = (10, 6)  # a pool of 6 where a sliding window let 10 hold everything


class FloatRun(NamedTuple):
    """What the float engine gave: per prompt its greedy and seeded-sampled tokens; how many times a
    request was preempted (recompute), and how many of those were seeded sampled requests; greedy
    tokens again with one request per step."""

    greedy: list
    sampled: list
    num_preemptions: int
    sampled_preemptions: int
    greedy_one_row: list


def _check_pool_whole(eng) -> None:
    assert eng.wait_idle(10)
    stats = eng.stats()
    eng.block_manager.check_invariants()
    assert stats.num_free_blocks == stats.num_blocks, f"{stats.num_blocks - stats.num_free_blocks} KV blocks leaked"


def _serve_preempted(model, prompts_, num_blocks: int):
    """Greedy and seeded requests for each prompt in one engine over a pool of ``num_blocks``: the
    long prompt's two requests (priority 1) run first, the short one's (priority 0, served first)
    arrive after their first token, so a pool that cannot hold them all preempts a long one."""
    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    cfg = EngineConfig(cache=CacheConfig(block_size=PREEMPT_BLOCK_SIZE, num_blocks=num_blocks))
    eng = LLMEngine(model, cfg)
    try:

        def params(i, sampled):
            seed = SEEDS[i] if sampled else None
            return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, do_sample=sampled, seed=seed)

        order = sorted(range(len(prompts_)), key=lambda i: -len(prompts_[i]))
        handles = {}
        for rank, i in enumerate(order):
            reqs = [eng.build_request(prompts_[i], params(i, s), priority=len(order) - 1 - rank) for s in (False, True)]
            first = eng.enqueue(reqs)
            handles[i] = [h[0] for h in first]
            if rank + 1 < len(order):
                eng.driver.drive(lambda hs=handles[i]: all(h.done() or h.request.output_token_ids for h in hs))
        outs = {i: [h.result(timeout=120).output_token_ids for h in hs] for i, hs in handles.items()}
        _check_pool_whole(eng)
        n_pre = eng.stats().num_preemptions
        n_sampled = sum(hs[1].request.num_preemptions for hs in handles.values())
    finally:
        eng.close()
    n = range(len(prompts_))
    return [outs[i][0] for i in n], [outs[i][1] for i in n], n_pre, n_sampled


def serve_float(model, prompts_) -> FloatRun:
    """The engine's tokens for ``prompts_`` on ``model`` as it is (float32): greedy and seeded
    sampled (``SEEDS``) in one engine whose pool forces preemption (``PREEMPT_POOLS``: the first
    that preempts), then greedy again one request per step (``max_num_seqs=1``). Every run's KV
    blocks are checked back in the free queue. Raises what the engine raises."""
    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

    for num_blocks in PREEMPT_POOLS:
        greedy, sampled, n_pre, n_sampled = _serve_preempted(model, prompts_, num_blocks)
        if n_pre:
            break
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=1))
    eng = LLMEngine(model, cfg)
    try:
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts_]
        one_row = [h.result(timeout=120).output_token_ids for h in handles]
        _check_pool_whole(eng)
    finally:
        eng.close()
    return FloatRun(greedy, sampled, n_pre, n_sampled, one_row)


def serve_int8(model, prompts_):
    """``(tokens per prompt, names of the linears run as int8)`` of a ``quantization="int8"``
    engine, greedy. ``close()`` gives the model its float weights back."""
    import warnings

    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SamplingParams
    from hf_contbatch.kernels.linears.unquantized import FloatWeightsWarning

    with warnings.catch_warnings():
        # Expected: MoE experts, routers and Conv1D weights stay float (README); their share is
        # not what this check measures.
        warnings.simplefilter("ignore", FloatWeightsWarning)
        eng = LLMEngine(model, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=32), quantization="int8"))
    try:
        packed = eng.packed_linears
        ids = {id(m) for m in packed.modules} if packed is not None else set()
        names = [n for n, m in model.named_modules() if id(m) in ids]
        handles = [eng.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts_]
        outs = [h.result(timeout=120).output_token_ids for h in handles]
        _check_pool_whole(eng)
    finally:
        eng.close()
    return outs, names


def _diff(outs, refs) -> str:
    """ "exact", or where the first difference is."""
    if outs == refs:
        return "exact"
    first = next(i for i, (a, b) in enumerate(zip(outs, refs)) if a != b)
    k = next(
        (j for j, (a, b) in enumerate(zip(outs[first], refs[first])) if a != b),
        min(map(len, (outs[first], refs[first]))),
    )
    return f"wrong: prompt {first} from token {k}"


class TimeBox(Exception):
    pass


def _alarm(signum, frame):
    raise TimeBox()


def _first_step_refusal(exc):
    """The one-line message when ``exc`` is the attention function's refusal at the first step."""
    cause = exc.__cause__ or exc
    msg = str(cause)
    if isinstance(cause, ValueError) and "not served by hf_contbatch" in msg:
        return "at the first step: " + msg.splitlines()[0]
    return None


def check_type(model_type: str, time_box: int, verbose: bool = False) -> dict:
    """Run one type; returns the row ``{"type", "status", "detail", "seconds", "greedy", "sampled",
    "int8", "preemptions", "refusal_seconds"}``. ``greedy``/``sampled``/``int8`` are "exact" or
    "wrong: ..." (None where not run), ``preemptions`` the float run's count."""
    t0 = time.perf_counter()
    row = {"type": model_type, "status": "skip", "detail": ""}
    row.update(greedy=None, sampled=None, int8=None, preemptions=None, refusal_seconds=None)
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
        sampled_refs = [reference_sampled(model, p, s) for p, s in zip(ps, SEEDS)]
        phase = "refusal"
        message, seconds = refusal(model_type)
        row["refusal_seconds"] = round(seconds, 3)
        if message is not None:
            row.update(status="refused", detail=message.splitlines()[0][:200])
            return row
        phase = "engine"
        run = serve_float(model, ps)
        row.update(
            greedy=_diff(run.greedy, refs) if run.greedy_one_row == refs else _diff(run.greedy_one_row, refs),
            sampled=_diff(run.sampled, sampled_refs),
            preemptions=run.num_preemptions,
        )
        phase = "int8"
        outs, names = serve_int8(model, ps)
        row["int8"] = _diff(outs, [reference(dequantized_copy(model, names), p) for p in ps])
        exact = row["greedy"] == row["sampled"] == "exact"
        row.update(
            status="exact" if exact else "wrong",
            detail="" if exact else f"greedy {row['greedy']}, sampled {row['sampled']}",
        )
    except TimeBox:
        row.update(
            status="error" if phase in ("engine", "int8") else "skip",
            detail=f"time box ({time_box} s) ran out in {phase}",
        )
    except Exception as e:  # noqa: BLE001 - every failure is a row of the table
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        if verbose:
            traceback.print_exc()
        if phase == "engine" and _first_step_refusal(e):
            row.update(status="refused", detail=_first_step_refusal(e)[:200])
        elif phase == "int8":
            row["int8"] = f"error: {msg}"
            exact = row["greedy"] == row["sampled"] == "exact"
            row.update(status="exact" if exact else "wrong")
        elif phase in ("engine", "refusal"):
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
    for r in rows:
        if r["status"] == "exact" and r.get("int8") != "exact":
            print(f"  int8     {r['type']:28s} {r.get('int8')}")
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
    """The sweep as docs/model_families.md: counts, then one row per type: status, each check's result
    (greedy, sampled, int8, preemptions forced) and, for a refused type, what is missing."""
    import torch
    import transformers

    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    text = sum(v for k, v in counts.items() if k != "skip")
    int8 = sum(r.get("int8") == "exact" for r in rows)
    lines = [
        "# Model families: served or refused",
        "",
        f"Generated by `scripts/family_sweep.py --markdown` (transformers {transformers.__version__}, torch "
        f"{torch.__version__}, CPU, float32): every type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` as a tiny "
        f"random model of its own config class, two prompts (5 and 23 tokens) x {NEW_TOKENS} tokens against "
        "`generate`: greedy under forced recompute preemption and one request per step, seeded sampling "
        '(`torch.manual_seed(s)` + `generate(do_sample=True)`), and int8 weights (`quantization="int8"`) '
        "against `generate` on the same weights quantized and dequantized in plain torch. "
        "`tests/engine/test_model_walk.py` checks the same for every type.",
        "",
        f"Of {len(rows)} types, {text} are decoder-only text models that transformers runs on a tiny config: "
        f"**{counts.get('exact', 0)} served exactly** (greedy and sampled; int8 as documented: {int8}), "
        f"{counts.get('refused', 0)} refused in one line, {counts.get('wrong', 0)} wrong, "
        f"{counts.get('error', 0)} errors. {counts.get('skip', 0)} are not counted "
        "(multimodal, encoders run as decoders, seq2seq decoder halves, or not buildable tiny).",
        "",
        "| model type | status | greedy | sampled | int8 | preemptions | what is missing / detail |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {"exact": 0, "refused": 1, "wrong": 2, "error": 3, "skip": 4}

    def cell(value) -> str:
        return "" if value is None else str(value).replace("|", "\\|")

    for r in sorted(rows, key=lambda r: (order.get(r["status"], 5), r["type"])):
        checks = [cell(r.get(k)) for k in ("greedy", "sampled", "int8", "preemptions")]
        lines.append(f"| {r['type']} | {r['status']} | {' | '.join(checks)} | {cell(r['detail'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
