"""Per-request processors: a call's ``logits_processor`` given as a factory, called once per request
and per fork, so stateful processors (a grammar library's processor keeps one matcher per batch row
and can be used once) get their own instances instead of seeing every request's rows interleaved."""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

from transformers.generation.logits_process import LogitsProcessorList


class PerRequestProcessors:
    """A request's processor list built anew for each request and fork: the call's
    ``logits_processor`` factory is called, and transformers merges its fresh processors into the
    list ``generate`` builds for the prompt. The sampler calls this once per request id, when the
    request (or fork) first samples, so stateful processors (one matcher per batch row, "use once")
    never see another request's rows.

    Args:
        factory: a zero-argument callable returning a ``LogitsProcessorList``.
        build: ``custom processors -> the request's full list`` (``build_logits_processor`` bound
            to the prompt and its settings).
        extra: processors appended after the factory's (the grammar mask's place).
    """

    def __init__(self, factory: Callable[[], Sequence], build: Callable, extra: Sequence = ()) -> None:
        self.factory = factory
        self.build = build
        self.extra = list(extra)

    def __call__(self) -> LogitsProcessorList:
        """The request's processors.

        Raises:
            ValueError: the factory did not return a list of callables.
        """
        custom = self.factory()
        if not (isinstance(custom, (list, tuple)) and all(callable(p) for p in custom)):
            raise ValueError(
                f"the `logits_processor` factory must return a LogitsProcessorList (a list of callables), got {custom!r}"
            )
        return self.build(LogitsProcessorList(list(custom) + self.extra))


def is_processor_factory(logits_processor) -> bool:
    """True for a zero-argument callable that is not itself a list of processors."""
    if isinstance(logits_processor, (list, tuple)) or not callable(logits_processor):
        return False
    try:
        params = inspect.signature(logits_processor).parameters.values()
    except (TypeError, ValueError):
        return True  # a builtin: trust it
    return not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
