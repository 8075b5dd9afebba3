"""Builds one flattened, unpadded batch from a ``StepPlan``, runs the model, samples.

All requests' new tokens are concatenated into a single ``[1, T]`` sequence (decode tokens first,
then requests verifying drafts, then prefill chunks); the paged attention keeps them apart through
the step's metadata, so there is no padding and no dense mask. Only the rows whose logits are used
reach the LM head (``logits_to_keep`` as an index tensor); ``StepInputs`` documents the layout.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Optional

import torch

from ..core.block_manager import BlockManager
from ..core.plan import StepPlan
from ..kernels.lora import AdapterRows
from ..kernels.paged_cache import AttentionMetadata, PagedKVCache
from ..request import Request
from .sampler import Sampler


@dataclass
class StepInputs:
    """The flattened forward of one step, and which of its rows reach the LM head.

    Row layout: the batch is one ``[1, T]`` sequence with a row per token the step computes, request
    by request in the plan's order: decodes (one row each, the last token), then requests verifying
    drafts (``1 + m`` rows each: the last token, then its ``m`` drafts), then prefill chunks (``n``
    rows each, the chunk's tokens). The LM head reads ``logits_rows``: ``sample_rows``, then
    ``score_rows``, then ``draft_rows``, and its logits come back in that order.

    Attributes:
        input_ids: ``[T]`` int64 token ids.
        positions: ``[T]`` int64 positions.
        metadata: the attention metadata; a request verifying ``m`` drafts enters it as ``1 + m``
            decodes of the same block table with growing lengths, so each row attends to its own
            prefix and the rows are served with the step's other decodes.
        sample_rows: the last row of each request that samples a token this step (requests
            verifying drafts excepted), in plan order.
        score_rows: each row whose next prompt token is scored (``SamplingParams.prompt_logprobs``),
            in plan order.
        score_targets: per score row, ``(request, prompt position scored, that prompt token id)``.
        draft_rows: the ``1 + m`` rows of each request verifying drafts, in plan order.
        adapter_rows: which rows run which LoRA adapter (None when the model has no LoRA layers).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: list[int]
    score_rows: list[int]
    score_targets: list[tuple[Request, int, int]]
    draft_rows: list[int]
    adapter_rows: Optional[AdapterRows] = None

    @property
    def logits_rows(self) -> list[int]:
        """The rows the LM head reads, in the order its logits come back."""
        return self.sample_rows + self.score_rows + self.draft_rows


class ModelRunner:
    """Runs the model for one scheduler step.

    Args:
        model: a transformers causal LM already switched to the paged attention implementation.
        cache: the paged KV cache passed to the forward.
        block_manager: read for block tables (never modified here).
        device: device of the input embeddings.
        sampler: the sampler.
    """

    def __init__(
        self, model, cache: PagedKVCache, block_manager: BlockManager, device: torch.device, sampler: Sampler
    ) -> None:
        self.model = model
        self.cache = cache
        self.block_manager = block_manager
        self.device = device
        self.sampler = sampler
        # The model's packed linears (hf_contbatch.kernels.cpu_linear.PackedLinears), checked once per step
        # instead of per call; set by the engine for eager forwards (a compiled one refreshes them).
        self.packed_linears = None
        # The model's per-row LoRA forwards (hf_contbatch.kernels.lora.LoraLayers), set by the engine.
        self.lora_layers = None
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._supports_logits_to_keep = "logits_to_keep" in params
        self.block_size = block_manager.block_size

    def build_metadata(self, plan: StepPlan) -> StepInputs:
        """The flattened inputs of ``plan``'s forward, its attention metadata and the rows the LM
        head reads (see ``StepInputs`` for the row layout)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        draft_rows: list[int] = []
        num_decodes = 0
        num_tokens = 0
        # Positions and slots are plain Python ints (a step's few hundred at most): cheaper than
        # building them with tensor ops (repeat_interleave, arange, gathers).
        for s in plan.scheduled:  # decodes first (the scheduler's order)
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            table = self.block_manager.get_block_table(req.request_id)
            if s.draft_token_ids:  # right after the decodes (the scheduler's order)
                input_ids.append(req.output_token_ids[-1])
                input_ids.extend(s.draft_token_ids)
                for i in range(n):
                    p = start + i
                    positions.append(p)
                    slots.append(table[p // bs] * bs + p % bs)
                    q_lens.append(1)
                    seq_lens.append(p + 1)
                    tables.append(table)
                    draft_rows.append(num_tokens + i)
                num_decodes += n
                num_tokens += n
                continue
            if s.is_decode:
                num_decodes += 1
                input_ids.append(req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(req.all_token_ids[start : start + n])
                end = start + n
                positions.extend(range(start, end))
                for b in range(start // bs, (end - 1) // bs + 1):  # the slots of each block touched
                    base = table[b] * bs - b * bs
                    slots.extend(range(base + max(start, b * bs), base + min(end, (b + 1) * bs)))
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            num_tokens += n
            if s.samples:
                sample_rows.append(num_tokens - 1)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        block_tables = torch.tensor(padded, dtype=torch.int32)
        query_start_loc_cpu = [0]
        for n in q_lens:
            query_start_loc_cpu.append(query_start_loc_cpu[-1] + n)
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        dev = self.device
        meta = self.cache.backend.build_metadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens,
            num_decodes=num_decodes,
            block_size=bs,
            num_kv_heads=self.cache.num_kv_heads,
            device=dev,
        )
        score_rows, score_targets = self._prompt_logprob_rows(plan)
        adapter_rows = None
        if self.lora_layers is not None:
            adapter_rows = AdapterRows.build(
                [(s.request.sampling.adapter_name, s.num_new_tokens) for s in plan.scheduled],
                sample_rows + score_rows + draft_rows if self._supports_logits_to_keep else None,
                dev,
            )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            metadata=meta,
            sample_rows=sample_rows,
            score_rows=score_rows,
            score_targets=score_targets,
            draft_rows=draft_rows,
            adapter_rows=adapter_rows,
        )

    def _linears_step(self):
        return contextlib.nullcontext() if self.packed_linears is None else self.packed_linears.verified_step()

    def _lora_step(self, inputs: StepInputs):
        return contextlib.nullcontext() if inputs.adapter_rows is None else self.lora_layers.step(inputs.adapter_rows)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run the step's forward and return ``{request_id: sampled token}`` for sampling requests,
        and ``{request_id: [greedy token per row]}`` for requests verifying drafts."""
        if plan.is_empty:
            return {}
        inputs = self.build_metadata(plan)
        step = self.cache.for_step(inputs.metadata)  # the step's metadata travels with the view, not on the cache
        kwargs = {
            "input_ids": inputs.input_ids.unsqueeze(0),
            "position_ids": inputs.positions.unsqueeze(0),
            self._cache_arg: step,
            "use_cache": True,
            "paged_cache": step,
        }
        rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=self.device)
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        with self._linears_step(), self._lora_step(inputs):
            logits = self.model(**kwargs).logits[0]
        if not self._supports_logits_to_keep:
            logits = logits.index_select(0, rows)
        result: dict = {}
        num_sample_rows, num_score_rows = len(inputs.sample_rows), len(inputs.score_rows)
        if inputs.draft_rows:
            # Drafting requests are greedy (SamplingParams.can_draft): the argmax of every row, under
            # the request's grammar where it has one.
            greedy = self.sampler.verify_drafts(logits[num_sample_rows + num_score_rows :], plan.drafting)
            logits = logits[: num_sample_rows + num_score_rows]
            at = 0
            for s in plan.drafting:
                result[s.request.request_id] = greedy[at : at + s.num_new_tokens]
                at += s.num_new_tokens
        sampled_reqs = [s.request for s in plan.scheduled if s.samples and not s.draft_token_ids]
        if num_score_rows or any(r.sampling.score_token_id is not None for r in sampled_reqs):
            self._record_prompt_logprobs(logits, sampled_reqs, inputs.score_targets)
            logits = logits[:num_sample_rows]
        tokens = self.sampler.sample(logits, sampled_reqs)
        result.update((r.request_id, t) for r, t in zip(sampled_reqs, tokens))
        return result

    # --- prompt log-probs (SamplingParams.prompt_logprobs; lm-eval scoring) ----------------------
    def _prompt_logprob_rows(self, plan: StepPlan) -> tuple[list[int], list[tuple[Request, int, int]]]:
        """Extra LM-head rows for requests scoring their prompt: the flattened row of each position
        ``p`` this step computes whose next prompt token ``p + 1`` is requested, with that target."""
        rows: list[int] = []
        targets: list[tuple[Request, int, int]] = []
        offset = 0
        for s in plan.scheduled:
            req, n = s.request, s.num_new_tokens
            k = int(req.sampling.prompt_logprobs)
            if k:
                start = req.num_computed_tokens
                # position p predicts prompt token p + 1, for p + 1 in [k, num_prompt_tokens)
                for p in range(max(start, k - 1), min(start + n, req.num_prompt_tokens - 1)):
                    rows.append(offset + p - start)
                    targets.append((req, p + 1, req.prompt_token_ids[p + 1]))
            offset += n
        return rows, targets

    @staticmethod
    def _record_prompt_logprobs(logits: torch.Tensor, sampled_reqs, score_targets) -> None:
        """Store (log-prob, is_argmax) per scored position in ``Request.prompt_logprobs``; rows after
        the sampling rows are the prompt rows, and a sampling row scores ``score_token_id``."""
        # A sampling row of a request with no output yet is its prompt's last row.
        targets = [
            (req, req.num_prompt_tokens, req.sampling.score_token_id, i)
            for i, req in enumerate(sampled_reqs)
            if req.sampling.score_token_id is not None and not req.output_token_ids
        ]
        n_sample = len(sampled_reqs)
        targets += [(req, t, tok, n_sample + j) for j, (req, t, tok) in enumerate(score_targets)]
        if not targets:
            return
        idx = torch.tensor([row for *_, row in targets], device=logits.device)
        sel = logits.index_select(0, idx).float()
        tok = torch.tensor([t for _, _, t, _ in targets], device=logits.device)
        logprobs = torch.log_softmax(sel, dim=-1).gather(1, tok[:, None])[:, 0].tolist()
        argmax_ok = (sel.argmax(dim=-1) == tok).tolist()
        for (req, t, _, _), lp, ok in zip(targets, logprobs, argmax_ok):
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * (req.num_prompt_tokens + 1)
            req.prompt_logprobs[t] = (lp, bool(ok))
