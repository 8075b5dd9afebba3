"""The standard workload, shared by the benchmarks.

64 requests, prompt lengths uniform in [8, 256] tokens, max_new_tokens drawn from 16/32/64/256 with
weights 0.4/0.3/0.2/0.1, EOS ignored (the models have no EOS), greedy. The ``medium`` model (the size
people run on a CPU) has the peers' medium workload: 32 requests, prompts 8..192, max_new_tokens
16/32/64/128 (``WORKLOADS``). Models are random-weight Llamas built from a config (or any saved
model: ``build_model(path)``); prompts are words of a word-level tokenizer ("w17 w3 ..."), so text
and token ids round-trip exactly and every engine sees the same token ids.
"""

from __future__ import annotations

import random

import torch

MODEL_SIZES = {
    # The anchor models: tiny (vocab 2048, hidden 256, 4 layers, 8 heads, 4 KV heads) and
    # small (vocab 8192, hidden 768, 12 layers, 12 heads, 4 KV heads, ~100M parameters).
    "tiny": dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    "small": dict(
        vocab_size=8192,
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
    # SmolLM2-360M's shape (../shared/peers' third anchor): 32 layers, tied 49,152-token embeddings.
    "medium": dict(
        vocab_size=49152,
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        tie_word_embeddings=True,
    ),
}
# (requests, longest prompt, max_new_tokens choices) by model size; the rest use the standard one.
WORKLOADS = {"medium": (32, 192, (16, 32, 64, 128))}


def build_model(size: str = "tiny", seed: int = 0, dtype=torch.float32, model_type: str = "llama"):
    """A random-weight model of ``MODEL_SIZES[size]``, or the model saved at the path ``size``.
    ``model_type``: a transformers model type (``qwen3``, ``phi3``...): its config class with its own
    defaults, the sizes (and ``head_dim = hidden / heads``) of ``size``; default a Llama."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if size not in MODEL_SIZES:
        model = AutoModelForCausalLM.from_pretrained(size, dtype=dtype).eval()
        model.generation_config.eos_token_id = None
        return model
    torch.manual_seed(seed)
    sizes = dict(MODEL_SIZES[size], max_position_embeddings=2048, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    else:
        head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, head_dim=head_dim, **sizes))
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer over "w0".."w{vocab-1}" (w0 doubles as padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w0")
    fast.padding_side = "left"
    return fast


def make_workload(
    num_requests: int = 64, vocab_size: int = 2048, seed: int = 0, max_prompt: int = 256, lengths=(16, 32, 64, 256)
):
    """Returns (prompt token-id lists, max_new_tokens list)."""
    rng = random.Random(seed)
    prompts, new_tokens = [], []
    for _ in range(num_requests):
        n = rng.randint(8, max_prompt)
        prompts.append([rng.randrange(1, vocab_size) for _ in range(n)])
        new_tokens.append(rng.choices(list(lengths), weights=[0.4, 0.3, 0.2, 0.1])[0])
    return prompts, new_tokens


def workload_for(size: str, vocab_size: int, seed: int = 0, num_requests=None):
    """``make_workload`` with the request count, prompt lengths and max_new_tokens of the model
    size (``WORKLOADS``; the standard ones otherwise); ``num_requests`` overrides the count."""
    n, max_prompt, lengths = WORKLOADS.get(size, (64, 256, (16, 32, 64, 256)))
    return make_workload(num_requests or n, vocab_size, seed, max_prompt, lengths)


def run_transformers_cb(model, prompts, new_tokens, num_blocks, block_size, max_batch_tokens):
    """transformers' own continuous batching over the same workload: the manager that
    ``model.generate_batch`` wraps (only it takes a max_new_tokens per request), sdpa attention.

    Returns (wall seconds, generated token lists in input order).
    """
    import time

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation("sdpa")
    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(new_tokens))
    cb_cfg = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    outs = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=60, warmup=False
    ) as manager:
        manager.add_request([1, 2, 3], request_id="warmup", max_new_tokens=2)
        while not ((r := manager.get_result(timeout=60)) is not None and r.is_finished()):
            pass
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, new_tokens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        while len(outs) < len(prompts):
            r = manager.get_result(timeout=120)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching manager stopped")
                continue
            if r.is_finished():
                outs[r.request_id] = list(r.generated_tokens)
        wall = time.perf_counter() - t0
    return wall, [outs[f"r{i}"] for i in range(len(prompts))]


def run_ours(model, prompts, new_tokens, engine_config):
    """hf_contbatch over the workload, every request submitted at once with its own max_new_tokens.

    Returns (wall seconds, generated token lists in input order, final EngineStats).
    """
    import time

    from hf_contbatch import LLMEngine, SamplingParams

    engine = LLMEngine(model, engine_config)
    try:
        t0 = time.perf_counter()
        # Warm-up: one request alone (one-row prefill, one-token decodes), then two together (the
        # general case), so a compiled forward (compile_model) has all its graphs before timing.
        engine.submit([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
        pair = [engine.submit(p, SamplingParams(max_new_tokens=2, ignore_eos=True)) for p in ([1, 2, 3], [4, 5, 6, 7])]
        [h.result() for h in pair]
        if engine.compiled_forward is not None:
            print(f"warm-up (compiling the forward): {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        handles = [
            engine.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, new_tokens)
        ]
        outs = [h.result().output_token_ids for h in handles]
        wall = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        engine.close()
    return wall, outs, stats


def _strip_option(args: list, option: str) -> list:
    """``args`` without ``option`` and its value."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def run_in_own_process(script: str, engine: str, argv: list, cooldown_s: float = 0.0) -> dict:
    """Sleep ``cooldown_s``, then run ``script --single OUT --engines engine <argv minus
    --json/--engines>`` in a fresh Python and return what it wrote to OUT. Why: an engine that ran
    torch in a thread leaves an OpenMP team behind, and with two teams alive on 2 cores every op of
    the next engine runs ~2x slower. The sleep lets every engine start from an idle machine, not
    just the first (measured here: right after 15 s of full load the same run is ~9% slower)."""
    import json
    import subprocess
    import sys
    import tempfile
    import time

    time.sleep(cooldown_s)

    rest = _strip_option(_strip_option(list(argv), "--json"), "--engines")
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, script, "--single", tmp.name, "--engines", engine] + rest
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(tmp.name) as f:
            return json.load(f)
