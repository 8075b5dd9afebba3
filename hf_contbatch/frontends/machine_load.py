"""How busy the machine is, printed beside the figures that depend on it (tokens/s, seconds): a run
measured while other processes share the cores reads several times below the same run on an idle
machine, and without a word about the load a user takes the lower figure for the engine's speed.

The measure is the operating system's 1-minute load average (runnable processes, averaged) over the
logical cores (``os.getloadavg()``, ``os.cpu_count()``). This run's own threads count in it too: a
minute of generation on every core reads about 1 per core on an otherwise idle machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

# Busy above this load per core: this run's own threads make about 1 per core, so 1.5 means
# other processes hold at least half of every core on average.
BUSY_LOAD_PER_CORE = 1.5


@dataclass(frozen=True)
class MachineLoad:
    """A load reading: ``load_1min`` runnable processes averaged over the last minute, ``cores``
    logical CPUs."""

    load_1min: float
    cores: int

    @classmethod
    def now(cls) -> Optional[MachineLoad]:
        """This machine's load now, or None where the operating system keeps no load average
        (Windows)."""
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
        return cls(load, os.cpu_count() or 1)

    @property
    def per_core(self) -> float:
        """The load average per logical core."""
        return self.load_1min / max(self.cores, 1)

    @property
    def busy(self) -> bool:
        """Whether other processes take a large share of the cores (:data:`BUSY_LOAD_PER_CORE`)."""
        return self.per_core > BUSY_LOAD_PER_CORE

    def short(self) -> str:
        """``"load 7.60 on 2 cores"``, with ``", busy"`` when :attr:`busy`."""
        core_s = "core" if self.cores == 1 else "cores"
        return f"load {self.load_1min:.2f} on {self.cores} {core_s}" + (", busy" if self.busy else "")

    def busy_line(self) -> str:
        """One sentence saying that the machine is busy and what that does to the figures; ``""``
        when it is not."""
        if not self.busy:
            return ""
        return (
            f"the machine is busy (load {self.per_core:.1f} per core over the last minute, this run included): "
            "speeds are below what it reaches idle"
        )


def load_note(sep: str = "; ", load: Optional[MachineLoad] = None) -> tuple[str, str]:
    """What to print with a machine-dependent figure: (``sep`` + :meth:`MachineLoad.short`, to
    append to the figure's line; :meth:`MachineLoad.busy_line`, a line of its own, ``""`` unless
    the machine is busy); ``("", "")`` where no load average exists.

    Args:
        sep: what separates the note from the figures before it on their line.
        load: the reading to describe (default: :meth:`MachineLoad.now`).
    """
    load = load if load is not None else MachineLoad.now()
    if load is None:
        return "", ""
    return f"{sep}{load.short()}", load.busy_line()
