"""Prompt-lookup drafts inside the continuous batch: the last admission sub-step, and verification
after the forward.

A decoding greedy request may run its last token plus up to ``prompt_lookup_num_tokens`` drafts
proposed from its own context (``prompt_lookup.NgramProposer``) as one query of ``1 + k`` rows. Drafts
take only what the step has left once running requests, forks, swap-ins and admissions have their
tokens and blocks: a draft never holds back, preempts or keeps waiting anything else, and never
takes the watermark. After the forward the longest prefix of drafts equal to the greedy tokens is
proposed, with the greedy token after it (``accepted_tokens``), so the output is exactly plain
greedy decoding's; the engine's stop checks may keep fewer, and the scheduler appends them. A request
with a grammar drafts only the prefix its grammar accepts (the engine's ``draft_filter``), so
verification under the grammar's mask keeps the output exactly constrained greedy decoding's.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

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

    def add(self, step: StepBudget, running: Sequence[Request]) -> None:
        """Admit sub-step: drafts for the planned decodes (of ``running``, the running requests),
        in plan order, from the tokens and blocks the step has left (the blocks a decode already
        holds may take drafts too)."""
        bm = self._block_manager
        by_id = {r.request_id: r for r in running}
        for i, s in enumerate(step.rows):
            if step.token_budget < 1:
                return
            if not s.is_decode:
                continue
            req = by_id[s.request_id]
            if not req.sampling.prompt_lookup_num_tokens:
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

    @staticmethod
    def accepted_tokens(draft_token_ids: Sequence[int], greedy: Sequence[int]) -> list[int]:
        """Greedy verification (Leviathan et al., 2023, with argmax targets): ``greedy[i]`` is the
        greedy token after the last token and ``i`` drafts; the drafts while they equal it, then the
        greedy token after them (``1 + accepted`` tokens, the request's proposal for the step)."""
        accepted = 0
        while accepted < len(draft_token_ids) and draft_token_ids[accepted] == greedy[accepted]:
            accepted += 1
        return list(greedy[: accepted + 1])

    def count(self, num_drafts: int, num_kept_drafts: int) -> None:
        """Count ``num_drafts`` verified drafts of which ``num_kept_drafts`` were kept (accepted and
        not past a stop)."""
        self._counters.num_draft_tokens += num_drafts
        self._counters.num_accepted_draft_tokens += num_kept_drafts

    def forget(self, request_id: int) -> None:
        """Drop the proposer's index of a request that left the scheduler."""
        self.proposer.forget(request_id)
