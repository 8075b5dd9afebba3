"""Turn the last-position logits of a step into next tokens, one batched call for plain greedy rows.

Sampling parameters are applied with transformers' own logits processors and warpers, in the order
``generate`` applies them (penalties first, then temperature, top-k, top-p), so a request behaves as
it would under ``model.generate``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .request import Request, SamplingParams


def build_logits_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """The processors ``generate`` would build for ``params`` (the subset we support)."""
    procs = LogitsProcessorList()
    if params.repetition_penalty not in (None, 1.0):
        procs.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.min_new_tokens > 0 and params.eos_token_ids:
        procs.append(
            MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens, list(params.eos_token_ids))
        )
    if params.do_sample:
        if params.temperature is not None and params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k is not None and params.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
        if params.top_p is not None and params.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return procs


class Sampler:
    """Samples next tokens for a batch of requests.

    Args:
        generator: the engine's own ``torch.Generator`` (no global RNG state is touched).
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self._processors: dict[int, LogitsProcessorList] = {}
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, request_id: int) -> None:
        """Drop the logits processors and the seeded generator kept for ``request_id`` (called when
        it finishes; unknown ids are ignored, never raises)."""
        self._processors.pop(request_id, None)
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """Next token for each request.

        Args:
            logits: ``[N, vocab]`` float logits, row ``i`` for ``requests[i]``.
        Returns:
            N token ids.
        """
        if not requests:
            return []
        tokens: list[Optional[int]] = [None] * len(requests)
        plain = [i for i, r in enumerate(requests) if r.sampling.is_greedy_plain]
        if plain:
            idx = torch.tensor(plain, device=logits.device)
            for i, t in zip(plain, logits.index_select(0, idx).argmax(dim=-1).tolist()):
                tokens[i] = t
        for i, req in enumerate(requests):
            if tokens[i] is not None:
                continue
            tokens[i] = self._sample_one(logits[i : i + 1].float(), req)
        return tokens  # type: ignore[return-value]

    def _sample_one(self, scores: torch.Tensor, req: Request) -> int:
        params = req.sampling
        procs = self._processors.get(req.request_id)
        if procs is None:
            procs = build_logits_processors(params, req.num_prompt_tokens)
            self._processors[req.request_id] = procs
        if procs:
            input_ids = torch.tensor([req.all_token_ids], device=scores.device)
            scores = procs(input_ids, scores)
        if not params.do_sample:
            return int(scores.argmax(dim=-1).item())
        probs = torch.softmax(scores, dim=-1)
        gen = self.generator
        if params.seed is not None:
            gen = self._generators.get(req.request_id)
            if gen is None:
                gen = torch.Generator(device=scores.device).manual_seed(params.seed)
                self._generators[req.request_id] = gen
        if gen.device != probs.device:
            probs = probs.to(gen.device)
        return int(torch.multinomial(probs, 1, generator=gen).item())
