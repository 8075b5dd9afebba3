"""Turn the last-position logits of a step into next tokens, batched where the settings allow.

The sampler sees no ``Request``: each row is the runner's ``BatchRow`` (request id, sampling values,
token ids). Each request's scores go through the ``LogitsProcessorList`` ``generate`` would build for
it, which the engine keeps by request id (``per_request_processors.RequestProcessors``:
``SamplingParams.logits_processor``, built by ``engine.logits_processors.build_logits_processor``;
for engine callers that give only the plain fields, the same processors built from them). Per step:

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
from transformers.generation.logits_process import LogitsProcessorList

from ..core.plan import ScheduledRequest
from .input_batch import BatchRow
from .logits_processors import TokenHistory, split_fast_suffix, warp_batched
from .per_request_processors import RequestProcessors, build_logits_processors

__all__ = ["Logprobs", "Sampler", "build_logits_processors", "greedy_tokens"]
from .structured import GrammarMatchers, GrammarViolation, split_at_mask_slot

#: ``{request id: (log-prob of the chosen token, top [(token, log-prob), ...] or None)}``
Logprobs = dict[int, tuple[float, Optional[list[tuple[int, float]]]]]


def greedy_tokens(scores: torch.Tensor) -> list[int]:
    """The index of each row's largest score (the first one where several tie, as ``argmax`` and
    ``generate``'s greedy search pick), as Python ints.

    Args:
        scores: ``[N, vocab]`` float scores, on any device.
    Returns:
        N token ids.

    Why ``max(dim).indices`` on a CPU: torch's CPU ``argmax`` kernel is about three times slower
    than its ``max`` reduction over the same rows (one thread, thread time: 188 us against 65 us at
    64 x 2,048; 2.6 ms against 0.85 ms at 32 x 49,152), and both return the first index of a row's
    maximum (a NaN counts as the maximum in both). Elsewhere ``argmax`` stays.
    """
    if scores.device.type == "cpu":
        return scores.max(dim=-1).indices.tolist()
    return scores.argmax(dim=-1).tolist()


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
        processors: the engine's per-request processors and stopping criteria, by request id
            (None: a registry of its own, for callers that track their requests in it).
    """

    def __init__(
        self,
        generator: torch.Generator,
        grammar: Optional[GrammarMatchers] = None,
        processors: Optional[RequestProcessors] = None,
    ) -> None:
        self.generator = generator
        self.grammar = grammar
        self.processors = processors if processors is not None else RequestProcessors()
        self._states: dict[int, _RowState] = {}

    def forget(self, request_id: int) -> None:
        """Drop what is kept for ``request_id`` (processor split, seeded generator, token history;
        called when it finishes; unknown ids are ignored, never raises)."""
        self._states.pop(request_id, None)

    def _state(self, row: BatchRow) -> _RowState:
        st = self._states.get(row.request_id)
        if st is None:
            values = row.sampling
            procs = self.processors.processors(row.request_id)
            grammar = values.has_grammar
            split = split_at_mask_slot(procs) if grammar else None
            if split is None:  # no grammar, or none placed: the mask goes before the batched warpers
                (head, fast), tail = split_fast_suffix(procs), LogitsProcessorList()
            else:
                head = LogitsProcessorList(split[0])
                tail, fast = split_fast_suffix(LogitsProcessorList(split[1]))
            plain = not values.do_sample and len(procs) == 0 and not grammar
            st = _RowState(head=head, fast=fast, plain=plain, tail=tail, grammar=grammar)
            st.argmax_after_mask = not values.do_sample and not head and not tail and fast is None
            st.needs_scores = values.has_stopping_criteria  # they read the processed row
            self._states[row.request_id] = st
        return st

    def history(self, row: BatchRow, device: torch.device) -> torch.Tensor:
        """The row's prompt + output ids as a ``[1, seq]`` LongTensor on ``device``."""
        st = self._state(row)
        if st.history is None:
            st.history = TokenHistory(row.num_prompt_tokens + row.sampling.max_new_tokens + 1, device)
        return st.history.view(row.token_ids, ())

    def should_stop(self, request_id: int, token_ids: Sequence[int]) -> bool:
        """Evaluate the request's stopping criteria on its ids ``token_ids`` (prompt and output,
        the newest token last) and, as ``scores``, a one-tuple with its latest processed
        ``[1, vocab]`` scores. False for a request without criteria."""
        criteria = self.processors.stopping_criteria(request_id)
        if not criteria:
            return False
        st = self._states.get(request_id)
        last = st.last_scores if st is not None else None
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=last.device if last is not None else "cpu")
        return bool(criteria(ids, (last,) if last is not None else None).any())

    def sample(self, logits: torch.Tensor, requests: Sequence[BatchRow]) -> tuple[list[int], Logprobs]:
        """Next token for each row (and its log-probs where ``sampling.logprobs`` asks).

        Args:
            logits: ``[N, vocab]`` logits, row ``i`` for ``requests[i]`` (may be overwritten).
            requests: the runner's batch rows of the sampling requests.
        Returns:
            N token ids, and ``{request id: (log-prob, top or None)}`` for rows that asked.
        """
        if not requests:
            return [], {}
        n = len(requests)
        states = [self._state(r) for r in requests]
        scores = logits if logits.dtype == torch.float32 else logits.float()
        dev = scores.device
        tokens: list[Optional[int]] = [None] * n

        plain = [i for i, st in enumerate(states) if st.plain]
        if len(plain) == n:  # the common all-greedy step: one argmax, nothing else
            tokens = greedy_tokens(scores)
            return tokens, self._after(scores, requests, states, tokens)
        constrained = [i for i, st in enumerate(states) if st.grammar]
        if all(st.plain or (st.grammar and st.argmax_after_mask) for st in states):
            # greedy rows, some under a grammar only: one bitmask, one argmax (rows whose masked
            # scores nobody reads need the mask only where their argmax is refused)
            argmax_only = [
                i for i in constrained if requests[i].sampling.logprobs is None and not states[i].needs_scores
            ]
            self.grammar.mask_rows(scores, constrained, _grammar_rows(requests, constrained), argmax_only=argmax_only)
            tokens = greedy_tokens(scores)
            return tokens, self._after(scores, requests, states, tokens)
        # Per request first (its own history), then the grammars' one bitmask, then the trailing
        # warpers of every row batched.
        for i, st in enumerate(states):
            if st.head:
                ids = self.history(requests[i], dev)
                scores[i : i + 1] = st.head(ids, scores[i : i + 1].clone())
        if constrained:
            self.grammar.mask_rows(scores, constrained, _grammar_rows(requests, constrained))
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
            for i, t in zip(greedy, greedy_tokens(scores.index_select(0, idx))):
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
        return tokens, self._after(scores, requests, states, tokens)  # type: ignore[return-value]

    @staticmethod
    def _check_some_token_allowed(scores: torch.Tensor, rows: list[int], requests: Sequence[BatchRow]) -> None:
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

    def verify_drafts(
        self, logits: torch.Tensor, drafting: Sequence[ScheduledRequest], rows: Sequence[BatchRow]
    ) -> list[int]:
        """The greedy token of every verification row of requests with drafts (plain greedy ones,
        ``SamplingParams.can_draft``), each row masked first by its request's grammar, if any, in
        the state after the drafts before it.

        Args:
            logits: ``[R, vocab]``, the ``1 + len(drafts)`` rows of each of ``drafting`` in order.
            rows: the batch row of each of ``drafting``.
        Returns:
            R token ids.
        """
        scores = logits.float()
        masked, at = [], 0
        for s, row in zip(drafting, rows):
            if row.sampling.has_grammar:  # its output: the row's tokens before this step's
                masked.append(
                    (at, row.request_id, row.token_ids[row.num_prompt_tokens : s.start_position + 1], s.draft_token_ids)
                )
            at += s.num_new_tokens
        if masked:
            self.grammar.mask_draft_rows(scores, masked)
        return greedy_tokens(scores)

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
    def _after(scores: torch.Tensor, requests: Sequence[BatchRow], states, tokens) -> Logprobs:
        """Log-probs where asked (returned, for ``RunnerOutput.logprobs``); keep the processed row
        for stopping criteria."""
        out: Logprobs = {}
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
                k = requests[i].sampling.logprobs
                best = list(zip(top.indices[j, :k].tolist(), top.values[j, :k].tolist())) if k else None
                out[requests[i].request_id] = (chosen[j], best)
        for i, st in enumerate(states):
            if st.needs_scores:
                st.last_scores = scores[i : i + 1].clone()
        return out


def _grammar_rows(requests: Sequence[BatchRow], rows: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``(request id, output token ids)`` of each of ``rows``: the grammar's state to mask with."""
    return [(requests[i].request_id, requests[i].output_token_ids) for i in rows]
