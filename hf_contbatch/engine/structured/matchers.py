"""One grammar matcher per request, owned by the engine, and the step's token bitmask.

A matcher follows the tokens its request keeps, only: ``accept`` runs from the engine's per-token
callback, after sampling and draft verification, so rejected drafts and failed forward passes never
reach it. It depends on nothing else (no KV), so it survives swap and recompute preemption as it
is; wherever it is found out of step with the request's kept tokens it is rebuilt from them
(``_synced``). Forks start from their own matcher (they fork before their first token). The entry
goes when the request ends (``forget``).

Per step the sampler asks for one ``[rows, ceil(vocab / 32)]`` int32 bitmask for the constrained
rows (filled by xgrammar's ``BatchGrammarMatcher``, in parallel where it has threads) and applies
it in one call: our C kernel on CPU float32 scores (``kernels/token_bitmask``, many times faster
than xgrammar's there), xgrammar's kernel elsewhere; where xgrammar's serves, a greedy row that
only needs its argmax is left unmasked when its argmax is allowed (exact, and cheaper). Prompt-lookup
drafts of a constrained greedy request are cut to the prefix its grammar accepts before they are
scheduled (``draft_prefix``, a look-ahead rolled back at once), and each verification row is
masked with the state after the drafts before it (``mask_draft_rows``), so drafting never changes
constrained greedy output.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ...kernels.token_bitmask import TokenBitmaskKernel
from ...request import Request
from .compiler import GrammarCompilation
from .specs import import_xgrammar, spec_of


class GrammarViolation(RuntimeError):
    """A token the request's grammar does not allow reached its matcher."""


@dataclass
class _Entry:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int  # output tokens it has accepted


