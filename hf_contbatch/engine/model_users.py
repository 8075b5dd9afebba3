"""One helper object per model, shared by the engines open on it (:func:`acquire`, :func:`release`).

Why: a model patch that lives on the model's modules (per-request rotary factors, a per-request
indexer forward, the fused RMSNorm and SiLU-and-mul forwards) must be installed once however many engines serve the model, and taken off only
when the last of them closes. The object and its count of engines sit in the model's ``__dict__``
under a key of the caller's, so two models never share one and nothing is process-wide.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")


def acquire(model, key: str, build: Callable[[], Optional[T]]) -> Optional[T]:
    """The object stored on ``model`` under ``key``, built by ``build()`` for the first engine (None
    from ``build``: nothing to install, nothing stored, None returned) and counted once more for
    every engine that acquires it. Errors ``build`` raises propagate, with nothing stored."""
    entry = model.__dict__.get(key)
    if entry is None:
        obj = build()
        if obj is None:
            return None
        entry = [obj, 0]
        model.__dict__[key] = entry
    entry[1] += 1
    return entry[0]


def release(model, key: str, undo: Callable[[T], None] = lambda obj: obj.remove()) -> None:
    """One engine fewer on ``model``'s object under ``key``; the last one calls ``undo(obj)`` (by
    default its ``remove()``) and drops it. Nothing stored under ``key``: nothing to do."""
    entry = model.__dict__.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        undo(entry[0])
        del model.__dict__[key]


class InstanceOverrides:
    """Method ``name`` of each of ``modules`` served by an instance attribute ``wrap(module)`` (the
    per-request forwards of sparse-attention indexers and cross-token routers, Doge's stored-bias
    ``prepare_dynamic_mask``), set in the module's ``__dict__`` so the class, and every other
    instance of it, are untouched. :meth:`remove` gives each module its class's method back, unless
    something else has replaced the attribute since."""

    def __init__(self, modules: list, name: str, wrap: Callable[[Any], Callable]) -> None:
        self.modules, self.name = modules, name
        self.installed = [(m, wrap(m)) for m in modules]
        for m, method in self.installed:
            m.__dict__[name] = method

    def remove(self) -> None:
        for m, method in self.installed:
            if m.__dict__.get(self.name) is method:
                del m.__dict__[self.name]
