"""Rotary embeddings whose frequencies depend on the sequence length, computed per request.

transformers' LongRoPE (``rope_type: "longrope"``, Phi-3 and kin) rotates with its *long* factors
when the forward's largest position + 1 exceeds ``original_max_position_embeddings``, with its
*short* ones otherwise (``modeling_rope_utils.dynamic_rope_update``): one choice per forward. The
engine's forward is one flattened batch of many requests' rows, so that choice would follow the
longest request in the batch, the chunk boundaries of a chunked prefill, and whatever request
computed a cached block. Here each request gets the choice its own ``generate`` makes:

* its prompt is prefilled in one forward there, so a prompt longer than the threshold is long
  from its first row (chunks and all);
* a shorter one decodes with the short factors until the sequence reaches threshold + 1 tokens;
  Phi-3's ``prepare_inputs_for_generation`` then drops the cache and computes the whole sequence
  again, now with the long factors, and stays long. The engine does the same: after the step that
  appended that token, :meth:`RotaryVariants.recompute_crossed` sends the request back to compute
  all its tokens (``Scheduler.recompute``), and its rows are long from then on.

So a request's rows are all long or all short, as its ``Request.kv_variant`` says
(:attr:`RotaryVariants.LONG`: more tokens than the threshold), and that is also its prefix-cache
key's part: blocks computed with one set of factors are never hits for a request using the other.
Prompt-lookup drafts are refused for a request that would cross the threshold
(``RequestFactory``): draft rows past it would be verified against the short K.

"dynamic" NTK rotaries change their frequencies only past ``max_position_embeddings``, which the
engine never lets a request reach (its context), so they stay as they are.

Each longrope rotary module gets a per-instance ``forward`` (never a class change), removed by
:meth:`RotaryVariants.remove`; the forward uses the per-row choice only in the thread whose step set
it (:meth:`RotaryVariants.step`), and the model's own behaviour anywhere else (``model.generate``
while an engine serves it).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Iterator, Optional

import torch

from . import model_users

_USERS = "_hf_contbatch_rotary_variants"  # on the model: [RotaryVariants, open engines using it]


def _longrope_modules(model) -> list[torch.nn.Module]:
    """The model's rotary modules that choose LongRoPE factors per forward (transformers' decorated
    ``forward`` with an undecorated one under it and ``original_inv_freq`` the short frequencies).

    Raises:
        ValueError: a longrope rotary we cannot serve per request (per layer type, or a forward
            without transformers' ``dynamic_rope_update``), naming the rope type.
    """
    found = []
    for m in model.modules():
        rope_type = getattr(m, "rope_type", None)
        if isinstance(rope_type, dict) and "longrope" in rope_type.values():
            raise ValueError(
                f"{type(m).__name__}: rope_type 'longrope' per layer type is not supported: its factors depend on "
                "each request's length, which this engine computes per request only for one rotary per model"
            )
        if rope_type != "longrope":
            continue
        if getattr(type(m).forward, "__wrapped__", None) is None or not hasattr(m, "original_inv_freq"):
            raise ValueError(
                f"{type(m).__name__}: rope_type 'longrope' without transformers' dynamic_rope_update is not supported: "
                "its factors depend on each request's length"
            )
        found.append(m)
    return found


class _PerRowForward:
    """The per-instance ``forward`` of one longrope rotary module: each row's cos/sin from the
    short or the long frequencies, as the running step chose (``RotaryVariants.step``)."""

    def __init__(self, module: torch.nn.Module, variants: "RotaryVariants") -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.module, self.variants = module, variants
        self.decorated = type(module).forward  # transformers' forward: update, then compute
        self.compute = type(module).forward.__wrapped__  # the computation alone, from self.inv_freq
        omax = module.config.rope_parameters["original_max_position_embeddings"]
        short = module.original_inv_freq
        # The long frequencies exactly as dynamic_rope_update computes them (seq_len past the threshold).
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, short.device, seq_len=omax + 1)
        # Two shallow copies of the module, each with its own buffers dict, computing from the short
        # or the long frequencies: the module itself (which other threads may run) is never mutated.
        self.short_module, self.long_module = copy.copy(module), copy.copy(module)
        for shadow, inv_freq in ((self.short_module, short), (self.long_module, long.to(short.dtype))):
            shadow._buffers = dict(module._buffers)
            shadow._buffers["inv_freq"] = inv_freq

    def __call__(self, x, position_ids, *args, **kwargs):
        rows = self.variants.rows_for_this_thread()
        if rows is None or position_ids.shape[0] != 1 or position_ids.shape[-1] != rows.shape[0]:
            return self.decorated(self.module, x, position_ids, *args, **kwargs)
        cos_s, sin_s = self.compute(self.short_module, x, position_ids, *args, **kwargs)
        cos_l, sin_l = self.compute(self.long_module, x, position_ids, *args, **kwargs)
        long = rows.to(cos_s.device).view(1, -1, 1)
        return torch.where(long, cos_l, cos_s), torch.where(long, sin_l, sin_s)


class RotaryVariants:
    """Per-request LongRoPE factors for one model (see the module docstring), shared by the engines
    serving it (:func:`acquire_rotary_variants`).

    Args:
        modules: the model's longrope rotary modules (``_longrope_modules``).

    Attributes:
        original_max_position_embeddings: the threshold (tokens): a request with more tokens than
            this (prompt, or prompt + generated) runs with the long factors.
    """

    LONG = "longrope:long"
    """``Request.kv_variant`` of a request whose K is rotated with the long factors."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = modules
        self.original_max_position_embeddings = int(
            modules[0].config.rope_parameters["original_max_position_embeddings"]
        )
        self._rows: dict[int, torch.Tensor] = {}  # thread id -> bool [T] of its running step
        for m in modules:
            m.__dict__["forward"] = _PerRowForward(m, self)

    def remove(self) -> None:
        """Give each module its class's forward back."""
        for m in self.modules:
            if isinstance(m.__dict__.get("forward"), _PerRowForward):
                del m.__dict__["forward"]
        self._rows.clear()

    def prefix_key(self, num_tokens: int) -> Optional[str]:
        """``Request.kv_variant`` of a sequence of ``num_tokens``: :attr:`LONG` past the threshold,
        else None (the short factors, the model's own)."""
        return self.LONG if num_tokens > self.original_max_position_embeddings else None

    def recompute_crossed(self, scheduler) -> None:
        """Send each running request whose sequence just passed the threshold back to compute all
        its tokens with the long factors (``Scheduler.recompute``), under the long prefix-cache key:
        what transformers' Phi-3 ``generate`` does there (``prepare_inputs_for_generation`` drops
        the cache once the sequence reaches ``original_max_position_embeddings + 1`` tokens). Call
        with the engine's state lock held, after the step's tokens were appended."""
        omax = self.original_max_position_embeddings
        for req in list(scheduler.running):
            if req.kv_variant is None and not req.status.is_finished and req.num_tokens > omax:
                req.kv_variant = self.LONG
                scheduler.recompute(req)

    def rows_for_this_thread(self) -> Optional[torch.Tensor]:
        return self._rows.get(threading.get_ident())

    @contextlib.contextmanager
    def step(self, plan, batch) -> Iterator[None]:
        """During one forward of ``plan`` (a ``core.plan.StepPlan``: its rows in plan order, each
        request's ``num_new_tokens`` of them, as ``ModelRunner.build_metadata`` lays them out), each
        row's factors for the calling thread's forwards: its request's ``kv_variant``, as the
        runner's ``batch`` (``engine.input_batch.InputBatch``) holds it."""
        long = []
        for s in plan.scheduled:
            long.extend([batch.get(s.request_id).kv_variant == self.LONG] * s.num_new_tokens)
        key = threading.get_ident()
        self._rows[key] = torch.tensor(long, dtype=torch.bool)
        try:
            yield
        finally:
            self._rows.pop(key, None)


def acquire_rotary_variants(model) -> Optional[RotaryVariants]:
    """The model's ``RotaryVariants``, installed by the first engine on it and shared by the later
    ones; None for a model without a longrope rotary. Raises ``ValueError`` as ``_longrope_modules``."""
    return model_users.acquire(
        model, _USERS, lambda: RotaryVariants(modules) if (modules := _longrope_modules(model)) else None
    )


def release_rotary_variants(model) -> None:
    """One engine fewer on ``model``; the last one gives the rotaries their own forward back."""
    model_users.release(model, _USERS)