class GrammarMatchers:
    """The matchers of one engine's constrained requests.

    Args:
        compilation: the engine's compiled grammars.
    """

    def __init__(self, compilation: GrammarCompilation) -> None:
        self.compilation = compilation
        self._compiled: dict[int, concurrent.futures.Future] = {}  # request id -> its compile
        self._waiting: dict[int, Request] = {}  # requests whose compile was not seen done yet
        self._entries: dict[int, _Entry] = {}
        self._stop_tokens: dict[int, Optional[list[int]]] = {}  # request id -> its EOS ids (None: the tokenizer's)
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on first use
        self._bitmask: Optional[torch.Tensor] = None  # reused between steps, grown as needed
        self._kernel = TokenBitmaskKernel()  # ours on CPU float32 scores; xgrammar's otherwise

    @property
    def num_tracked(self) -> int:
        """Requests with grammar state held here (0 once every constrained request ended)."""
        return len(set(self._compiled) | set(self._entries) | set(self._waiting))

    # --- requests in and out -----------------------------------------------------------------------
    def track(self, req: Request) -> None:
        """Start (or find) the compile of ``req``'s grammar, for it and its pending forks; they
        wait for admission (``waiting_for_grammar``) until it is done. No-op without a grammar."""
        spec = spec_of(req.sampling)
        if spec is None:
            return
        future = self.compilation.compile(spec)
        for r in (req, *req.pending_forks):
            self._compiled[r.request_id] = future
            self._stop_tokens[r.request_id] = list(r.sampling.eos_token_ids) or None
            self._waiting[r.request_id] = r
            r.waiting_for_grammar = not future.done()

    def poll(self) -> list[tuple[Request, BaseException]]:
        """Let requests whose grammar is compiled be admitted; returns those whose compile failed
        (with the error), for the engine to fail."""
        failed = []
        for rid, req in list(self._waiting.items()):
            future = self._compiled[rid]
            if not future.done():
                continue
            del self._waiting[rid]
            req.waiting_for_grammar = False
            exc = future.exception()
            if exc is not None:
                self.compilation.forget_failed(spec_of(req.sampling))
                failed.append((req, exc))
        return failed

    @property
    def has_waiting(self) -> bool:
        """True while a request waits for its grammar."""
        return any(r.waiting_for_grammar for r in self._waiting.values())

    def wait(self, timeout: float) -> None:
        """Block until a waited-for compile finishes or ``timeout`` seconds pass (a step with nothing
        to run waits here instead of spinning)."""
        futures = {self._compiled[rid] for rid, r in self._waiting.items() if r.waiting_for_grammar}
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def forget(self, request_id: int) -> None:
        """Drop everything held for ``request_id`` (it ended); unknown ids are ignored."""
        self._compiled.pop(request_id, None)
        self._waiting.pop(request_id, None)
        self._entries.pop(request_id, None)
        self._stop_tokens.pop(request_id, None)

    def tracks(self, request_id: int) -> bool:
        """True when ``request_id`` has a grammar here."""
        return request_id in self._compiled

    # --- the tokens a request keeps --------------------------------------------------------------------
    def accept(self, request_id: int, output_token_ids: Sequence[int]) -> bool:
        """Advance the request's matcher on the newest of its output tokens ``output_token_ids``
        (the token the engine is deciding on, last); True when the grammar terminated (it accepted
        its stop token; with no stop token at all, once it is complete). No-op (False) without a
        grammar.

        Raises:
            GrammarViolation: the token is not allowed there (the request fails alone).
        """
        if request_id not in self._compiled:
            return False
        n = len(output_token_ids)
        entry = self._synced(request_id, output_token_ids, n - 1)
        token = output_token_ids[-1]
        if not entry.matcher.accept_token(token):
            raise GrammarViolation(f"token {token} is not allowed by the request's grammar after {n - 1} tokens")
        entry.num_accepted = n
        return entry.matcher.is_terminated()

    def draft_prefix(self, req: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar accepts after ``req``'s kept tokens, without
        stop tokens (the row after one would have nothing to mask); the matcher is rolled back."""
        if req.request_id not in self._compiled:
            return drafts
        matcher = self._synced(req.request_id, req.output_token_ids, len(req.output_token_ids)).matcher
        stops = set(matcher.stop_token_ids)
        n = 0
        for token in drafts:
            if token in stops or not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return drafts[:n]

    # --- the step's bitmask ------------------------------------------------------------------------
    def mask_rows(
        self,
        scores: torch.Tensor,
        rows: Sequence[int],
        requests: Sequence[tuple[int, Sequence[int]]],
        argmax_only: Sequence[int] = (),
    ) -> None:
        """Set to ``-inf`` the scores of tokens each request's grammar does not allow next.

        Args:
            scores: ``[N, vocab]`` float32 scores, changed in place.
            rows: the rows of ``scores`` to mask, one per request.
            requests: ``(request id, output token ids)`` of those rows' constrained requests.
            argmax_only: rows (of ``rows``) whose caller reads only the argmax: unless our kernel
                serves ``scores`` (then masking every row costs less than the check), they are
                masked only when their argmax is a token the grammar refuses. Exact: when the first
                maximum of a row is allowed, it is also the first maximum of the masked row.
        """
        bitmask = self._bitmask_rows(scores.shape[0])
        matchers = [self._synced(rid, out, len(out)).matcher for rid, out in requests]
        if self._batch is None:
            self._batch = import_xgrammar().BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, list(rows))
        apply = list(rows)
        if argmax_only and not self._kernel.serves(scores):
            lazy = torch.tensor(list(argmax_only), dtype=torch.long)
            best = scores.index_select(0, lazy.to(scores.device)).argmax(dim=-1).cpu()
            allowed = (bitmask[lazy, best >> 5] >> (best & 31)) & 1
            keep = {row for row, ok in zip(argmax_only, allowed.tolist()) if ok}
            apply = [row for row in apply if row not in keep]
        if apply:
            self._apply(scores, bitmask, apply)

    def mask_draft_rows(
        self, scores: torch.Tensor, drafting: Sequence[tuple[int, int, Sequence[int], Sequence[int]]]
    ) -> None:
        """Mask the verification rows of requests with drafts: ``(first row, request id, its output
        token ids, drafts)``; row ``first + j`` gets the grammar's state after the request's kept
        tokens and ``j`` drafts.

        Raises:
            GrammarViolation: a draft the grammar refuses (``draft_prefix`` cut them before).
        """
        bitmask = self._bitmask_rows(scores.shape[0])
        rows = []
        for first, rid, out, drafts in drafting:
            matcher = self._synced(rid, out, len(out)).matcher
            matcher.fill_next_token_bitmask(bitmask, first)
            for j, token in enumerate(drafts):
                if not matcher.accept_token(token):
                    matcher.rollback(j)
                    raise GrammarViolation(f"draft token {token} is not allowed by the request's grammar")
                matcher.fill_next_token_bitmask(bitmask, first + j + 1)
            if drafts:
                matcher.rollback(len(drafts))
            rows.extend(range(first, first + len(drafts) + 1))
        self._apply(scores, bitmask, rows)

    # --- helpers -----------------------------------------------------------------------------------
    def _synced(self, request_id: int, output_token_ids: Sequence[int], n: int) -> _Entry:
        """The request's matcher having accepted exactly the first ``n`` of ``output_token_ids``:
        the kept one, or one rebuilt from those tokens (new request, or found out of step)."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.num_accepted == n:
            return entry
        compiled = self._compiled[request_id].result()  # done: admission waited for it
        xgr = import_xgrammar()
        stops = self._stop_tokens.get(request_id)  # None: the tokenizer's own stop tokens
        no_stop = not stops and not list(compiled.tokenizer_info.stop_token_ids)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops, terminate_without_stop_token=no_stop)
        for token in output_token_ids[:n]:
            if not matcher.accept_token(token):
                raise GrammarViolation(f"token {token} of the request's output is not allowed by its grammar")
        entry = self._entries[request_id] = _Entry(matcher, n)
        return entry

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        """The reused ``[>= num_rows, ceil(vocab / 32)]`` int32 CPU bitmask buffer."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = import_xgrammar().allocate_token_bitmask(max(num_rows, 64), self.compilation.vocab_size)
        return self._bitmask

    def _apply(self, scores: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        bits = bitmask[: scores.shape[0]]
        vocab = min(scores.shape[-1], bits.shape[-1] * 32)
        if self._kernel.apply(scores, bits, rows, vocab):
            return
        if bits.device != scores.device:
            bits = bits.to(scores.device, non_blocking=True)
        import_xgrammar().apply_token_bitmask_inplace(scores, bits, vocab_size=vocab, indices=rows)
