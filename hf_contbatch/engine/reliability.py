"""Keeping one request's fault with that request: checks at submit, culprit isolation when a step's
forward raises, and interrupts that land between iterations, never inside one.

* :func:`check_request` rejects at submit what would otherwise fail inside a step, where the error
  would reach every request batched with the bad one (an id outside the embedding table raises
  ``IndexError`` in the middle of the forward).
* :func:`execute_isolating_failures` runs a step's forward; when it raises, the step's requests are
  run again in halves, recursively, so the innocent ones get exactly the tokens they would have had
  and only requests that still fail alone are reported.
* :class:`DeferredInterrupt` holds a SIGINT (a notebook's Stop button, Ctrl-C) that arrives while a
  blocking caller runs iterations until the iteration is over, so the engine's state is never cut
  in half, then replays it to the handler that was installed before.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from typing import Callable, Optional, Sequence

from ..core.plan import RunnerOutput, ScheduledRequest, StepPlan
from ..request import SamplingParams

logger = logging.getLogger(__name__)


def check_request(prompt_token_ids: Sequence[int], sampling: SamplingParams, vocab_size: Optional[int]) -> None:
    """Raise ``ValueError`` for a prompt or a token id that would fail inside a step (the sampling
    values themselves were checked when ``sampling`` was built, ``request.check_sampling_values``).

    Args:
        prompt_token_ids: the prompt (ints already checked).
        sampling: the request's sampling parameters.
        vocab_size: rows of the model's input embedding (ids must be in ``[0, vocab_size)``), or
            None when unknown.

    Raises:
        ValueError: naming the argument, the offending value (for a token id: its position) and the
            allowed range.
    """
    if vocab_size is None:
        return
    for pos, t in enumerate(prompt_token_ids):
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"`prompt_token_ids` holds token id {t} at position {pos}, outside the model's vocabulary "
                f"of {vocab_size} embedding rows (allowed: 0..{vocab_size - 1}); a tokenizer with added "
                "tokens needs model.resize_token_embeddings(len(tokenizer))"
            )
    if sampling.score_token_id is not None and sampling.score_token_id >= vocab_size:
        raise ValueError(
            f"`score_token_id` must be None or a token id in 0..{vocab_size - 1}, got {sampling.score_token_id!r}"
        )


def execute_isolating_failures(
    execute: Callable[[StepPlan], RunnerOutput], plan: StepPlan
) -> tuple[RunnerOutput, list[tuple[ScheduledRequest, Exception]]]:
    """Run ``execute(plan)``; if it raises, run the step's requests again in halves until each
    failing group is one request, which fails alone.

    Re-running is safe because nothing of a failed forward is kept: ``num_computed_tokens`` only
    advances after it, so the retry writes the same KV slots again, and the block moves of the
    step (swap, copy) already happened before the first try. A request is run at most
    ``1 + log2(len(plan.scheduled))`` times in the step. Greedy tokens of the innocent requests are
    the ones a batch without the culprit would give; a request sampled from the engine's shared
    generator draws different (equally valid) random numbers than without the failure.

    Args:
        execute: ``ModelRunner.execute``: a ``StepPlan`` to its ``RunnerOutput``.
        plan: the step's plan (not modified); each retry runs a copy with part of its requests.

    Returns:
        ``(RunnerOutput, [(ScheduledRequest, exception), ...])`` for the requests that completed and those that failed even when run alone.
    """
    try:
        return execute(plan), []
    except Exception as exc:  # noqa: BLE001 - isolated below, then reported per request
        if len(plan.scheduled) <= 1:
            return RunnerOutput(), [(s, exc) for s in plan.scheduled]
        logger.warning(
            "a step of %d requests failed (%r); running them again in smaller groups", len(plan.scheduled), exc
        )
    output = RunnerOutput()
    failed: list = []
    half = len(plan.scheduled) // 2
    for part in (plan.scheduled[:half], plan.scheduled[half:]):
        got, bad = execute_isolating_failures(execute, dataclasses.replace(plan, scheduled=list(part)))
        output.merge(got)
        failed += bad
    return output, failed


class DeferredInterrupt:
    """Context manager: in the main thread, a SIGINT that arrives inside is recorded, not raised;
    :meth:`replay` hands it to the previously installed handler (Python's default raises
    ``KeyboardInterrupt``) once the caller is at a safe point.

    Outside the main thread, or when SIGINT is not handled by Python (``SIG_DFL``/``SIG_IGN``),
    nothing is installed: no ``KeyboardInterrupt`` can arrive there anyway.
    """

    def __init__(self) -> None:
        self.pending = False
        self._frame = None
        self._previous: Optional[Callable] = None

    def __enter__(self) -> "DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self._previous = previous
                signal.signal(signal.SIGINT, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.pending = True
        self._frame = frame

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def replay(self) -> None:
        """After leaving the block: deliver a recorded SIGINT to the previous handler (raises
        ``KeyboardInterrupt`` with Python's default handler). Does nothing when none arrived."""
        if self.pending:
            self.pending = False
            handler = self._previous or signal.default_int_handler
            handler(signal.SIGINT, self._frame)
