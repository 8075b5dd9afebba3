"""Switching a model's attention to the paged implementation, shared by the engines that serve it.

Engines sharing one model share its attention switch: the first remembers the model's own
implementation, the last to close restores it (closing one must not break the other). The count of
open engines lives on the model itself (no globals: two models, or two engines on one model, in one
process both work).

While switched, the model's own calls (``model.generate`` outside an engine step) still run its
previous implementation, with its masks: the name we switch to is registered per previous
implementation (``kernels.attention.register_attention``).
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

from ..kernels.attention import is_paged_attention, register_attention

logger = logging.getLogger(__name__)

_ATTN_USERS = "_hf_contbatch_attention_users"  # on the model: its own implementation, open engines


def switch_to_paged_attention(model, switch: bool = True) -> Optional[str]:
    """Register our attention over the model's own implementation with transformers and switch
    ``model`` to it; count one more user. ``switch=False``: only count the user, for an engine
    that serves a model attending in its own code (``engine.dense_runner``): nothing to switch,
    but the model is served all the same (``num_open_engines``).

    Returns the model's own attention implementation (to pass to ``restore_attention``).
    Raises whatever ``set_attn_implementation`` raises, with the count unchanged.
    """
    users = model.__dict__.setdefault(
        _ATTN_USERS, {"previous": getattr(model.config, "_attn_implementation", None), "open": 0}
    )
    try:
        if switch:
            model.set_attn_implementation(register_attention(users["previous"]))
    except BaseException:
        if not users["open"]:
            model.__dict__.pop(_ATTN_USERS, None)
        raise
    users["open"] += 1
    return users["previous"]


def num_open_engines(model) -> int:
    """How many open engines serve ``model`` through our attention (0 for a model none serves)."""
    users = model.__dict__.get(_ATTN_USERS)
    return int(users["open"]) if users is not None else 0


def restore_attention(model, previous: Optional[str]) -> None:
    """One user fewer; the last one restores ``previous`` (never raises: called from ``close``)."""
    users = model.__dict__.get(_ATTN_USERS)
    if users is not None:
        users["open"] -= 1
        if users["open"] > 0:
            return  # another open engine still serves this model through our attention
        model.__dict__.pop(_ATTN_USERS, None)
    if previous is not None and is_paged_attention(getattr(model.config, "_attn_implementation", None)):
        try:
            model.set_attn_implementation(previous)
        except Exception:  # restoring must not turn close() into an error
            if not sys.is_finalizing():  # at interpreter exit (``__del__``) there is nothing to restore for
                logger.warning("could not restore attention implementation %r", previous)
