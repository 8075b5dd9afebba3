"""Per-request generation settings as ``model.generate`` builds them: logits processors, stopping
criteria, which settings stay unsupported (and why), and the batched fast path for the warpers.

Each request gets the ``LogitsProcessorList`` transformers' own ``GenerationMixin._get_logits_processor``
builds from its resolved ``GenerationConfig`` (prepared for its prompt as ``generate`` prepares it:
special-token tensors, ``max_length``/``min_length`` from the prompt length) plus the call's
``logits_processor`` / ``prefix_allowed_tokens_fn``. So every processor setting behaves as under
``generate``, in the same order. The sampler applies such a list to the request's own ``[1, seq]``
history; requests whose list holds only temperature / top-k / top-p (or nothing) skip the history
and are warped batched (``warp_batched``), bit for bit as transformers' warpers.
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Callable, Optional, Sequence

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList

from .per_request_processors import PerRequestProcessors, is_processor_factory

# Settings whose non-neutral values hf_contbatch rejects: (neutral values, reason, alternative).
UNSUPPORTED_GENERATION = {
    "num_beams": (
        (None, 1),
        "beam search keeps several hypotheses per request and reorders their KV every step",
        "do_sample=True with num_return_sequences=N, or transformers' generate",
    ),
    "num_beam_groups": (
        (None, 1),
        "diverse (group) beam search is beam search",
        "do_sample=True with num_return_sequences=N, or transformers' generate",
    ),
    "diversity_penalty": (
        (None, 0.0),
        "it only applies to group beam search",
        "do_sample=True with num_return_sequences=N, or transformers' generate",
    ),
    "constraints": (
        (None, []),
        "constrained beam search is beam search",
        "prefix_allowed_tokens_fn or a custom logits_processor, or transformers' generate",
    ),
    "force_words_ids": (
        (None, []),
        "constrained beam search is beam search",
        "prefix_allowed_tokens_fn or a custom logits_processor, or transformers' generate",
    ),
    "penalty_alpha": (
        (None,),
        "contrastive search needs every candidate's hidden states each step",
        "repetition_penalty / no_repeat_ngram_size, or transformers' generate",
    ),
    "dola_layers": (
        (None,),
        "DoLa contrasts early-exit layer logits the engine does not compute",
        "transformers' generate",
    ),
    "guidance_scale": (
        (None, 1.0),
        "classifier-free guidance runs a second, unconditional forward per step on the model's own cache",
        "transformers' generate",
    ),
    "token_healing": (
        (None, False),
        "token healing rewrites the prompt with a constrained generate call",
        "transformers' generate",
    ),
    "use_mtp": ((None, False), "multi-token prediction heads are not run by the engine", "plain decoding"),
    "output_logits": (
        (None, False),
        "raw logits per step are not recorded",
        "output_scores=True (log-probs of the processed scores) or logprobs=N",
    ),
    "output_attentions": ((None, False), "the paged attention computes no attention weights", "transformers' generate"),
    "output_hidden_states": ((None, False), "hidden states are not kept", "transformers' generate"),
}

# Settings applied through transformers' logits processors / stopping criteria (README table).
PROCESSOR_SETTINGS = (
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "sequence_bias",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "top_h",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "watermarking_config",
    "renormalize_logits",
    "max_time",
    "output_scores",
    "return_dict_in_generate",
)

_FAST_TYPES = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)


def check_supported(cfg: GenerationConfig, source: Callable[[str], str]) -> None:
    """Raise for a setting hf_contbatch does not run.

    Args:
        cfg: the resolved generation config.
        source: ``name -> "this call" / "the model's generation_config"`` for the message.

    Raises:
        ValueError: naming the setting, its value, where it came from, why, and what to use instead.
    """
    for name, (neutral, reason, alternative) in UNSUPPORTED_GENERATION.items():
        value = getattr(cfg, name, None)
        if value not in neutral:
            raise ValueError(
                f"generation setting `{name}`={value!r} (from {source(name)}) is not supported by hf_contbatch: "
                f"{reason}; use {alternative}"
            )


def logits_device(model) -> torch.device:
    """Where the model's logits come out (the LM head's device; the input embeddings' may differ
    under a ``device_map``): the device processors and token histories live on."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.device
    return next(model.parameters()).device


def prepare_generation_config(model, cfg: GenerationConfig, device: Optional[torch.device] = None) -> GenerationConfig:
    """A copy of ``cfg`` with the special-token tensors ``generate`` adds (``_eos_token_tensor``...),
    ready for ``build_logits_processor``; prepare once per call, build once per prompt."""
    cfg = copy.deepcopy(cfg)
    model._prepare_special_tokens(
        cfg, kwargs_has_attention_mask=True, device=device or torch.device("cpu"), batch_size=1
    )
    return cfg


