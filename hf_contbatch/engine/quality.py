"""What quantization costs on a model: perplexity of a held-out text and greedy agreement, int8
weights against the model's own, and an int8 KV cache against a float one (:func:`quality_report`).

Perplexity is ``exp`` of the mean next-token cross-entropy over the text (one sequence, at most
``max_tokens`` tokens). Weights: transformers' own forward and ``generate``, then the same with the
model's linears served by the int8 kernels the engine uses (``kernels.linears.pack_linears(...,
quantization="int8")``), removed afterwards. KV cache: the text scored and the greedy tokens
generated through an engine (``LLMEngine``, the model's own weights) with a float KV cache and with
``CacheConfig(dtype="int8")``: the scores are the engine's prompt log-probs, the only difference
between the two runs the cache's dtype. The model is left as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import KV_QUANT_SCHEMES, quant_scheme
from ..kernels.linears import pack_linears
from ..kernels.linears.unquantized import unquantized_weights
from .attention_switch import num_open_engines

QUANTIZED_KV_DTYPES = tuple(KV_QUANT_SCHEMES)
"""``CacheConfig.dtype`` names of quantized KV caches: what ``kv_cache_dtype`` may measure."""


@dataclass(frozen=True)
class QualityReport:
    """Quantized against float on one text.

    Attributes:
        quantization: the weight format measured ("int8").
        tokens: tokens of held-out text scored.
        ppl_float, ppl_quantized: perplexity (``exp`` of the mean next-token cross-entropy, nats).
        greedy_tokens: tokens generated greedily from the text's first tokens, each way.
        greedy_agreement: leading generated tokens that are the same both ways (0..greedy_tokens).
        kv_cache_dtype: the KV cache dtype measured against a float cache ("int8"), or None when
            the KV cache was not measured (then the ``kv_*`` figures are None).
        kv_ppl_float, kv_ppl_quantized: perplexity of the same tokens through the engine with a
            float KV cache and with the ``kv_cache_dtype`` one (float weights both times).
        kv_greedy_agreement: leading greedy tokens the engine generates the same with both caches.
        clamped_to_context: the model's context in tokens (``max_position_embeddings``) when the
            caller's ``max_tokens`` exceeded it and the text was scored on that many tokens
            instead; None when ``max_tokens`` fit.
        unquantized_weights: the weights the quantization left float in the quantized figures (a
            mixture of experts' 3-D expert weights and router: ``kernels.linears.unquantized``).
        unquantized_weight_bytes, unquantized_weight_fraction: their bytes, and their share of the
            model's parameter bytes (0.0: every weight matrix was quantized).
    """

    quantization: str
    tokens: int
    ppl_float: float
    ppl_quantized: float
    greedy_tokens: int
    greedy_agreement: int
    kv_cache_dtype: Optional[str] = None
    kv_ppl_float: Optional[float] = None
    kv_ppl_quantized: Optional[float] = None
    kv_greedy_agreement: Optional[int] = None
    clamped_to_context: Optional[int] = None
    unquantized_weights: tuple = ()
    unquantized_weight_bytes: int = 0
    unquantized_weight_fraction: float = 0.0

    @property
    def ppl_change(self) -> float:
        """Relative perplexity change, ``ppl_quantized / ppl_float - 1`` (0.01: 1 % worse)."""
        return self.ppl_quantized / self.ppl_float - 1.0

    @property
    def kv_ppl_change(self) -> Optional[float]:
        """Relative perplexity change of the quantized KV cache, ``kv_ppl_quantized / kv_ppl_float - 1``."""
        if self.kv_ppl_float is None or self.kv_ppl_quantized is None:
            return None
        return self.kv_ppl_quantized / self.kv_ppl_float - 1.0

    def lines(self) -> list[str]:
        """The report as text lines (what ``hf-contbatch generate --check-quality`` prints)."""
        lines = [
            f"weights: perplexity on {self.tokens} held-out tokens: float {self.ppl_float:.4f}, "
            f"{self.quantization} {self.ppl_quantized:.4f} ({100 * self.ppl_change:+.2f}%); "
            f"greedy from one prompt: the first {self.greedy_agreement} of {self.greedy_tokens} tokens equal",
        ]
        if self.clamped_to_context is not None:
            lines.append(
                f"note: scored {self.tokens} tokens: `max_tokens` was clamped to the model's context of "
                f"{self.clamped_to_context} tokens (max_position_embeddings)"
            )
        if self.unquantized_weights:
            lines.append(
                f"weights left float by {self.quantization} (in both figures): {len(self.unquantized_weights)} "
                f"tensors, {self.unquantized_weight_bytes / 2**20:.2f} MiB, "
                f"{100 * self.unquantized_weight_fraction:.1f}% of the model's parameters "
                f"({', '.join(self.unquantized_weights[:2])}{', ...' if len(self.unquantized_weights) > 2 else ''})"
            )
        if self.kv_cache_dtype is not None:
            lines.append(
                f"KV cache: perplexity on {self.tokens} held-out tokens: float {self.kv_ppl_float:.4f}, "
                f"{self.kv_cache_dtype} {self.kv_ppl_quantized:.4f} ({100 * self.kv_ppl_change:+.2f}%); "
                f"greedy from one prompt: the first {self.kv_greedy_agreement} of {self.greedy_tokens} tokens equal"
            )
        return lines


def perplexity(model, ids: torch.Tensor) -> float:
    """``exp`` of the mean next-token cross-entropy of ``model``'s forward over ``ids`` ``[1, n]``
    (n >= 2)."""
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:].to(logits.device))
    return math.exp(float(loss))


def _greedy(model, prompt: torch.Tensor, new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, prompt.shape[1] :].tolist()


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def engine_figures(model, ids: torch.Tensor, prompt: torch.Tensor, greedy_tokens: int, kv_cache_dtype):
    """(perplexity of ``ids`` ``[1, n]``, greedy tokens from ``prompt`` ``[1, p]``) through an
    ``LLMEngine`` on ``model`` with a KV cache of ``kv_cache_dtype`` (None: the model's dtype) and the
    model's own linears (``linear_backend="torch"``), closed afterwards. The perplexity is ``exp`` of the mean of ``-log p(ids[i] | ids[:i])`` for i >= 1, from
    the engine's prompt log-probs (the last token scored as the continuation, ``score_token_id``)."""
    from ..config import CacheConfig, EngineConfig
    from ..request import SamplingParams
    from .llm_engine import LLMEngine

    block_size = 16
    tokens = max(ids.shape[1], prompt.shape[1] + greedy_tokens)
    blocks = 2 * (-(-tokens // block_size)) + 4  # both requests may be in at once
    # The model's own linears and ops (no packing, no fused ops): nothing to time at engine start,
    # and the two runs differ in the KV cache's dtype alone.
    config = EngineConfig(
        cache=CacheConfig(dtype=kv_cache_dtype, block_size=block_size, num_blocks=blocks),
        linear_backend="torch",
        fuse_model_ops=False,
    )
    engine = LLMEngine(model, config)
    try:
        row = ids[0].tolist()
        scored = engine.submit(row[:-1], SamplingParams(max_new_tokens=1, prompt_logprobs=1, score_token_id=row[-1]))
        greedy = engine.submit(prompt[0].tolist(), SamplingParams(max_new_tokens=greedy_tokens, ignore_eos=True))
        scored.result(600)
        tokens_out = greedy.result(600).output_token_ids
        logprobs = scored.request.prompt_logprobs[1:]
    finally:
        engine.close()
    if len(logprobs) != len(row) - 1 or any(x is None for x in logprobs):
        raise RuntimeError(f"the engine scored {len(logprobs)} of {len(row) - 1} tokens")
    nll = -sum(lp for lp, _ in logprobs) / len(logprobs)
    return math.exp(nll), list(tokens_out)


def quality_report(
    model,
    tokenizer=None,
    quantization: str = "int8",
    text: Optional[str] = None,
    *,
    max_tokens: int = 512,
    prompt_tokens: int = 32,
    greedy_tokens: int = 32,
    kv_cache_dtype: Optional[str] = "int8",
) -> QualityReport:
    """Perplexity and greedy agreement of ``model`` with its linears quantized, against as it is,
    and through the engine with a quantized KV cache against a float one.

    Args:
        model: a transformers causal LM on the CPU (not open in an engine: its linears are packed
            here for the quantized figures and restored afterwards).
        tokenizer: its tokenizer (needed with ``text``; default: loaded from the model's path).
        quantization: the weight format, a user-facing name (``config.QUANTIZATIONS``).
        text: the held-out text; default: the embedded default model's README.
        max_tokens: most tokens of the text scored; clamped to the model's context
            (``max_position_embeddings``) where it exceeds it, the report's ``clamped_to_context``
            then saying so.
        prompt_tokens, greedy_tokens: greedy generation from the text's first ``prompt_tokens``
            tokens for ``greedy_tokens`` tokens (EOS not stopping it); both together must fit the
            model's context.
        kv_cache_dtype: the quantized KV cache dtype measured (``"int8"``, see ``CacheConfig.dtype``:
            :func:`engine_figures` with it and with the model's dtype), or None to leave the KV
            cache out (the report's ``kv_*`` figures are then None).

    Raises:
        ValueError: an unknown ``quantization`` or ``kv_cache_dtype`` (naming the choices), a
            text under 2 tokens, a greedy prompt + ``greedy_tokens`` beyond the model's context,
            or a model an open engine serves (``pipe.model``).
    """
    scheme = quant_scheme(quantization, allow_none=False)
    if num_open_engines(model):
        # Its linears are packed (maybe quantized already) and its attention switched: both
        # figures would measure the served model, and say int8 costs nothing.
        raise ValueError(
            "`model` is served by an open pipeline or engine; pass a freshly loaded model "
            "(e.g. AutoModelForCausalLM.from_pretrained(...)) or close() the pipeline first"
        )
    if kv_cache_dtype not in (None, *QUANTIZED_KV_DTYPES):
        raise ValueError(f"`kv_cache_dtype` must be one of {(None, *QUANTIZED_KV_DTYPES)}, got {kv_cache_dtype!r}")
    if text is None:
        from ..default_model import default_model_path

        text = (Path(default_model_path()) / "README.md").read_text(encoding="utf-8")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    from .pool_sizing import model_context, text_config

    # Positions past the model's context are never scored: the engine refuses such a prompt, and
    # transformers' forward would score positions the model was not trained on.
    context = model_context(text_config(model))
    clamped = context if context is not None and max_tokens > context else None
    if clamped is not None:
        max_tokens = clamped
    ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens).input_ids
    if ids.shape[1] < 2:
        raise ValueError(f"`text` must have at least 2 tokens, got {ids.shape[1]}")
    if clamped is not None and ids.shape[1] < clamped:
        clamped = None  # the text was shorter than the context anyway: nothing was cut by it
    prompt = ids[:, : max(1, min(prompt_tokens, ids.shape[1] - 1))]
    if context is not None and prompt.shape[1] + greedy_tokens > context:
        raise ValueError(
            f"a {prompt.shape[1]}-token greedy prompt (`prompt_tokens`) + `greedy_tokens`={greedy_tokens} "
            f"exceeds the model's context of {context} tokens; lower `greedy_tokens` or `prompt_tokens`"
        )
    was_training = model.training
    model.eval()
    ppl_float = perplexity(model, ids)
    greedy_float = _greedy(model, prompt, greedy_tokens)
    # Timed (on a first call) at the row counts this report runs, the scored text's at most: not
    # up to an engine's default 1,024-token budget.
    packed = pack_linears(model, "auto", quantization=scheme, max_rows=int(ids.shape[1]))
    left_float = unquantized_weights(model, packed.modules if packed is not None else [])
    try:
        ppl_quant = perplexity(model, ids)
        greedy_quant = _greedy(model, prompt, greedy_tokens)
    finally:
        if packed is not None:
            packed.restore()
        model.train(was_training)
    agree = _leading_equal(greedy_float, greedy_quant)
    kv = {}
    if kv_cache_dtype is not None:
        try:
            ppl_kv_float, greedy_kv_float = engine_figures(model, ids, prompt, greedy_tokens, None)
            ppl_kv_quant, greedy_kv_quant = engine_figures(model, ids, prompt, greedy_tokens, kv_cache_dtype)
        finally:
            model.train(was_training)
        kv = dict(
            kv_cache_dtype=kv_cache_dtype,
            kv_ppl_float=ppl_kv_float,
            kv_ppl_quantized=ppl_kv_quant,
            kv_greedy_agreement=_leading_equal(greedy_kv_float, greedy_kv_quant),
        )
    return QualityReport(
        scheme.label,
        int(ids.shape[1]),
        ppl_float,
        ppl_quant,
        greedy_tokens,
        agree,
        **kv,
        unquantized_weights=left_float.names,
        unquantized_weight_bytes=left_float.bytes,
        unquantized_weight_fraction=left_float.fraction,
        clamped_to_context=clamped,
    )
