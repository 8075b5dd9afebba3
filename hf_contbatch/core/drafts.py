"""Prompt-lookup drafts inside the continuous batch: the last admission sub-step, and verification
after the forward.

A decoding greedy request may run its last token plus up to ``prompt_lookup_num_tokens`` drafts
proposed from its own context (``prompt_lookup.NgramProposer``) as one query of ``1 + k`` rows. Drafts
take only what the step has left once running requests, forks, swap-ins and admissions have their
tokens and blocks: a draft never holds back, preempts or keeps waiting anything else, and never
takes the watermark. After the forward the longest prefix of drafts equal to the greedy tokens is
kept, with the greedy token after it, so the output is exactly plain greedy decoding's. A request
with a grammar drafts only the prefix its grammar accepts (the engine's ``draft_filter``), so
verification under the grammar's mask keeps the output exactly constrained greedy decoding's.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..request import Request
from .block_manager import BlockManager
from .budget import StepBudget
from .plan import ScheduledRequest, SchedulerCounters
from .prompt_lookup import DEFAULT_MAX_MATCHING_NGRAM_SIZE, NgramProposer

__all__ = ["Drafts"]


class Drafts:
    """Proposes drafts for the planned decodes and keeps the accepted ones.

    Args:
        block_manager: the device pool's bookkeeping.
        counters: the scheduler's counters (``num_draft_tokens``, ``num_accepted_draft_tokens``).
        draft_filter: ``(request, drafts) -> the longest prefix of drafts the request may verify``
            (the engine's grammar check for requests with structured outputs); None keeps all.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        counters: SchedulerCounters,
        draft_filter: Optional[Callable[[Request, list[int]], list[int]]] = None,
    ) -> None:
        self._block_manager = block_manager
        self._counters = counters
        self._draft_filter = draft_filter
        self.proposer = NgramProposer()

    def add(self, step: StepBudget) -> None:
        """Admit sub-step: drafts for the planned decodes, in plan order, from the tokens and blocks
        the step has left (the blocks a decode already holds may take drafts too)."""
        bm = self._block_manager
        for i, s in enumerate(step.rows):
            req = s.request
            if step.token_budget < 1:
                return
            if not req.sampling.prompt_lookup_num_tokens or not s.is_decode:
                continue
            held = bm.blocks_for_tokens(req.num_tokens)
            room = (held + max(0, step.block_budget)) * bm.block_size - req.num_tokens
            limit = bm.step_token_limit(req.num_computed_tokens)
            if limit is not None:  # the decode's token and its drafts in one step
                room = min(room, limit - 1)
            drafts = self._propose(req, min(step.token_budget, room))
            if drafts:
                extra = bm.blocks_for_tokens(req.num_tokens + len(drafts)) - held
                step.replace_row(i, ScheduledRequest.for_tokens(req, 1 + len(drafts), drafts), blocks=extra)

    def _propose(self, req: Request, room: int) -> list[int]:
        """Prompt-lookup drafts for a decoding request (``SamplingParams.can_draft``), at most
        ``room`` of them, and never so many that accepting all of them plus the token after them
        would pass ``max_new_tokens`` or the model's context (``submit`` sized the request for
        that many tokens, so drafts never need more KV than the request could)."""
        sp = req.sampling
        if not sp.can_draft or req.pending_forks or not req.output_token_ids:
            return []
        k = min(sp.prompt_lookup_num_tokens, room, sp.max_new_tokens - len(req.output_token_ids) - 1)
        if req.max_total_tokens is not None:
            k = min(k, req.max_total_tokens - req.num_tokens - 1)
        if k <= 0:
            return []
        max_ngram = sp.max_matching_ngram_size or DEFAULT_MAX_MATCHING_NGRAM_SIZE
        drafts = self.proposer.propose(req.request_id, req.all_token_ids, k, max_ngram)
        if drafts and self._draft_filter is not None:
            drafts = self._draft_filter(req, drafts)
        return drafts

    def accept(
        self, row: ScheduledRequest, tokens: list[int], on_token: Optional[Callable[[Request], bool]] = None
    ) -> None:
        """Greedy verification (Leviathan et al., 2023, with argmax targets): ``tokens[i]`` is the
        greedy token after the last token and ``i`` drafts; keep drafts while they equal it, then
        the greedy token after them, stopping early when ``on_token`` says the request finished.
        The KV of rejected drafts is dropped: ``num_computed_tokens`` covers accepted tokens only and
        the blocks past it are freed."""
        req, drafts = row.request, row.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == tokens[accepted]:
            accepted += 1
        self._counters.num_draft_tokens += len(drafts)
        req.num_computed_tokens += 1  # the last token's KV
        for i, token in enumerate(tokens[: accepted + 1]):
            req.output_token_ids.append(token)
            if i < accepted:
                req.num_computed_tokens += 1  # it was a draft: its KV was computed this step
                self._counters.num_accepted_draft_tokens += 1  # counted only when kept (a stop may come first)
            if on_token is not None and on_token(req):
                break
        self._block_manager.trim(req.request_id, req.num_computed_tokens)

    def forget(self, request_id: int) -> None:
        """Drop the proposer's index of a request that left the scheduler."""
        self.proposer.forget(request_id)
