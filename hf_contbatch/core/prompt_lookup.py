"""Prompt-lookup drafting for speculative decoding inside the continuous batch.

Prompt lookup (Saxena, "Prompt Lookup Decoding", 2023; transformers' ``prompt_lookup_num_tokens``,
vLLM's n-gram speculator) proposes the next tokens of a request from its own context: find an
earlier occurrence of the context's last n tokens (n from ``max_matching_ngram_size`` down to 1)
and propose the up to ``k`` tokens that followed it. The engine verifies every request's drafts in
the same flattened forward (the last token plus the drafts, as one query of ``1 + k`` rows) and
keeps the longest prefix of drafts that equals the greedy tokens, plus the token after it, so the
output is exactly the one plain greedy decoding gives.

This module is pure Python on token ids (the scheduling layer: no torch). Each request keeps an
index from n-gram to the position right after its most recent earlier occurrence, grown by the new
tokens only, so a proposal costs O(max n) per step instead of a scan of the whole context.
"""

from __future__ import annotations

from typing import Hashable, Sequence

# transformers' PromptLookupCandidateGenerator uses 2 when ``max_matching_ngram_size`` is unset.
DEFAULT_MAX_MATCHING_NGRAM_SIZE = 2


class _NgramIndex:
    """For one request: per n-gram size, n-gram -> start of the tokens that followed its latest
    occurrence, for every occurrence that some token follows."""

    __slots__ = ("max_n", "tables", "num_indexed")

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tables: list[dict[tuple, int]] = [{} for _ in range(max_n + 1)]
        # Continuation starts 1..num_indexed-1 are in the tables (start j: n-gram ids[j-n:j]).
        self.num_indexed = 1

    def extend(self, ids: Sequence[int]) -> None:
        """Index the continuation starts up to ``len(ids) - 1`` (the last token has no follower)."""
        for j in range(self.num_indexed, len(ids)):
            for n in range(1, min(self.max_n, j) + 1):
                self.tables[n][tuple(ids[j - n : j])] = j
        self.num_indexed = max(self.num_indexed, len(ids))

    def lookup(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the latest earlier occurrence of the longest matching
        suffix of ``ids`` (``max_n`` down to 1); empty when none occurs."""
        length = len(ids)
        for n in range(min(self.max_n, length - 1), 0, -1):
            start = self.tables[n].get(tuple(ids[length - n :]))
            if start is not None:
                return list(ids[start : min(start + k, length)])
        return []


class NgramProposer:
    """Drafts for each request from n-gram matches in its own prompt and output.

    A request's index survives preemption (it is built on token ids, not on KV) and is dropped by
    :meth:`forget`.
    """

    def __init__(self) -> None:
        self._indexes: dict[Hashable, _NgramIndex] = {}

    def propose(self, request_id: Hashable, token_ids: Sequence[int], k: int, max_ngram: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (the request's prompt + output).

        Args:
            request_id: whose index to use (built on first use).
            token_ids: every known token of the request, oldest first; only its growth since the
                last call is indexed.
            k: most drafts (>= 0).
            max_ngram: longest suffix tried (>= 1).
        Returns:
            the drafts, possibly empty.
        """
        if k <= 0 or len(token_ids) < 2:
            return []
        index = self._indexes.get(request_id)
        if index is None or index.max_n != max_ngram or index.num_indexed > len(token_ids):
            index = self._indexes[request_id] = _NgramIndex(max_ngram)
        index.extend(token_ids)
        return index.lookup(token_ids, k)

    def forget(self, request_id: Hashable) -> None:
        """Drop the request's index (unknown ids are ignored)."""
        self._indexes.pop(request_id, None)
