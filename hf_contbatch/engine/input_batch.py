"""The model runner's persistent batch: one row per request the scheduler runs, kept from step to
step and changed only by the plan's diffs.

A row is added when the plan carries the request's ``NewRequestData`` (admitted, swapped in,
forked, resumed after preemption) and removed when its id is in ``finished_ids`` or
``preempted_ids``; in between, each step's ``ScheduledRequest`` writes its token ids at its
positions, so a row holds the request's prompt and its tokens up to the end of its latest rows
(what its logits processors read as history, and the prompt tokens it scores) without the runner ever seeing the ``Request``. Applying a plan's
diffs twice changes nothing (a failed step's requests run again in halves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..core.plan import NewRequestData, SamplingValues, StepPlan

__all__ = ["BatchRow", "InputBatch"]


@dataclass
class BatchRow:
    """One request's row.

    Attributes:
        request_id: the request's id.
        num_prompt_tokens: the prompt's length.
        sampling: its sampling settings (values).
        adapter_name: its LoRA adapter (None: the base model).
        kv_variant: ``NewRequestData.kv_variant`` (None: the default).
        token_ids: its whole prompt, then its output token ids up to the end of its latest
            scheduled rows (a step's drafts included until the next step overwrites them).
    """

    request_id: int
    num_prompt_tokens: int
    sampling: SamplingValues
    adapter_name: Optional[str]
    token_ids: list[int] = field(default_factory=list)
    kv_variant: Optional[str] = None

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens of ``token_ids`` (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]


class InputBatch:
    """The rows of the requests the scheduler runs, by request id."""

    def __init__(self) -> None:
        self.rows: dict[int, BatchRow] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def apply(self, plan: StepPlan) -> None:
        """Remove the rows of ``plan.finished_ids`` and ``plan.preempted_ids``, add those of
        ``plan.new_requests``, then write each scheduled row's token ids at its positions.

        Raises:
            KeyError: a scheduled row whose request never entered the batch.
        """
        for rid in plan.finished_ids:
            self.rows.pop(rid, None)
        for rid in plan.preempted_ids:
            self.rows.pop(rid, None)
        for new in plan.new_requests:
            self.add(new)
        rows = self.rows
        for s in plan.scheduled:
            row = rows[s.request_id]
            end = s.start_position + s.num_new_tokens
            row.token_ids[s.start_position : end] = s.token_ids
            if end >= row.num_prompt_tokens:  # what follows is stale: the last step's rejected drafts
                del row.token_ids[end:]

    def add(self, new: NewRequestData) -> None:
        """Add (or replace) the row of ``new``: its tokens, prompt length, sampling values, adapter and
        KV variant."""
        self.rows[new.request_id] = BatchRow(
            new.request_id, new.num_prompt_tokens, new.sampling, new.adapter_name, list(new.token_ids), new.kv_variant
        )

    def get(self, request_id: int) -> BatchRow:
        """The row of ``request_id``. Raises ``KeyError`` when the batch does not hold it."""
        return self.rows[request_id]
