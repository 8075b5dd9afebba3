"""The phases of an engine iteration, and a timer that charges elapsed time to them.

One definition of the names (the engine's phase log, ``EngineStats.phase_seconds`` and the
dashboard's phase bar all use ``PHASES``): the scheduler's five steps (reap, budget, admit,
preempt, decode), then "wait" (nothing to run but requests whose grammar compiles: the engine
waits for a compile) and "output" (streaming and stop checks of the step's new tokens, after the
engine's state lock is released).
"""

from __future__ import annotations

import time
from typing import Callable

PHASES = ("reap", "budget", "admit", "preempt", "decode", "wait", "output")


class PhaseTimer:
    """Charges wall time to named phases; a phase may be entered more than once per iteration.

    ``charge(name)`` adds the seconds since the previous charge (or since construction) to
    ``name``. Admission calls it around a priority preemption so that time counts as "preempt".

    Args:
        clock: time source in seconds (``time.monotonic``; tests inject a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def charge(self, phase: str) -> None:
        """Add the seconds since the previous charge to ``phase`` (one of ``PHASES``)."""
        now = self._clock()
        self.seconds[phase] += now - self._last
        self._last = now

    def as_tuple(self) -> tuple[tuple[str, float], ...]:
        """((phase, seconds), ...) in ``PHASES`` order."""
        return tuple(self.seconds.items())
