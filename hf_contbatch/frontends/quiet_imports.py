"""Keep optional libraries' import-time notices out of a user's cell or terminal.

With torchao installed (the ``quant`` extra), transformers imports it on every model load, and
torchao logs a warning for each CUDA-only extension it cannot load on a CPU machine, and torch's
pytree logger one per enum torchao registers: a red box in a notebook that reads as a failure, and
extra lines around a command's one-line error. They say nothing about the user's model.
"""

from __future__ import annotations

import contextlib
import logging

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_optional_import_notices():
    """Raise ``NOISY_LOGGERS`` to ERROR inside the block (e.g. around ``from_pretrained``), then put
    their levels back."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
