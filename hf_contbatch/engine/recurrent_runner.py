"""The model runner of models with recurrent layers (Mamba, gated delta-net, short convolutions...):
per-request state slots, and forwards that never mix two requests in one sequence.

A recurrent layer's convolution and scan run along the sequence dimension, so the flattened
``[1, T]`` row of the ordinary runner would carry one request's state into the next. A step is
run instead as separate forwards, each a shape transformers' own layers serve exactly:

- the step's decodes together, as a ``[B, 1]`` batch (row ``i`` the request in state slot
  ``slots[i]``; the layers take their one-token path, updating the gathered states in place);
  for a model that reads its positions from the cache (Inkling: ``cache.get_query_offset``, one
  number per forward, from which it computes a dense relative position bias), each decode alone
  as a ``[1, 1]`` forward, whose cache view tells the request's own positions;
- each prefill alone, ``[1, T]``, from position 0 (the layers' whole-sequence path, which starts
  from an empty state and leaves the final one);
- a request resuming a prefill it could not run whole (a recomputed request whose tokens exceed
  the step's token budget) as one-token forwards, the path ``generate`` took for those tokens.

Each forward's logits rows are the ordinary runner's (``StepInputs`` of that part of the plan), so
sampling, prompt log-probs and the output are unchanged. The states the forwards leave are
written into the slots only after the whole step ran (a failed step, run again in halves by the
engine, finds the states as they were).

A request takes a slot when it enters the runner's batch (``NewRequestData``: admitted or
resumed after preemption) and gives it back when it leaves (finished, cancelled, failed or
preempted); the scheduler runs at most ``max_num_seqs`` requests, so there is always one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import sys

import torch

from ..config import EngineConfig, resolve_compile_model
from ..core.plan import RunnerOutput, ScheduledRequest, StepPlan
from ..kernels.recurrent_state import RecurrentStatePool, RecurrentStateStep, step_class_for
from .runner import ModelRunner, StepInputs

__all__ = ["RecurrentModelRunner", "reads_positions_from_cache", "recurrent_engine_config"]

logger = logging.getLogger(__name__)


def recurrent_engine_config(config: EngineConfig, model_type, what: str = "recurrent layers") -> EngineConfig:
    """``config`` as an engine serving a model with recurrent layers runs it: no prefix caching (a
    cached prefix's KV comes without the state after it), whole prefills and no forking
    (``SchedulerConfig.per_request_state``), preemption by recompute (a swapped-out request would
    come back without its state), no ``long_prefill_token_threshold``. Logs what it turned off.

    ``HF_CONTBATCH_COMPILE=1`` (``compile_model=None``) is turned off too. ``what`` names what
    keeps the state in the messages ("recurrent layers", or a model's layers keeping their own cache).

    Raises:
        ValueError: ``prompt_lookup_num_tokens`` or ``compile_model=True``: a rejected draft would
            need the state rolled back, and the compiled forward has no state ops (one line).
    """
    if config.prompt_lookup_num_tokens:
        raise ValueError(
            f"model type {model_type!r} has {what}: prompt-lookup drafts (prompt_lookup_num_tokens) are "
            "not served for it (a rejected draft would need its per-request state rolled back)"
        )
    if config.compile_model:
        raise ValueError(f"model type {model_type!r} has {what}: compile_model=True is not served for it; turn it off")
    sched, cache = config.scheduler, config.cache
    off = []
    if resolve_compile_model(config.compile_model):  # only from the environment: a default, not a request
        off.append("HF_CONTBATCH_COMPILE=1 (eager forward)")
    if cache.enable_prefix_caching:
        off.append("prefix caching")
    if sched.preemption_mode != "recompute":
        off.append(f"preemption_mode={sched.preemption_mode!r} (recompute instead)")
    if sched.long_prefill_token_threshold is not None:
        off.append("long_prefill_token_threshold")
    if off:
        logger.info(
            "model type %r has %s (a state per request): %s off; prompts are prefilled whole",
            model_type,
            what,
            ", ".join(off),
        )
    return dataclasses.replace(
        config,
        compile_model=False,
        cache=dataclasses.replace(cache, enable_prefix_caching=False),
        scheduler=dataclasses.replace(
            sched, per_request_state=True, preemption_mode="recompute", long_prefill_token_threshold=None
        ),
    )


class RecurrentModelRunner(ModelRunner):
    """``ModelRunner`` for a model with recurrent layers (see the module docstring).

    Args:
        *args, **kwargs: as ``ModelRunner``.
        num_state_slots: requests holding a state at once (the scheduler's ``max_num_seqs``).
    """

    def __init__(self, *args, num_state_slots: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.states = RecurrentStatePool(num_state_slots)
        self._step_class = step_class_for(self.model)  # RecurrentStateStep, or one MiniMax accepts
        self._decode_alone = reads_positions_from_cache(self.model)
        # Tokens each request's state has consumed: a row must start there (checked, never assumed).
        self._consumed: dict[int, int] = {}
        self._views: dict[tuple[int, ...], RecurrentStateStep] = {}  # this step's, by their rows' requests
        self._previous = False  # whether the forward being run continues states

    def _apply_slots(self, plan: StepPlan) -> None:
        """Free the slots of requests that left the batch, take one for each request entering it."""
        for rid in (*plan.finished_ids, *plan.preempted_ids):
            self.states.free(rid)
            self._consumed.pop(rid, None)
        for new in plan.new_requests:
            if not self.states.holds(new.request_id):
                self.states.allocate(new.request_id)
                self._consumed[new.request_id] = 0

    def _parts(self, plan: StepPlan) -> list[tuple[list[ScheduledRequest], bool]]:
        """The step's forwards, ``(rows, has_previous_state)``: the decodes together, then each
        prefill alone; a row continuing a prefill becomes one-token rows, run one after another.

        Raises:
            RuntimeError: a row that does not start where its request's state ends, or drafts.
        """
        decodes: list[ScheduledRequest] = []
        parts: list[tuple[list[ScheduledRequest], bool]] = []
        for s in plan.scheduled:
            consumed = self._consumed.get(s.request_id)
            if consumed != s.start_position:
                raise RuntimeError(
                    f"request {s.request_id}'s recurrent state holds {consumed} tokens but its row starts at "
                    f"position {s.start_position}"
                )
            if s.draft_token_ids:
                raise RuntimeError("prompt-lookup drafts reached a model with recurrent layers")
            if s.start_position == 0:
                parts.append(([s], False))
            elif s.num_new_tokens == 1 and self._decode_alone:
                parts.append(([_one_token(s, 0, s.samples)], True))
            elif s.num_new_tokens == 1:
                decodes.append(_one_token(s, 0, s.samples))
            else:  # a prefill continued: one token at a time, as generate computed these tokens
                for i in range(s.num_new_tokens):
                    parts.append(([_one_token(s, i, s.samples and i == s.num_new_tokens - 1)], True))
        return ([(decodes, True)] if decodes else []) + parts

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """As ``ModelRunner.execute``, in separate forwards (see the module docstring); the slots'
        states change only when every forward of the step succeeded."""
        self.batch.apply(plan)
        self._apply_slots(plan)
        output = RunnerOutput()
        if plan.is_empty:
            return output
        # One view per request's chain of forwards: a continued prefill's one-token forwards read
        # the state the previous one left in the view (the slots are written at the end).
        self._views = {}
        try:
            for rows, previous in self._parts(plan):
                part = dataclasses.replace(plan, scheduled=rows, new_requests=[], finished_ids=[], preempted_ids=[])
                self._previous = previous
                output.merge(super().execute(part))
            for view in self._views.values():
                view.commit()
        finally:
            self._views = {}
        for s in plan.scheduled:
            self._consumed[s.request_id] = s.start_position + s.num_new_tokens
        return output

    def _forward(self, plan: StepPlan, inputs: StepInputs) -> torch.Tensor:
        """One forward of ``plan``'s rows: ``[B, 1]`` decodes or one ``[1, T]`` prefill."""
        ids = tuple(s.request_id for s in plan.scheduled)
        step = self._views.get(ids)
        if step is None:
            slots = [self.states.slot(rid) for rid in ids]
            step = self._views[ids] = self._step_class(self.cache, inputs.metadata, self.states, slots, self._previous)
        else:
            step.metadata = inputs.metadata
        batch = len(ids) > 1  # decodes: one row per request
        ids, positions = inputs.input_ids, inputs.positions
        kwargs = {
            "input_ids": ids.unsqueeze(1) if batch else ids.unsqueeze(0),
            "position_ids": positions.unsqueeze(1) if batch else positions.unsqueeze(0),
            self._cache_arg: step,
            "use_cache": True,
            "paged_cache": step,
        }
        rows = inputs.logits_index
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 1 if batch else rows
        rotary = (
            contextlib.nullcontext() if self.rotary_variants is None else self.rotary_variants.step(plan, self.batch)
        )
        with self._linears_step(), self._lora_step(inputs), rotary:
            logits = self.model(**kwargs).logits
        if not step.previous and not step.holds_states:
            # Its layers kept their state somewhere else (on the modules): shared by every request.
            raise ValueError(
                f"model type {getattr(self.model.config, 'model_type', None)!r}: a prefill wrote no recurrent state "
                "through the cache: not served by hf_contbatch"
            )
        if batch:
            return logits[:, -1].index_select(0, rows)
        logits = logits[0]
        return logits if self._supports_logits_to_keep else logits.index_select(0, rows)


def reads_positions_from_cache(model) -> bool:
    """Whether ``model``'s modeling module asks the cache for its query positions
    (``get_query_offset``: Inkling's relative position bias and log-scaled queries), a single
    number per forward that means one request's positions: its decodes then run one per forward."""
    module = sys.modules.get(type(model).__module__)
    try:
        return module is not None and "get_query_offset(" in inspect.getsource(module)
    except (OSError, TypeError):
        return False


def _one_token(s: ScheduledRequest, i: int, samples: bool) -> ScheduledRequest:
    """Row ``i`` of ``s`` as a one-token row with a previous state (served as a decode)."""
    return dataclasses.replace(
        s,
        num_new_tokens=1,
        samples=samples,
        token_ids=(s.token_ids[i],),
        start_position=s.start_position + i,
        is_decode=True,
    )
