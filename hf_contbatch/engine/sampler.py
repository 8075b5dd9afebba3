"""Turn the last-position logits of a step into next tokens, batched where the settings allow.

Each request's scores go through the ``LogitsProcessorList`` ``generate`` would build for it
(``SamplingParams.logits_processor``, built by ``engine.logits_processors.build_logits_processor``; for engine
callers that give only the plain fields, the same processors built here). Per step:

* plain greedy rows (no processor): one batched argmax over the raw logits (with greedy rows whose
  only processor is their grammar: the step's bitmask first, then that one argmax);
* every other row: the processors before its trailing temperature / top-k / top-p warpers run on
  its own ``[1, seq]`` history (a preallocated ``TokenHistory``, grown by the new tokens only),
  as ``generate`` calls them; then the trailing warpers of all rows run together with per-row
  parameter tensors (``generation.warp_batched``, equal to transformers' warpers row by row).

A request with structured outputs is masked by its grammar between the two: its processors up to
the grammar's place in its list (``structured.GrammarMaskSlot``, where ``generate`` would run a
grammar library's processor), then one bitmask for every constrained row of the step, applied in
one op (``structured.GrammarMatchers``), then its processors after that place. Steps without a
constrained request never reach the grammar code.

Then greedy rows take the argmax of their processed scores, sampled rows draw from their softmax:
one ``torch.multinomial`` over all unseeded rows with the engine's generator (over the top-k
candidates only when every such row has a top-k), one per seeded row with that request's own
generator over the whole vocabulary (the draw ``generate`` makes after ``torch.manual_seed(seed)``).
"""

from __future__ import annotations

from dataclasses import dataclass
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

from ..core.plan import ScheduledRequest
from ..request import Request, SamplingParams
from .logits_processors import TokenHistory, split_fast_suffix, warp_batched
from .structured import GrammarMaskSlot, GrammarMatchers, GrammarViolation, spec_of, split_at_mask_slot


def build_logits_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """The processors ``generate`` would build for the plain fields of ``params`` (engine callers
    that pass no ``logits_processor``)."""
    procs = LogitsProcessorList()
    if params.repetition_penalty not in (None, 1.0):
        procs.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.min_new_tokens > 0 and params.eos_token_ids:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens, list(params.eos_token_ids)))
    if spec_of(params) is not None:
        procs.append(GrammarMaskSlot())  # where generate runs a custom processor: before the warpers
    if params.do_sample:
        if params.temperature is not None and params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k is not None and params.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
        if params.top_p is not None and params.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return procs


@dataclass
class _RowState:
    head: LogitsProcessorList  # processors run on this request's own history (may be empty)
    fast: Optional[tuple]  # then (temperature, top_k, top_p), batched with other rows; None: none
    plain: bool  # greedy with no processor and no grammar
    tail: LogitsProcessorList  # processors after the grammar mask that cannot be batched (rare)
    grammar: bool  # masked by its grammar before ``tail`` and ``fast``
    generator: Optional[torch.Generator] = None
    argmax_after_mask: bool = False  # greedy with no processor: the argmax of the masked row
    needs_scores: bool = False  # its stopping criteria read the processed row
    history: Optional[TokenHistory] = None
    last_scores: Optional[torch.Tensor] = None  # [1, vocab], for stopping criteria


