"""The standard workload of PERFORMANCE.md, shared by the benchmarks.

64 requests, prompt lengths uniform in [8, 256] tokens, max_new_tokens drawn from 16/32/64/256 with
weights 0.4/0.3/0.2/0.1, EOS ignored (the models have no EOS), greedy. Models are random-weight
Llamas built from a config; prompts are words of a word-level tokenizer ("w17 w3 ..."), so text and
token ids round-trip exactly and every engine sees the same token ids.
"""

from __future__ import annotations

import random

import torch

MODEL_SIZES = {
    # PERFORMANCE.md: tiny (vocab 2048, hidden 256, 4 layers, 8 heads, 4 KV heads) and
    # small (vocab 8192, hidden 768, 12 layers, 12 heads, 4 KV heads, ~100M parameters).
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4),
    "small": dict(vocab_size=8192, hidden_size=768, intermediate_size=2304, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4),
}


def build_model(size: str = "tiny", seed: int = 0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**MODEL_SIZES[size], max_position_embeddings=2048, eos_token_id=None, bos_token_id=None,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
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


def make_workload(num_requests: int = 64, vocab_size: int = 2048, seed: int = 0):
    """Returns (prompt token-id lists, max_new_tokens list)."""
    rng = random.Random(seed)
    prompts, new_tokens = [], []
    for _ in range(num_requests):
        n = rng.randint(8, 256)
        prompts.append([rng.randrange(1, vocab_size) for _ in range(n)])
        new_tokens.append(rng.choices([16, 32, 64, 256], weights=[0.4, 0.3, 0.2, 0.1])[0])
    return prompts, new_tokens
