"""The model runner of models that attend in their own code over what ``cache.update`` returns
(Bloom, Falcon, GPT-Neo, MPT, XGLM...: no ``AttentionInterface`` to plug the paged attention into).

Each forward gives the model a ``kernels.dense_context.DenseContextStep`` as its cache: ``update``
stores the new K/V in the paged pools and returns the rows' whole contexts, and the model computes
attention, masks and position biases itself, as under ``generate``. A step's rows are run as
separate forwards, one per shape: the rows with the same stored length and the same number of new
tokens together, as a ``[B, n]`` batch (each prefill chunk usually alone). Such a batch has no
padding, so every model of this kind sees what ``generate`` gives it for a batch of equal-length
sequences, including those that count positions from the cache's length or key index (GPT-Neo's
local-window buffer, MPT's ALiBi, TrOCR's positions): that is what keeps the tokens exact. A model
whose forward takes ``position_ids`` and an attention mask (GPT-Neo, Falcon, XGLM,
GPT-NeoX-Japanese) gets the step's decodes as one ``[B, 1]`` batch whatever their lengths, each
row's past left-padded as ``generate`` pads a batch of prompts, its positions given, its padding
masked (``pads_decodes``). It is slower than the flattened step (a forward per prefill chunk and,
for the others, per decode length; attention dense over each row's context), the price of serving
families transformers left outside the interface.

Each forward's logits rows are the ordinary runner's (``StepInputs`` of that part of the plan), so
sampling, prompt log-probs, drafts and the output are unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch

from ..config import EngineConfig, resolve_compile_model
from ..core.plan import RunnerOutput, ScheduledRequest, StepPlan
from ..kernels.dense_context import DenseContextStep
from .runner import ModelRunner, StepInputs

__all__ = ["DenseContextRunner", "dense_context_engine_config"]


def dense_context_engine_config(config: EngineConfig, model_type) -> EngineConfig:
    """``config`` as an engine serving a model through ``cache.update`` runs it: an eager forward
    (``HF_CONTBATCH_COMPILE=1`` is turned off: the compiled forward's attention op is the interface's).

    Raises:
        ValueError: ``compile_model=True`` (one line).
    """
    if config.compile_model:
        raise ValueError(
            f"model type {model_type!r} computes attention in its own code: compile_model=True is not served for it"
        )
    if resolve_compile_model(config.compile_model):
        return dataclasses.replace(config, compile_model=False)
    return config


class DenseContextRunner(ModelRunner):
    """``ModelRunner`` for a model that attends over what ``cache.update`` returns (see the module
    docstring). Arguments as ``ModelRunner``."""

    # The model keeps its own attention implementation: the engine switches nothing.
    uses_attention_interface = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        params = inspect.signature(self.model.forward).parameters
        self._takes_position_ids = "position_ids" in params
        self._takes_attention_mask = "attention_mask" in params
        # Decodes of different context lengths in one left-padded [B, 1] batch, as generate batches
        # prompts: only for a model that takes each row's positions as position_ids (transformers'
        # own contract for left-padded batches) and the padding as its 2-D attention mask. A model
        # without position_ids may count positions from the cache's length (TrOCR): its decodes
        # group by length.
        self.pads_decodes = self._takes_position_ids and self._takes_attention_mask

    @staticmethod
    def _parts(plan: StepPlan, pad_decodes: bool = False) -> list[list[ScheduledRequest]]:
        """The step's rows grouped by shape, ``(start_position, num_new_tokens)``, in plan order;
        with ``pad_decodes`` every one-token row (decodes) in one group whatever its position."""
        groups: dict[tuple[int, int], list[ScheduledRequest]] = {}
        for s in plan.scheduled:
            key = (-1, 1) if pad_decodes and s.num_new_tokens == 1 else (s.start_position, s.num_new_tokens)
            groups.setdefault(key, []).append(s)
        return list(groups.values())

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """As ``ModelRunner.execute``, one forward per group of equal-shape rows (module docstring)."""
        self.batch.apply(plan)
        output = RunnerOutput()
        if plan.is_empty:
            return output
        for rows in self._parts(plan, self.pads_decodes):
            part = dataclasses.replace(plan, scheduled=rows, new_requests=[], finished_ids=[], preempted_ids=[])
            output.merge(super().execute(part))
        return output

    def _forward(self, plan: StepPlan, inputs: StepInputs) -> torch.Tensor:
        """One ``[B, n]`` forward of ``plan``'s equal-shape rows: the logits
        ``[len(inputs.logits_rows), vocab]`` of the rows the LM head reads, in that order."""
        rows = plan.scheduled
        b, n = len(rows), rows[0].num_new_tokens
        pasts = [s.start_position for s in rows]
        step = DenseContextStep(self.cache, inputs.metadata, [s.block_ids for s in rows], pasts, n)
        kwargs = {"input_ids": inputs.input_ids.view(b, n), self._cache_arg: step, "use_cache": True}
        if self._takes_position_ids:
            kwargs["position_ids"] = inputs.positions.view(b, n)
        if self._takes_attention_mask:
            # What generate passes: every position of every row attends, but a left-padded row's padding.
            mask = torch.ones((b, step.past + n), dtype=torch.long, device=self.device)
            for i, pad in enumerate(step.padding()):
                mask[i, :pad] = 0
            kwargs["attention_mask"] = mask
        # Only each row's last token read (decodes, prefill chunks that sample): the LM head needs no more.
        last_only = all(r % n == n - 1 for r in inputs.logits_rows)
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 1 if last_only else 0
        rotary = (
            contextlib.nullcontext() if self.rotary_variants is None else self.rotary_variants.step(plan, self.batch)
        )
        with self._linears_step(), rotary:
            logits = self.model(**kwargs).logits
        step.check_stored()
        if last_only:
            picks = torch.tensor([r // n for r in inputs.logits_rows], dtype=torch.long, device=logits.device)
            return logits[:, -1].index_select(0, picks)
        return logits.reshape(b * n, -1).index_select(0, inputs.logits_index.to(logits.device))
