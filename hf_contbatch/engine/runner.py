"""Builds one flattened, unpadded batch from a ``StepPlan``, runs the model, samples.

All requests' new tokens are concatenated into a single ``[1, T]`` sequence (decode tokens first,
then requests verifying drafts, then prefill chunks); the paged attention keeps them apart through
the step's metadata, so there is no padding and no dense mask. Only the rows whose logits are used
reach the LM head (``logits_to_keep`` as an index tensor); ``StepInputs`` documents the layout.

The runner sees values only: the plan's rows and the per-request data it keeps in its persistent
``InputBatch`` (added and removed by the plan's diffs). No ``Request`` reaches it or the sampler.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Optional

import torch

from ..core.plan import RunnerOutput, StepPlan
from ..kernels.lora import AdapterRows
from ..kernels.paged_cache import AttentionMetadata, PagedKVCache
from .input_batch import BatchRow, InputBatch
from .input_buffers import InputBuffers
from .sampler import Sampler


@dataclass
class StepInputs:
    """The flattened forward of one step, and which of its rows reach the LM head.

    Row layout: the batch is one ``[1, T]`` sequence with a row per token the step computes, request
    by request in the plan's order: decodes (one row each, the last token), then requests verifying
    drafts (``1 + m`` rows each: the last token, then its ``m`` drafts), then prefill chunks (``n``
    rows each, the chunk's tokens). The LM head reads ``logits_rows``: ``sample_rows``, then
    ``score_rows``, then ``draft_rows``, and its logits come back in that order. The tensors are
    slices of the runner's persistent input buffers: valid until the next step's inputs are built.

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
        score_targets: per score row, ``(request id, prompt position scored, that prompt token id)``.
        draft_rows: the ``1 + m`` rows of each request verifying drafts, in plan order.
        adapter_rows: which rows run which LoRA adapter (None when the model has no LoRA layers).
        logits_index: int64 ``[len(logits_rows)]``, ``logits_rows`` on the device.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: list[int]
    score_rows: list[int]
    score_targets: list[tuple[int, int, int]]
    draft_rows: list[int]
    adapter_rows: Optional[AdapterRows] = None
    logits_index: Optional[torch.Tensor] = None

    @property
    def logits_rows(self) -> list[int]:
        """The rows the LM head reads, in the order its logits come back."""
        return self.sample_rows + self.score_rows + self.draft_rows


class ModelRunner:
    """Runs the model for one scheduler step, from the step's plan and its persistent batch (each
    row's token ids, first position and block table; each request's sampling values and adapter,
    sent once); it reads neither the block manager nor any ``Request``.

    Args:
        model: a transformers causal LM already switched to the paged attention implementation.
        cache: the paged KV cache passed to the forward.
        device: device of the input embeddings.
        sampler: the sampler.
        block_size: tokens per KV block.
        max_num_tokens: rows the persistent input buffers are first sized for
            (``max_num_batched_tokens``; they grow if a step needs more).
    """

    # Whether the model attends through the registered paged attention (the engine switches its
    # implementation to it); ``DenseContextRunner``'s models attend in their own code.
    uses_attention_interface = True

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        device: torch.device,
        sampler: Sampler,
        block_size: int,
        max_num_tokens: int = 256,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.sampler = sampler
        self.block_size = block_size
        # The model's packed linears (hf_contbatch.kernels.linears.PackedLinears), checked once per step
        # instead of per call; set by the engine for eager forwards (a compiled one refreshes them).
        self.packed_linears = None
        # The model's per-row LoRA forwards (hf_contbatch.kernels.lora.LoraLayers), set by the engine.
        self.lora_layers = None
        # Per-request rotary factors (engine.rotary_variants.RotaryVariants), set by the engine.
        self.rotary_variants = None
        # Whether the step's cache view needs each entry's prompt length (set by the engine for a
        # router mixing a forward's tokens; pools with indexer keys or per-key biases always do).
        self.needs_prompt_lens = False
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._supports_logits_to_keep = "logits_to_keep" in params
        self.buffers = InputBuffers(device, max_num_tokens, 16 * max_num_tokens)
        self.batch = InputBatch()  # the requests it runs, by id: changed by each plan's diffs

    def build_metadata(self, plan: StepPlan) -> StepInputs:
        """Apply ``plan``'s diffs to the persistent batch, then build the flattened inputs of its
        forward, its attention metadata and the rows the LM head reads (see ``StepInputs`` for the
        row layout) from the plan's rows (and each request's adapter, kept in the batch).

        Raises:
            KeyError: a row whose request never entered the batch (no ``NewRequestData``).
        """
        self.batch.apply(plan)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[tuple[int, ...]] = []
        sample_rows: list[int] = []
        draft_rows: list[int] = []
        num_decodes = 0
        num_tokens = 0
        # Positions and slots are plain Python ints (a step's few hundred at most): cheaper than
        # building them with tensor ops (repeat_interleave, arange, gathers).
        for s in plan.scheduled:  # decodes first (the scheduler's order)
            n, start, table = s.num_new_tokens, s.start_position, s.block_ids
            input_ids.extend(s.token_ids)
            if s.draft_token_ids:  # right after the decodes (the scheduler's order)
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
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
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
        query_start_loc_cpu = [0]
        for n in q_lens:
            query_start_loc_cpu.append(query_start_loc_cpu[-1] + n)
        score_rows, score_targets = self._prompt_logprob_rows(plan)
        logits_rows = sample_rows + score_rows + draft_rows
        buf = self.buffers
        buf.reserve(num_tokens, len(tables) * max_blocks)
        dev = self.device
        meta = self.cache.backend.build_metadata(
            slot_mapping=buf.fill("slot_mapping", slots),
            block_tables=buf.fill_block_tables(tables, max_blocks),
            query_start_loc=buf.fill("query_start_loc", query_start_loc_cpu),
            seq_lens=buf.fill("seq_lens", seq_lens),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens,
            num_decodes=num_decodes,
            block_size=bs,
            num_kv_heads=self.cache.num_kv_heads,
            device=dev,
        )
        adapter_rows = None
        if self.lora_layers is not None:
            rows = self.batch.rows
            adapter_rows = AdapterRows.build(
                [(rows[s.request_id].adapter_name, s.num_new_tokens) for s in plan.scheduled],
                logits_rows if self._supports_logits_to_keep else None,
                dev,
            )
        return StepInputs(
            input_ids=buf.fill("input_ids", input_ids),
            positions=buf.fill("positions", positions),
            metadata=meta,
            sample_rows=sample_rows,
            score_rows=score_rows,
            score_targets=score_targets,
            draft_rows=draft_rows,
            adapter_rows=adapter_rows,
            logits_index=buf.fill("logits_rows", logits_rows),
        )

    def _linears_step(self):
        return contextlib.nullcontext() if self.packed_linears is None else self.packed_linears.verified_step()

    def _lora_step(self, inputs: StepInputs):
        return contextlib.nullcontext() if inputs.adapter_rows is None else self.lora_layers.step(inputs.adapter_rows)

    def _forward(self, plan: StepPlan, inputs: StepInputs) -> torch.Tensor:
        """The step's forward over ``inputs``' flattened ``[1, T]`` rows: the logits
        ``[len(inputs.logits_rows), vocab]`` of the rows the LM head reads, in that order."""
        step = self.cache.for_step(inputs.metadata)  # the step's metadata travels with the view, not on the cache
        kwargs = {
            "input_ids": inputs.input_ids.unsqueeze(0),
            "position_ids": inputs.positions.unsqueeze(0),
            self._cache_arg: step,
            "use_cache": True,
            "paged_cache": step,
        }
        if self.cache.indexer_layers and inputs.metadata is not None:
            # A sparse-attention indexer (DeepSeek V3.2's DSA) adds a causal mask to its scores
            # before its top-k: the step's own over its flattened contexts (transformers builds
            # none for a paged cache), under the layer kind's key in the model's mask mapping.
            kwargs["attention_mask"] = {"indexed_attention": step.index_mask()}
        if (
            self.cache.indexer_layers or self.cache.key_bias_layers or self.needs_prompt_lens
        ) and inputs.metadata is not None:
            # A top-k (a sparse-attention indexer's, engine.sparse_indexer; a per-key bias's,
            # torch_paged.key_biased_attention) or a router mixing a forward's tokens
            # (engine.cross_token_routers) runs per request over the rows generate builds: each
            # metadata entry's prompt length, entries laid out as build_metadata lays them.
            batch = self.batch
            step.prompt_lens = [
                batch.get(s.request_id).num_prompt_tokens
                for s in plan.scheduled
                for _ in range(s.num_new_tokens if s.draft_token_ids else 1)
            ]
        rows = inputs.logits_index
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        rotary = (
            contextlib.nullcontext() if self.rotary_variants is None else self.rotary_variants.step(plan, self.batch)
        )
        try:
            with self._linears_step(), self._lora_step(inputs), rotary:
                logits = self.model(**kwargs).logits[0]
        finally:
            step.end()  # the thread's record of the last stored K/V holds the view, and so the pools
        if not self._supports_logits_to_keep:
            logits = logits.index_select(0, rows)
        return logits

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Apply the plan's diffs to the batch and run the step's forward; returns the sampled token
        of each sampling row (with its log-probs where ``SamplingValues.logprobs`` asks), the greedy
        tokens of each request verifying drafts, and the scored prompt positions' log-probs. A plan
        without rows only applies its diffs (rows of requests that left go)."""
        output = RunnerOutput()
        if plan.is_empty:
            self.batch.apply(plan)  # rows that left still leave
            return output
        inputs = self.build_metadata(plan)
        logits = self._forward(plan, inputs)
        num_sample_rows, num_score_rows = len(inputs.sample_rows), len(inputs.score_rows)
        if inputs.draft_rows:
            # Drafting requests are greedy (SamplingParams.can_draft): the argmax of every row, under
            # the request's grammar where it has one.
            drafting = plan.drafting
            greedy = self.sampler.verify_drafts(
                logits[num_sample_rows + num_score_rows :], drafting, [self.batch.get(s.request_id) for s in drafting]
            )
            logits = logits[: num_sample_rows + num_score_rows]
            at = 0
            for s in drafting:
                output.greedy[s.request_id] = greedy[at : at + s.num_new_tokens]
                at += s.num_new_tokens
        sampling = plan.sampling
        rows = [self.batch.get(s.request_id) for s in sampling]
        # The first sampling row of a request with no output yet scores score_token_id after the prompt.
        score_ids = [r.sampling.score_token_id if len(r.token_ids) == r.num_prompt_tokens else None for r in rows]
        if num_score_rows or any(t is not None for t in score_ids):
            output.prompt_logprobs = self._prompt_logprobs(logits, rows, score_ids, inputs.score_targets)
            logits = logits[:num_sample_rows]
        tokens, output.logprobs = self.sampler.sample(logits, rows)
        output.sampled.update((s.request_id, t) for s, t in zip(sampling, tokens))
        return output

    # --- prompt log-probs (SamplingParams.prompt_logprobs; lm-eval scoring) ----------------------
    def _prompt_logprob_rows(self, plan: StepPlan) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Extra LM-head rows for requests scoring their prompt: the flattened row of each position
        ``p`` this step computes whose next prompt token ``p + 1`` is requested, with
        ``(request id, p + 1, that token)`` (the prompt from the request's batch row)."""
        rows: list[int] = []
        targets: list[tuple[int, int, int]] = []
        offset = 0
        batch = self.batch.rows
        for s in plan.scheduled:
            row = batch[s.request_id]
            k = row.sampling.prompt_logprobs
            if k:
                for p in s.scored_positions(k, row.num_prompt_tokens):
                    rows.append(offset + p - s.start_position)
                    targets.append((s.request_id, p + 1, row.token_ids[p + 1]))
            offset += s.num_new_tokens
        return rows, targets

    @staticmethod
    def _prompt_logprobs(
        logits: torch.Tensor,
        sampling: list[BatchRow],
        score_token_ids: list[Optional[int]],
        score_targets: list[tuple[int, int, int]],
    ) -> dict[int, list[tuple[int, float, bool]]]:
        """``{request id: [(position, log-prob, is_argmax), ...]}`` of the scored positions; rows
        after the sampling rows are the prompt rows, and sampling row ``i`` scores
        ``score_token_ids[i]`` (when not None) at position ``num_prompt_tokens``."""
        targets = [
            (r.request_id, r.num_prompt_tokens, t, i)
            for i, (r, t) in enumerate(zip(sampling, score_token_ids))
            if t is not None
        ]
        n_sample = len(sampling)
        targets += [(rid, t, tok, n_sample + j) for j, (rid, t, tok) in enumerate(score_targets)]
        scores: dict[int, list[tuple[int, float, bool]]] = {}
        if not targets:
            return scores
        idx = torch.tensor([row for *_, row in targets], device=logits.device)
        sel = logits.index_select(0, idx).float()
        tok = torch.tensor([t for _, _, t, _ in targets], device=logits.device)
        logprobs = torch.log_softmax(sel, dim=-1).gather(1, tok[:, None])[:, 0].tolist()
        argmax_ok = (sel.argmax(dim=-1) == tok).tolist()
        for (rid, t, _, _), lp, ok in zip(targets, logprobs, argmax_ok):
            scores.setdefault(rid, []).append((t, lp, bool(ok)))
        return scores