def build_logits_processor(
    model,
    prepared: GenerationConfig,
    prompt_token_ids: Sequence[int],
    max_new_tokens: int,
    *,
    logits_processor: Optional[LogitsProcessorList] = None,
    prefix_allowed_tokens_fn: Optional[Callable[[int, torch.Tensor], list]] = None,
    device: Optional[torch.device] = None,
) -> LogitsProcessorList:
    """The ``LogitsProcessorList`` ``model.generate`` builds for this prompt (one sequence, no padding).

    Sets ``max_length = len(prompt) + max_new_tokens`` and ``min_length`` from ``min_new_tokens``
    on ``prepared`` as ``generate`` does for a ``[1, len(prompt)]`` input (the processors copy
    these values when built, so one prepared config serves every prompt of a call), then calls
    transformers' ``GenerationMixin._get_logits_processor`` with the call's custom processors,
    so the list and its order are transformers' own.

    Args:
        model: the transformers model (a ``GenerationMixin``).
        prepared: the request's resolved config from ``prepare_generation_config``.
        prompt_token_ids: the prompt as fed to the model.
        max_new_tokens: the request's resolved ``max_new_tokens``.
        logits_processor: custom processors merged as ``generate`` merges them.
        prefix_allowed_tokens_fn: as in ``generate`` (called with batch id 0 and the ``[seq]`` ids).
        device: where the processors' tensors live (the logits' device).

    Raises:
        ValueError/TypeError: from transformers, for malformed settings (e.g. ``bad_words_ids``).
    """
    n = len(prompt_token_ids)
    device = device if device is not None else torch.device("cpu")
    cfg = copy.copy(prepared)  # shallow: the lengths below are per prompt
    cfg.max_length = n + max_new_tokens
    if cfg.min_new_tokens is not None:
        cfg.min_length = cfg.min_new_tokens + n
    prompt = torch.tensor([list(prompt_token_ids)], dtype=torch.long, device=device)
    return model._get_logits_processor(
        generation_config=cfg,
        input_ids_seq_length=n,
        encoder_input_ids=prompt,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=device,
        model_kwargs={},
    )


def build_stopping_criteria(
    cfg: GenerationConfig, stopping_criteria: Optional[StoppingCriteriaList]
) -> Optional[StoppingCriteriaList]:
    """The criteria the engine evaluates per request beyond EOS, ``max_new_tokens`` and stop strings
    (which it handles itself): ``max_time`` (from now) and the call's ``stopping_criteria``.
    None when there are none."""
    criteria = StoppingCriteriaList()
    if cfg.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=cfg.max_time, initial_timestamp=time.time()))
    if stopping_criteria:
        criteria.extend(stopping_criteria)
    return criteria or None


def fast_warp_params(procs: LogitsProcessorList) -> Optional[tuple]:
    """``(temperature, top_k, top_p)`` when ``procs`` is only transformers' temperature / top-k /
    top-p warpers in ``generate``'s order (each at most once, ``min_tokens_to_keep=1``), so the
    sampler may apply them batched without the request's history; None otherwise (None entries
    in the tuple: that warper is absent)."""
    temperature = top_k = top_p = None
    rank = -1
    for p in procs:
        t = type(p)
        if t not in _FAST_TYPES:
            return None
        r = _FAST_TYPES.index(t)
        if r <= rank:
            return None
        rank = r
        if t is TemperatureLogitsWarper:
            temperature = float(p.temperature)
        elif p.filter_value != -float("inf") or p.min_tokens_to_keep != 1:
            return None
        elif t is TopKLogitsWarper:
            top_k = int(p.top_k)
        else:
            top_p = float(p.top_p)
    return temperature, top_k, top_p


def split_fast_suffix(procs: LogitsProcessorList) -> tuple[LogitsProcessorList, Optional[tuple]]:
    """Split ``procs`` into the processors that need the request's history (run per request) and
    a trailing run of temperature / top-k / top-p warpers that ``warp_batched`` may apply with
    other requests' rows (``fast_warp_params`` of it; None when there is none). Applying the two
    parts one after the other is applying the list."""
    for start in range(len(procs) + 1):
        tail = LogitsProcessorList(procs[start:])
        params = fast_warp_params(tail)
        if params is not None:
            if not tail:
                return LogitsProcessorList(procs), None
            return LogitsProcessorList(procs[:start]), params
    return LogitsProcessorList(procs), None  # unreachable: the empty tail always qualifies


