"""Keep optional libraries' known harmless import-time notices out of a user's cell or terminal.

With torchao installed (the ``quant`` extra), transformers imports it whenever a model class loads
(``transformers.modeling_utils`` imports its quantizers, one of which imports torchao; hf_contbatch
itself imports torchao nowhere): torchao logs "Failed to load .../torchao/_C_mxfp8...so" for each
CUDA-only extension it cannot load on a CPU machine, and torch's pytree logger warns once per enum
torchao registers ("... is an Enum subclass ... deprecated"). In a notebook that is a red box on the
first cell that reads as a failure, and extra lines around a command's one-line error; they say
nothing about the user's model.

:func:`quiet_known_import_notices` drops exactly those records (a :class:`KnownImportNotices`
filter on the two loggers), nothing else: torchao's other warnings and pytree's warnings about
other libraries' enums still show. ``import hf_contbatch`` installs it (before a notebook's first
model load), as the command does; it is one filter object per logger, installed once per process
(logging's loggers are process-wide).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import re

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")

# torchao's loader: f"Failed to load {file}: {e}" for one of its own compiled extensions (_C*.so).
_TORCHAO_EXTENSION = re.compile(r"^Failed to load \S*torchao[/\\]_C\w*[.\w-]*\.(so|pyd|dll)\b")


class KnownImportNotices(logging.Filter):
    """A filter that drops torchao's "Failed to load <its own _C extension>" warnings and torch
    pytree's "<enum> is an Enum subclass ... deprecated" warnings about torchao's enums; every
    other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            return not _TORCHAO_EXTENSION.match(record.getMessage())
        if record.name == "torch.utils._pytree":
            args = record.args if isinstance(record.args, tuple) else ()
            cls = args[0] if args else None
            return not (
                isinstance(cls, type)
                and issubclass(cls, enum.Enum)
                and cls.__module__.split(".")[0] == "torchao"
                and "Enum subclass" in str(record.msg)
            )
        return True


def quiet_known_import_notices() -> None:
    """Install one :class:`KnownImportNotices` on each of ``NOISY_LOGGERS`` (idempotent: a logger
    that has one keeps it). Needs no torch: it only names the loggers."""
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownImportNotices) for f in logger.filters):
            logger.addFilter(KnownImportNotices())


@contextlib.contextmanager
def quiet_optional_import_notices():
    """:func:`quiet_known_import_notices`, as a ``with`` block around a model load (the filter stays:
    the notices come once per process, at torchao's first import)."""
    quiet_known_import_notices()
    yield
