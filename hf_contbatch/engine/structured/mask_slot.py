"""Where a request's grammar mask goes in its ``LogitsProcessorList``."""

from __future__ import annotations

from typing import Optional

import torch
from transformers.generation.logits_process import LogitsProcessor


class GrammarMaskSlot(LogitsProcessor):
    """A place holder in a request's processor list: the sampler applies the step's grammar
    bitmask, batched with other requests' rows, at this position.

    Passed to transformers as a custom processor, it lands where ``generate`` puts a grammar
    library's own ``LogitsProcessor`` given as ``logits_processor=[...]``: after the processors
    built from the generation settings and the caller's own, before the sampling warpers
    (temperature, top-k, top-p...). Called as a processor it changes nothing.
    """

    is_grammar_mask_slot = True  # read by SamplingParams.is_greedy_unprocessed (no import of this layer)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores


def split_at_mask_slot(procs) -> Optional[tuple[list, list]]:
    """``(before, after)``: the processors before and after the first ``GrammarMaskSlot`` of
    ``procs``; None when it has none."""
    for i, p in enumerate(procs):
        if getattr(p, "is_grammar_mask_slot", False):
            return list(procs[:i]), list(procs[i + 1 :])
    return None
