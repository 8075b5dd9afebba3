"""What a weight quantization costs on a model: perplexity of a held-out text and greedy agreement,
quantized against the model's own weights (:func:`quality_report`).

Perplexity is ``exp`` of the mean next-token cross-entropy of transformers' own forward over the
text (one sequence, at most ``max_tokens`` tokens). The quantized figures run the same forward and
``generate`` with the model's linears served by the int8 kernels the engine uses
(``kernels.linears.pack_linears(..., quantization="int8")``), which are removed afterwards: the model
is left as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import QUANTIZATIONS
from ..kernels.linears import pack_linears


@dataclass(frozen=True)
class QualityReport:
    """Quantized against float on one text.

    Attributes:
        quantization: the weight format measured ("int8").
        tokens: tokens of held-out text scored.
        ppl_float, ppl_quantized: perplexity (``exp`` of the mean next-token cross-entropy, nats).
        greedy_tokens: tokens generated greedily from the text's first tokens, each way.
        greedy_agreement: leading generated tokens that are the same both ways (0..greedy_tokens).
    """

    quantization: str
    tokens: int
    ppl_float: float
    ppl_quantized: float
    greedy_tokens: int
    greedy_agreement: int

    @property
    def ppl_change(self) -> float:
        """Relative perplexity change, ``ppl_quantized / ppl_float - 1`` (0.01: 1 % worse)."""
        return self.ppl_quantized / self.ppl_float - 1.0

    def lines(self) -> list[str]:
        """The report as text lines (what ``hf-contbatch generate --check-quality`` prints)."""
        return [
            f"perplexity on {self.tokens} held-out tokens: float {self.ppl_float:.4f}, "
            f"{self.quantization} {self.ppl_quantized:.4f} ({100 * self.ppl_change:+.2f}%)",
            f"greedy agreement: {self.greedy_agreement}/{self.greedy_tokens} leading tokens equal",
        ]


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


def quality_report(
    model,
    tokenizer=None,
    quantization: str = "int8",
    text: Optional[str] = None,
    *,
    max_tokens: int = 512,
    prompt_tokens: int = 32,
    greedy_tokens: int = 32,
) -> QualityReport:
    """Perplexity and greedy agreement of ``model`` with its linears quantized, against as it is.

    Args:
        model: a transformers causal LM on the CPU (not open in an engine: its linears are packed
            here for the quantized figures and restored afterwards).
        tokenizer: its tokenizer (needed with ``text``; default: loaded from the model's path).
        quantization: the weight format (``config.QUANTIZATIONS``).
        text: the held-out text; default: the embedded default model's README.
        max_tokens: most tokens of the text scored.
        prompt_tokens, greedy_tokens: greedy generation from the text's first ``prompt_tokens``
            tokens for ``greedy_tokens`` tokens (EOS not stopping it).

    Raises:
        ValueError: an unknown ``quantization`` (naming the choices), or a text under 2 tokens.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"`quantization` must be one of {QUANTIZATIONS}, got {quantization!r}")
    if text is None:
        from ..default_model import default_model_path

        text = (Path(default_model_path()) / "README.md").read_text(encoding="utf-8")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_tokens).input_ids
    if ids.shape[1] < 2:
        raise ValueError(f"`text` must have at least 2 tokens, got {ids.shape[1]}")
    prompt = ids[:, : max(1, min(prompt_tokens, ids.shape[1] - 1))]
    was_training = model.training
    model.eval()
    ppl_float = perplexity(model, ids)
    greedy_float = _greedy(model, prompt, greedy_tokens)
    packed = pack_linears(model, "auto", quantization=quantization)
    try:
        ppl_quant = perplexity(model, ids)
        greedy_quant = _greedy(model, prompt, greedy_tokens)
    finally:
        if packed is not None:
            packed.restore()
        model.train(was_training)
    agree = 0
    for a, b in zip(greedy_float, greedy_quant):
        if a != b:
            break
        agree += 1
    return QualityReport(quantization, int(ids.shape[1]), ppl_float, ppl_quant, greedy_tokens, agree)