def warp_batched(scores: torch.Tensor, params: Sequence[tuple]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Apply per-row temperature, top-k and top-p in one pass per warper, with exactly the
    arithmetic of transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
    ``TopPLogitsWarper`` (so each row equals the row warped alone, bit for bit).

    When every row has a top-k, the work is O(k) per row after one ``torch.topk``
    (``_warp_top_k_rows``); otherwise each warper runs over the whole ``[N, vocab]``.

    Args:
        scores: ``[N, vocab]`` float scores (not modified).
        params: N tuples from ``fast_warp_params``.
    Returns:
        ``[N, vocab]`` warped scores, and ``[N, max k]`` indices holding every row's finite
        scores (extra columns of rows with a smaller k point at ``-inf`` scores) when the top-k
        route ran, else None.
    """
    if all(k is not None for _, k, _ in params):
        out = _warp_top_k_rows(scores, params)
        if out is not None:
            return out
    dev = scores.device
    inf = float("inf")
    temps = [t for t, _, _ in params]
    if any(t is not None for t in temps):
        # Division by 1.0 is exact, so rows without a temperature are unchanged.
        div = torch.tensor([1.0 if t is None else t for t in temps], dtype=scores.dtype, device=dev)
        scores = scores / div[:, None]
    ks = [k for _, k, _ in params]
    if any(k is not None for k in ks):
        vocab = scores.size(-1)
        kk = [min(k, vocab) if k is not None else 1 for k in ks]
        kth = torch.topk(scores, max(kk))[0].gather(1, torch.tensor(kk, device=dev)[:, None] - 1)
        kth = torch.where(torch.tensor([k is None for k in ks], device=dev)[:, None], -inf, kth)
        scores = scores.masked_fill(scores < kth, -inf)
    ps = [p for _, _, p in params]
    if any(p is not None for p in ps):
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative_probs <= _top_p_limits(ps, scores)
        remove[..., -1:] = 0
        remove = remove.scatter(1, sorted_indices, remove)
        scores = scores.masked_fill(remove, -inf)
    return scores, None


def _top_p_limits(ps: Sequence[Optional[float]], like: torch.Tensor) -> torch.Tensor:
    """``[N, 1]`` thresholds: transformers compares with the Python float ``1 - top_p`` (rounded
    once to the scores' dtype); -1 removes nothing for rows without top_p."""
    limit = torch.tensor([-1.0 if p is None else 1 - p for p in ps], dtype=torch.float64).to(like.dtype)
    return limit.to(like.device)[:, None]


# Lanes of the widest vectorised reduction torch's CPU softmax uses (AVX-512 x 4 unrolled = 64
# floats); 256 leaves margin. Rows shortened by a multiple of it keep their tail's lane layout.
_REDUCTION_ALIGN = 256


def _warp_top_k_rows(scores: torch.Tensor, params: Sequence[tuple]) -> Optional[tuple]:
    """``warp_batched`` for rows that all have a top-k, in O(k) per row after one ``topk``.

    The top-k values of ``scores / t`` are the top-k values of ``scores``, divided (the same
    elementwise division transformers applies to the whole row). Transformers' top-p sorts the
    row: ``-inf`` repeated, then the top k ascending, so its softmax and cumulative sum are computed
    from the top-k values, on a row shortened by a multiple of ``_REDUCTION_ALIGN`` leading
    ``-inf`` (zeros in the sums, same vector lanes, so the same bits). Returns None (use the
    general route) when a row has a tie at its k-th value, where transformers keeps more than k.
    """
    dev = scores.device
    inf = float("inf")
    n, vocab = scores.shape
    kk = [min(k, vocab) for _, k, _ in params]
    kmax = max(kk)
    probe = min(kmax + 1, vocab)
    vals, idx = torch.topk(scores, probe)
    temps = [t for t, _, _ in params]
    if any(t is not None for t in temps):
        div = torch.tensor([1.0 if t is None else t for t in temps], dtype=scores.dtype, device=dev)
        vals = vals / div[:, None]
    kk_t = torch.tensor(kk, device=dev)
    has_next = kk_t < probe
    kth = vals.gather(1, kk_t[:, None] - 1)[:, 0]
    after = vals.gather(1, torch.clamp(kk_t, max=probe - 1)[:, None])[:, 0]
    if bool((has_next & (after == kth)).any()):
        return None
    vals, idx = vals[:, :kmax], idx[:, :kmax]
    vals = vals.masked_fill(torch.arange(kmax, device=dev)[None, :] >= kk_t[:, None], -inf)
    ps = [p for _, _, p in params]
    if any(p is not None for p in ps):
        length = vocab - (vocab - kmax) // _REDUCTION_ALIGN * _REDUCTION_ALIGN
        sorted_logits = torch.full((n, length), -inf, dtype=scores.dtype, device=dev)
        sorted_logits[:, -kmax:] = vals.flip(-1)
        # the leading zeros of the cumulative sum add nothing: summing the tail alone is exact
        cumulative_tail = sorted_logits.softmax(dim=-1)[:, -kmax:].cumsum(dim=-1)
        remove_tail = cumulative_tail <= _top_p_limits(ps, scores)
        remove_tail[..., -1:] = 0
        vals = vals.masked_fill(remove_tail.flip(-1), -inf)
    out = torch.full_like(scores, -inf).scatter_(1, idx, vals)
    return out, idx


class TokenHistory:
    """A request's token ids as a ``[1, seq]`` LongTensor for its processors, grown in place
    (preallocated for prompt + ``max_new_tokens``; no concatenation per step)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self._buf = torch.empty(1, max(capacity, 1), dtype=torch.long, device=device)
        self._n = 0

    def view(self, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
        """``[1, len(prompt) + len(output)]`` ids; only tokens added since the last call are copied."""
        total = len(prompt) + len(output)
        if total > self._buf.shape[1]:
            grown = torch.empty(1, max(total, 2 * self._buf.shape[1]), dtype=torch.long, device=self._buf.device)
            grown[:, : self._n] = self._buf[:, : self._n]
            self._buf = grown
        if self._n < total:
            new = list(prompt[self._n :]) + list(output[max(0, self._n - len(prompt)) :])
            self._buf[0, self._n : total] = torch.tensor(new, dtype=torch.long)
            self._n = total
        return self._buf[:, :total]


def with_processors(
    model,
    cfg: GenerationConfig,
    sampling,
    prompt_token_ids: Sequence[int],
    *,
    logits_processor: Optional[LogitsProcessorList] = None,
    prefix_allowed_tokens_fn: Optional[Callable] = None,
    stopping_criteria: Optional[StoppingCriteriaList] = None,
    logprobs: Optional[int] = None,
    device: Optional[torch.device] = None,
    grammar_mask: bool = False,
):
    """``sampling`` (a ``SamplingParams``) with the request's transformers-built processors and
    stopping criteria attached, and ``logprobs`` (``output_scores=True`` means 0) set.
    ``cfg``: a config from ``prepare_generation_config`` (or a resolved one, prepared here).
    ``logits_processor`` may be a list (shared by every request and fork of the call, as one list
    given to ``generate`` is shared by its batch rows) or a zero-argument factory returning one
    (``PerRequestProcessors``: called once per request and fork). ``grammar_mask``: the request
    has structured outputs; its mask goes where ``generate`` runs a custom processor
    (``structured.GrammarMaskSlot``).

    Raises:
        ValueError: a malformed argument, naming it.
    """
    import dataclasses

    from .structured import GrammarMaskSlot

    factory = logits_processor if is_processor_factory(logits_processor) else None
    if (
        logits_processor is not None
        and factory is None
        and not (isinstance(logits_processor, (list, tuple)) and all(callable(p) for p in logits_processor))
    ):
        raise ValueError(
            "`logits_processor` must be a LogitsProcessorList (a list of callables) or a zero-argument "
            f"callable returning one (called once per request), got {logits_processor!r}"
        )
    if prefix_allowed_tokens_fn is not None and not callable(prefix_allowed_tokens_fn):
        raise ValueError(
            f"`prefix_allowed_tokens_fn` must be callable (batch_id, input_ids) -> list of ids, got {prefix_allowed_tokens_fn!r}"
        )
    if stopping_criteria is not None and not (
        isinstance(stopping_criteria, (list, tuple)) and all(callable(c) for c in stopping_criteria)
    ):
        raise ValueError(
            f"`stopping_criteria` must be a StoppingCriteriaList (a list of callables), got {stopping_criteria!r}"
        )
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise ValueError(
            f"`logprobs` must be an int >= 0 (0: the chosen token's log-prob; N: also the top N), got {logprobs!r}"
        )
    if logprobs is None and cfg.output_scores:
        logprobs = 0
    if not hasattr(cfg, "_eos_token_tensor"):  # not prepared yet (``generate`` adds it)
        cfg = prepare_generation_config(model, cfg, device)
    build = functools.partial(
        build_logits_processor,
        model,
        cfg,
        list(prompt_token_ids),
        sampling.max_new_tokens,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        device=device,
    )
    extra = [GrammarMaskSlot()] if grammar_mask else []
    if factory is not None:
        procs = PerRequestProcessors(factory, lambda custom: build(logits_processor=custom), extra)
    else:
        custom = list(logits_processor or []) + extra
        procs = build(logits_processor=LogitsProcessorList(custom) if logits_processor is not None or extra else None)
    criteria = build_stopping_criteria(cfg, StoppingCriteriaList(stopping_criteria) if stopping_criteria else None)
    return dataclasses.replace(sampling, logits_processor=procs, stopping_criteria=criteria, logprobs=logprobs)
