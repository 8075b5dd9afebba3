"""Building engine requests: the one place a prompt and its sampling parameters are validated.

``RequestFactory.build`` turns a prompt's token ids and ``SamplingParams`` into a ``Request`` (with
the pending forks of its extra sequences), or raises ``ValueError`` for anything that would fail
later: inside a step, where the error would reach every request batched with the bad one, or in
the queue, where a request that can never fit would wait forever. Building queues nothing, so a
caller can build every request of a call before queueing any (``LLMEngine.enqueue``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional, Sequence

from ..config import is_int
from ..core.block_manager import BlockManager
from ..request import Request, RequestIdCounter, SamplingParams
from .lora_adapters import LoraAdapters, resolve_without_adapters
from .reliability import check_request
from .structured import GrammarCompilation, GrammarSpec


class RequestFactory:
    """Validated requests for one engine.

    Args:
        vocab_size: rows of the model's input embedding (prompt ids must be in ``[0, vocab_size)``).
        max_model_len: the model's context in tokens; None when the config sets none.
        block_manager: the device pool's bookkeeping (its size bounds a request's KV).
        prompt_lookup_num_tokens: the engine's default for requests that do not set it
            (``EngineConfig.prompt_lookup_num_tokens``).
        adapters: the LoRA adapters of a served ``peft.PeftModel`` (None for a plain model); a
            request's ``SamplingParams.adapter_name`` is resolved against them.
        grammars: the engine's grammar compilation (``SamplingParams.structured_outputs``); None:
            requests with structured outputs are refused.
        kv_variant: the sequence length (tokens) -> what besides the tokens changes its blocks' K
            (``Request.kv_variant``; a LongRoPE model's ``RotaryVariants.prefix_key``); None: nothing.
            A request whose variant changes while it generates cannot use prompt-lookup drafts.
        whole_prefill_tokens: for a model with recurrent layers, the most prompt tokens one step
            prefills (``max_num_batched_tokens``): a longer prompt, or prompt-lookup drafts, are
            refused. None: any prompt (chunked prefill).
        whole_prefill_why: what prefills prompts whole, for the refusal's message (a model with
            cross-token routers, ``engine.cross_token_routers``, also needs whole prompts but serves
            drafts: ``drafts_served``).
        drafts_served: whether prompt-lookup drafts are served under ``whole_prefill_tokens``.
    """

    def __init__(
        self,
        vocab_size: int,
        max_model_len: Optional[int],
        block_manager: BlockManager,
        prompt_lookup_num_tokens: Optional[int] = None,
        adapters: Optional[LoraAdapters] = None,
        grammars: Optional[GrammarCompilation] = None,
        kv_variant: Optional[Callable[[int], Optional[str]]] = None,
        whole_prefill_tokens: Optional[int] = None,
        whole_prefill_why: str = "a model with a state per request (recurrent layers, or layers keeping their own cache)",
        drafts_served: bool = False,
    ) -> None:
        self.vocab_size = vocab_size
        self.whole_prefill_tokens = whole_prefill_tokens
        self.whole_prefill_why = whole_prefill_why
        self.drafts_served = drafts_served
        self.max_model_len = max_model_len
        self.num_blocks = block_manager.num_blocks
        self.block_size = block_manager.block_size
        # Under a sliding window a request alone in the pool runs however long it is, one step of at
        # most this many tokens at a time (None: full attention, or a pool smaller than one window).
        self._window_step_tokens = block_manager.max_tokens_per_step
        self._sliding_window = block_manager.sliding_window
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.adapters = adapters
        self.grammars = grammars
        self.kv_variant = kv_variant
        self._ids = RequestIdCounter()
        self._parsed_grammars: dict = {}  # GrammarSpec.key -> the library's parsed grammar (bounded)
        self._parse_lock = threading.Lock()  # submit may come from several threads

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole device pool holds (blocks x block size)."""
        return self.num_blocks * self.block_size

    def build(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        stop_checker: Optional[Callable[[Request], bool]] = None,
        num_return_sequences: Optional[int] = None,
    ) -> Request:
        """A new request (and, for ``num_return_sequences=n > 1``, its ``n - 1`` pending forks).

        Arguments as ``LLMEngine.submit``. The ``n`` sequences share the prompt's KV: the first one
        prefills it, the others are forked off it before the last prompt token (full blocks shared
        by ref count, the partial block copied), so each samples its own first token. With
        ``sampling.seed`` set, sequence ``k`` uses seed ``seed + k``. A fork that finds no room
        degrades to independent requests (they recompute the prompt, or hit the prefix cache).
        ``sampling.adapter_name`` is resolved here (``LoraAdapters.resolve``): the built request
        names the adapter that runs, or None for the base model.
        ``sampling.structured_outputs`` is checked and parsed here (``structured.GrammarSpec``);
        compiling it waits for the engine's worker thread.

        Raises:
            ValueError: as ``LLMEngine.submit`` documents; nothing is built then.
            ImportError: structured outputs without xgrammar installed (the message names the extra).
        """
        num_sequences = 1 if num_return_sequences is None else num_return_sequences
        if not is_int(num_sequences) or num_sequences < 1:
            raise ValueError(f"`num_return_sequences` must be an int >= 1 or None, got {num_return_sequences!r}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        if not all(is_int(t) for t in ids):
            raise ValueError("`prompt_token_ids` must be a sequence of ints")
        if not is_int(priority):
            raise ValueError(f"`priority` must be an int (lower runs first), got {priority!r}")
        if sampling.prompt_lookup_num_tokens is None and self.prompt_lookup_num_tokens:
            sampling = dataclasses.replace(sampling, prompt_lookup_num_tokens=self.prompt_lookup_num_tokens)
        if self.adapters is None:
            resolve_without_adapters(sampling.adapter_name)
            adapter = None
        else:
            adapter = self.adapters.resolve(sampling.adapter_name)
        if adapter != sampling.adapter_name:  # the adapter that runs, fixed now (None: the base model)
            sampling = dataclasses.replace(sampling, adapter_name=adapter)
        check_request(ids, sampling, self.vocab_size)
        if sampling.structured_outputs is not None:
            # Parsed on every submit (the caller may have changed the dict in place); the library's
            # parse, the slow part, is cached by the canonical schema text.
            with self._parse_lock:
                spec = GrammarSpec.parse(sampling.structured_outputs, self._parsed_grammars)
            if self.grammars is None:
                raise ValueError("`structured_outputs` is not available in this engine")
            self.grammars.check_ready_for(spec)
            sampling = dataclasses.replace(sampling, structured_outputs=spec)
        self._check_fits(len(ids), sampling)
        if self.whole_prefill_tokens is not None:
            self._check_whole_prefill(len(ids), sampling)
        variant = None if self.kv_variant is None else self.kv_variant(len(ids))
        if (
            self.kv_variant is not None
            and sampling.prompt_lookup_num_tokens
            and variant != self.kv_variant(len(ids) + sampling.max_new_tokens)
        ):
            # Draft rows past the switch would be verified with the K of before it (the engine
            # recomputes the K only after a step's tokens are appended).
            raise ValueError(
                "prompt-lookup drafts (`prompt_lookup_num_tokens`) cannot serve a request that crosses its model's "
                "rope_type 'longrope' switch to the long factors; set prompt_lookup_num_tokens=0 for it"
            )
        req = Request(
            request_id=self._ids(),
            prompt_token_ids=ids,
            sampling=sampling,
            priority=priority,
            stop_checker=stop_checker,
            max_total_tokens=self.max_model_len,
            kv_variant=variant,
        )
        for k in range(1, num_sequences):
            sampling_k = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + k)
            req.pending_forks.append(
                Request(
                    request_id=self._ids(),
                    prompt_token_ids=list(ids),
                    sampling=sampling_k,
                    priority=priority,
                    arrival_time=req.arrival_time,
                    stop_checker=stop_checker,
                    max_total_tokens=self.max_model_len,
                    kv_variant=variant,
                    parent_id=req.request_id,
                )
            )
        return req

    def _check_whole_prefill(self, n: int, sampling: SamplingParams) -> None:
        """Raise ``ValueError`` for what a model with recurrent layers cannot serve: a prompt longer
        than one step prefills (its state is built by one forward over the whole prompt), or drafts
        (unless ``drafts_served``: a model with cross-token routers)."""
        if n > self.whole_prefill_tokens:
            raise ValueError(
                f"prompt of {n} tokens exceeds max_num_batched_tokens={self.whole_prefill_tokens}: "
                f"{self.whole_prefill_why} prefills a prompt in one step (no chunked prefill); raise "
                "max_num_batched_tokens"
            )
        if sampling.prompt_lookup_num_tokens and not self.drafts_served:
            raise ValueError(
                "prompt-lookup drafts (prompt_lookup_num_tokens) are not served for a model with a state per request "
                "(recurrent layers, or layers keeping their own cache: a rejected draft would need it rolled back)"
            )

    def _check_fits(self, n: int, sampling: SamplingParams) -> None:
        """Raise ``ValueError`` for an ``n``-token prompt that can never run: prompt + 1 token
        beyond the model's context, or prompt + ``max_new_tokens`` beyond the whole KV pool (under a
        sliding window only when the pool cannot hold one window and a token: a request then needs
        at most its window's blocks, see ``BlockManager.max_tokens_per_step``)."""
        # A one-token scoring request (prompt log-probs) never feeds its sampled token, so its prompt
        # may fill the whole context (lm-eval scores windows of exactly the model's length).
        scoring = bool(sampling.prompt_logprobs) and sampling.max_new_tokens == 1
        if self.max_model_len is not None and n + (0 if scoring else 1) > self.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens + 1 new token exceeds the model's context of {self.max_model_len} tokens"
            )
        worst = n + sampling.max_new_tokens
        if self.max_model_len is not None:
            worst = min(worst, self.max_model_len)
        if worst > self.capacity_tokens and self._window_step_tokens is None:
            window = ""
            if self._sliding_window is not None:
                # A one-token step reads the W - 1 positions before it: they and it span at most
                # ceil((W - 1) / block_size) + 1 blocks (``BlockManager.max_tokens_per_step`` with n = 1).
                need = -(-(self._sliding_window - 1) // self.block_size) + 1
                window = f", and its window of {self._sliding_window} tokens and a step need {need} blocks"
            raise ValueError(
                f"request needs up to {worst} tokens of KV (prompt {n} + max_new_tokens {sampling.max_new_tokens}) "
                f"but the whole pool holds {self.capacity_tokens} tokens ({self.num_blocks} blocks "
                f"of {self.block_size}){window}; lower max_new_tokens or enlarge the cache"
            )