class Sampler:
    """Samples next tokens for a batch of requests.

    Args:
        generator: the engine's own ``torch.Generator`` (no global RNG state is touched).
        grammar: the engine's grammar matchers (requests with structured outputs); None: no
            request has a grammar.
    """

    def __init__(self, generator: torch.Generator, grammar: Optional[GrammarMatchers] = None) -> None:
        self.generator = generator
        self.grammar = grammar
        self._states: dict[int, _RowState] = {}

    def forget(self, request_id: int) -> None:
        """Drop what is kept for ``request_id`` (processor split, seeded generator, token history;
        called when it finishes; unknown ids are ignored, never raises)."""
        self._states.pop(request_id, None)

    def _state(self, req: Request) -> _RowState:
        st = self._states.get(req.request_id)
        if st is None:
            params = req.sampling
            procs = params.logits_processor
            if procs is None:
                procs = build_logits_processors(params, req.num_prompt_tokens)
            elif not isinstance(procs, (list, tuple)):
                procs = procs()  # a factory: this request's (or fork's) own processors
            grammar = spec_of(params) is not None
            split = split_at_mask_slot(procs) if grammar else None
            if split is None:  # no grammar, or none placed: the mask goes before the batched warpers
                (head, fast), tail = split_fast_suffix(procs), LogitsProcessorList()
            else:
                head = LogitsProcessorList(split[0])
                tail, fast = split_fast_suffix(LogitsProcessorList(split[1]))
            plain = not params.do_sample and len(procs) == 0 and not grammar
            st = _RowState(head=head, fast=fast, plain=plain, tail=tail, grammar=grammar)
            st.argmax_after_mask = not params.do_sample and not head and not tail and fast is None
            st.needs_scores = bool(params.stopping_criteria)  # they read the processed row
            self._states[req.request_id] = st
        return st

    def history(self, req: Request, device: torch.device) -> torch.Tensor:
        """The request's prompt + output ids as a ``[1, seq]`` LongTensor on ``device``."""
        st = self._state(req)
        if st.history is None:
            cap = req.num_prompt_tokens + req.sampling.max_new_tokens + 1
            st.history = TokenHistory(cap, device)
        return st.history.view(req.prompt_token_ids, req.output_token_ids)

    def should_stop(self, req: Request) -> bool:
        """Evaluate ``req.sampling.stopping_criteria`` on its own ids (and, as ``scores``, a
        one-tuple with this step's processed ``[1, vocab]`` scores)."""
        criteria = req.sampling.stopping_criteria
        if not criteria:
            return False
        st = self._state(req)
        ids = self.history(req, st.last_scores.device if st.last_scores is not None else torch.device("cpu"))
        scores = (st.last_scores,) if st.last_scores is not None else None
        return bool(criteria(ids, scores).any())

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """Next token for each request (and its log-probs where ``sampling.logprobs`` asks).

        Args:
            logits: ``[N, vocab]`` logits, row ``i`` for ``requests[i]`` (may be overwritten).
        Returns:
            N token ids.
        """
        if not requests:
            return []
        n = len(requests)
        states = [self._state(r) for r in requests]
        scores = logits if logits.dtype == torch.float32 else logits.float()
        dev = scores.device
        tokens: list[Optional[int]] = [None] * n

        plain = [i for i, st in enumerate(states) if st.plain]
        if len(plain) == n:  # the common all-greedy step: one argmax, nothing else
            tokens = scores.argmax(dim=-1).tolist()
            self._after(scores, requests, states, tokens)
            return tokens
        constrained = [i for i, st in enumerate(states) if st.grammar]
        if all(st.plain or (st.grammar and st.argmax_after_mask) for st in states):
            # greedy rows, some under a grammar only: one bitmask, one argmax (rows whose masked
            # scores nobody reads need the mask only where their argmax is refused)
            argmax_only = [
                i for i in constrained if requests[i].sampling.logprobs is None and not states[i].needs_scores
            ]
            self.grammar.mask_rows(scores, constrained, [requests[i] for i in constrained], argmax_only=argmax_only)
            tokens = scores.argmax(dim=-1).tolist()
            self._after(scores, requests, states, tokens)
            return tokens
        # Per request first (its own history), then the grammars' one bitmask, then the trailing
        # warpers of every row batched.
        for i, st in enumerate(states):
            if st.head:
                ids = self.history(requests[i], dev)
                scores[i : i + 1] = st.head(ids, scores[i : i + 1].clone())
        if constrained:
            self.grammar.mask_rows(scores, constrained, [requests[i] for i in constrained])
            for i in constrained:
                if states[i].tail:
                    ids = self.history(requests[i], dev)
                    scores[i : i + 1] = states[i].tail(ids, scores[i : i + 1].clone())
            self._check_some_token_allowed(scores, constrained, requests)
        fast = [i for i, st in enumerate(states) if st.fast is not None]
        candidates = None  # top-k candidate ids of the fast rows (None: not every fast row has one)
        if fast:
            idx = torch.tensor(fast, device=dev)
            warped, candidates = warp_batched(scores.index_select(0, idx), [states[i].fast for i in fast])
            scores = scores.index_copy(0, idx, warped) if len(fast) < n else warped

        greedy = [i for i, r in enumerate(requests) if not r.sampling.do_sample]
        if greedy:
            idx = torch.tensor(greedy, device=dev)
            for i, t in zip(greedy, scores.index_select(0, idx).argmax(dim=-1).tolist()):
                tokens[i] = t
        unseeded = [i for i, r in enumerate(requests) if r.sampling.do_sample and r.sampling.seed is None]
        if unseeded:
            self._draw_unseeded(scores, unseeded, fast, candidates, tokens)
        for i, req in enumerate(requests):
            if not req.sampling.do_sample or req.sampling.seed is None:
                continue
            # The draw generate makes after torch.manual_seed(seed): softmax and multinomial over
            # the whole vocabulary with the request's own generator.
            st = states[i]
            if st.generator is None:
                st.generator = torch.Generator(device=dev).manual_seed(req.sampling.seed)
            probs = torch.softmax(scores[i : i + 1], dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=st.generator).item())
        self._after(scores, requests, states, tokens)
        return tokens  # type: ignore[return-value]

    @staticmethod
    def _check_some_token_allowed(scores: torch.Tensor, rows: list[int], requests: Sequence[Request]) -> None:
        """Raise ``GrammarViolation`` naming the request when a constrained row has no finite score
        left (its grammar and its own processors together refuse every token), instead of torch's
        error about the probabilities (the step's failure isolation then fails that request alone)."""
        dead = torch.isneginf(scores.index_select(0, torch.tensor(rows, device=scores.device))).all(dim=-1)
        if bool(dead.any()):
            req = requests[rows[int(dead.nonzero()[0])]]
            raise GrammarViolation(
                f"request {req.request_id}: no token is allowed next: its grammar and its logits processors "
                "(e.g. no_repeat_ngram_size, bad_words_ids) together refuse every token"
            )

    def verify_drafts(self, logits: torch.Tensor, drafting: Sequence[ScheduledRequest]) -> list[int]:
        """The greedy token of every verification row of requests with drafts (plain greedy ones,
        ``SamplingParams.can_draft``), each row masked first by its request's grammar, if any, in
        the state after the drafts before it.

        Args:
            logits: ``[R, vocab]``, the ``1 + len(drafts)`` rows of each of ``drafting`` in order.
        Returns:
            R token ids.
        """
        scores = logits.float()
        rows, at = [], 0
        for s in drafting:
            if spec_of(s.request.sampling) is not None:
                rows.append((at, s.request, s.draft_token_ids))
            at += s.num_new_tokens
        if rows:
            self.grammar.mask_draft_rows(scores, rows)
        return scores.argmax(dim=-1).tolist()

    def _draw_unseeded(self, scores, rows, fast, candidates, tokens) -> None:
        """One ``torch.multinomial`` with the engine's generator for all unseeded sampled rows.
        When they all went through top-k, the draw runs over the candidates only (every other
        probability is exactly 0, so the distribution is the same) instead of the vocabulary."""
        dev = scores.device
        gen = self.generator
        pos = {i: j for j, i in enumerate(fast)}
        if candidates is not None and all(i in pos for i in rows):
            cand = candidates[torch.tensor([pos[i] for i in rows], device=dev)]
            probs = torch.softmax(scores[torch.tensor(rows, device=dev)[:, None], cand], dim=-1)
            if gen.device != probs.device:
                probs, cand = probs.to(gen.device), cand.to(gen.device)
            picked = cand.gather(1, torch.multinomial(probs, 1, generator=gen))[:, 0].tolist()
        else:
            probs = torch.softmax(scores.index_select(0, torch.tensor(rows, device=dev)), dim=-1)
            if gen.device != probs.device:
                probs = probs.to(gen.device)
            picked = torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()
        for i, t in zip(rows, picked):
            tokens[i] = t

    @staticmethod
    def _after(scores: torch.Tensor, requests: Sequence[Request], states, tokens) -> None:
        """Record log-probs where asked, keep the processed row for stopping criteria."""
        want = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
        if want:
            idx = torch.tensor(want, device=scores.device)
            logp = torch.log_softmax(scores.index_select(0, idx), dim=-1)
            chosen = logp.gather(1, torch.tensor([tokens[i] for i in want], device=scores.device)[:, None])[
                :, 0
            ].tolist()
            top_n = max(requests[i].sampling.logprobs for i in want)
            top = torch.topk(logp, min(top_n, logp.shape[-1])) if top_n else None
            for j, i in enumerate(want):
                req = requests[i]
                req.output_logprobs.append(chosen[j])
                k = req.sampling.logprobs
                if k:
                    req.output_top_logprobs.append(list(zip(top.indices[j, :k].tolist(), top.values[j, :k].tolist())))
        for i, r in enumerate(requests):
            if r.sampling.stopping_criteria:
                states[i].last_scores = scores[i : i + 1].clone()
