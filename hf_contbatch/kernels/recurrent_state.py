"""The recurrent state of linear-attention, SSM and short-convolution layers: one fixed-size slot per
running request, and the per-forward view the model reads and writes it through.

transformers' recurrent layers (Mamba's mixer, gated delta-net, LFM2's short convolution...) keep
two kinds of state per request in the cache object their forward receives: a *conv state* (the last
``kernel_size`` inputs of a causal depthwise convolution, ``[batch, channels, kernel_size]``) and a
*recurrent state* (the SSM or linear-attention state, e.g. ``[batch, heads, k_dim, v_dim]``), each
under a ``state_idx`` (a layer may keep several). They call ``get_conv_state`` /
``get_recurrent_state`` (None before the first forward of a request), ``update_conv_state`` /
``update_recurrent_state``, ``has_previous_state`` and ``is_recording_past``, and update a state they
got in place on one-token steps (``causal_conv1d_update``, ``selective_state_update``).

:class:`RecurrentStatePool` keeps those states for every request in *slots*: per (layer, kind,
state index) one tensor ``[capacity, *state shape]`` whose row ``slot`` is one request's state. The
shapes and dtypes are the model's own, learnt at the first write (a layer's state shape depends on
the family; nothing needs to know it ahead). :class:`RecurrentStateStep` is the view of one forward
over some requests: it gathers their slots into working tensors (batch row ``i`` is the request in
``slots[i]``), hands those to the layers, and :meth:`RecurrentStateStep.commit` scatters what the
layers left back into the slots once the whole step succeeded (a failed step changes no state, so
the engine may run its requests again).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .attention import note_stored
from .paged_cache import PagedCacheStep, PagedKVCache

__all__ = ["RecurrentStatePool", "RecurrentStateStep", "step_class_for"]

_CONV, _RECURRENT = "conv", "recurrent"


class RecurrentStatePool:
    """Per-request recurrent state slots of one engine.

    Args:
        num_slots: most requests holding a state at once (the engine's ``max_num_seqs``: every
            running request holds one slot, from the step it enters the runner's batch to the
            step it leaves it).

    The tensors grow by doubling, up to ``num_slots`` rows, as higher slots are first written:
    an engine serving few requests at a time does not pay for ``max_num_seqs`` states.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a recurrent state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest slot first
        self._slot_of: dict[int, int] = {}
        # (layer, kind, state_idx) -> [capacity, *state shape]
        self._tensors: dict[tuple[int, str, int], torch.Tensor] = {}
        # (layer, state_idx) -> the conv kernel size (its state's last dimension)
        self.conv_kernel_size: dict[tuple[int, int], int] = {}

    # --- slots -------------------------------------------------------------------------------------
    def allocate(self, request_id: int) -> int:
        """The slot of ``request_id``: a free one, zeroed by first write (its state starts empty).

        Raises:
            RuntimeError: every slot is held (more running requests than ``num_slots``).
        """
        if request_id in self._slot_of:
            return self._slot_of[request_id]
        if not self._free:
            raise RuntimeError(f"no free recurrent state slot for request {request_id}: all {self.num_slots} are held")
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        return slot

    def free(self, request_id: int) -> None:
        """Give back the slot of ``request_id`` (nothing if it holds none)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)

    def slot(self, request_id: int) -> int:
        """The slot ``request_id`` holds. Raises ``KeyError`` when it holds none."""
        return self._slot_of[request_id]

    def holds(self, request_id: int) -> bool:
        """Whether ``request_id`` holds a slot."""
        return request_id in self._slot_of

    @property
    def num_free(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Slots held by requests."""
        return len(self._slot_of)

    # --- tensors -----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of every state tensor allocated so far."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def device_of(self, key: tuple[int, str, int]) -> Optional[torch.device]:
        """The device of ``key``'s states, or None when nothing was ever written under it."""
        pool = self._tensors.get(key)
        return None if pool is None else pool.device

    def read(self, key: tuple[int, str, int], slots: torch.Tensor) -> Optional[torch.Tensor]:
        """The states of ``slots`` (int64 ``[B]``, best on the state's device: ``device_of``) as a new
        ``[B, ...]`` tensor, or None when nothing was ever written under ``key``."""
        pool = self._tensors.get(key)
        return None if pool is None else pool.index_select(0, slots.to(pool.device))

    def write(
        self,
        key: tuple[int, str, int],
        slots: Sequence[int],
        states: torch.Tensor,
        index: Optional[torch.Tensor] = None,
    ) -> None:
        """Store ``states`` (``[B, ...]``) into ``slots``, allocating or growing the tensor of ``key``
        (its first write fixes the shape, dtype and device; later ones are cast to them).

        ``index``: ``slots`` as an int64 tensor already on the states' device (saves a copy per
        layer), or None.

        Raises:
            RuntimeError: ``states`` of another shape than the first write's.
        """
        pool = self._tensors.get(key)
        need = max(slots) + 1
        if pool is None:  # the first write fixes the state's shape, dtype and device
            pool = self._tensors[key] = states.new_zeros((_grown(0, need, self.num_slots), *states.shape[1:]))
        elif pool.shape[1:] != states.shape[1:]:
            raise RuntimeError(
                f"layer {key[0]}'s {key[1]} state {key[2]} changed shape from {tuple(pool.shape[1:])} "
                f"to {tuple(states.shape[1:])}"
            )
        elif need > pool.shape[0]:
            grown = pool.new_zeros((_grown(pool.shape[0], need, self.num_slots), *pool.shape[1:]))
            grown[: pool.shape[0]] = pool
            pool = self._tensors[key] = grown
        if index is None or index.device != pool.device:
            index = torch.tensor(list(slots), dtype=torch.long, device=pool.device)
        pool.index_copy_(0, index, states.to(pool.device, pool.dtype))

    def release(self) -> None:
        """Drop every tensor (``close()``)."""
        self._tensors.clear()


def _grown(capacity: int, need: int, limit: int) -> int:
    """Rows after growing ``capacity`` by doubling until ``need`` fit, at most ``limit``."""
    capacity = max(capacity, 1)
    while capacity < need:
        capacity *= 2
    return min(capacity, limit)


class RecurrentStateStep(PagedCacheStep):
    """One forward's cache view for a model with recurrent layers: :class:`PagedCacheStep` for its
    attention layers (if any), plus the recurrent-state methods of ``transformers.Cache``.

    The forward is either one prefill (``input_ids`` ``[1, T]``, the request's whole known tokens
    from position 0: no previous state, ``get_*_state`` return None) or a batch of one-token
    decodes (``[B, 1]``, row ``i`` the request holding ``slots[i]``: previous states are gathered
    from the slots). Attention layers of a hybrid model then see ``B`` batch rows of one token; they
    are stored and attended as the ``T = B`` one-token rows of the step's flattened metadata.

    Args:
        cache: the engine's paged KV cache (attention layers).
        metadata: the step's attention metadata over the forward's rows (decodes in row order).
        pool: the engine's state pool.
        slots: the slot of each batch row (``[1]`` for a prefill).
        has_previous_state: True for a batch of decodes, False for a prefill.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        metadata,
        pool: RecurrentStatePool,
        slots: Sequence[int],
        has_previous_state: bool,
    ) -> None:
        super().__init__(cache, metadata)
        self.pool = pool
        self.slots = list(slots)
        self.previous = has_previous_state
        self._slot_index: dict[torch.device, torch.Tensor] = {}  # ``slots`` on each state device, built once
        self._working: dict[tuple[int, str, int], torch.Tensor] = {}
        # transformers' ``Cache.layers``, one entry per cache layer of the pool (no per-layer
        # objects: the pools and slots hold their contents). Read for its length: Inkling 2 Loop
        # appends its later passes' layers to a cache holding only its decoder layers' (the pool
        # already has them, ``engine.kv_groups.cache_layer_sources``).
        self.layers = [None] * cache.num_layers

    # --- the recurrent part of transformers.Cache -------------------------------------------------
    def has_previous_state(self, layer_idx: Optional[int] = None, state_idx: Optional[int] = None) -> bool:
        return self.previous

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        # No draft rollback: the engine serves these models without drafts.
        return False

    def _gathered(self, key: tuple[int, str, int]) -> Optional[torch.Tensor]:
        """The working state of ``key``: this forward's rows' states, gathered once (the layers update
        it in place on one-token steps), None for a prefill."""
        if not self.previous:
            return self._working.get(key)
        if key not in self._working:
            device = self.pool.device_of(key)
            if device is None:
                return None
            state = self.pool.read(key, self._index_on(device))
            if state is None:
                return None
            self._working[key] = state
        return self._working[key]

    def _index_on(self, device: torch.device) -> torch.Tensor:
        """``slots`` as an int64 tensor on ``device`` (one copy per device and forward)."""
        index = self._slot_index.get(device)
        if index is None:
            index = self._slot_index[device] = torch.tensor(self.slots, dtype=torch.long, device=device)
        return index

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """``[B, channels, kernel_size]`` of this forward's rows, or None (a prefill)."""
        return self._gathered((layer_idx, _CONV, state_idx)) if self.previous else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """The recurrent (SSM / linear-attention) state of this forward's rows, or None (a prefill)."""
        return self._gathered((layer_idx, _RECURRENT, state_idx)) if self.previous else None

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs
    ) -> torch.Tensor:
        """Take this forward's conv inputs ``[B, channels, T]``; returns them with the previous
        ``kernel_size`` inputs before them (decodes) or left-padded with zeros to ``kernel_size``
        (a prefill shorter than the kernel), as transformers' ``LinearAttentionLayer`` does; keeps
        the last ``kernel_size`` columns as the state."""
        key = (layer_idx, _CONV, state_idx)
        size_key = (layer_idx, state_idx)
        if conv_kernel_size is None:
            conv_kernel_size = self.pool.conv_kernel_size.get(size_key, conv_states.shape[-1])
        self.pool.conv_kernel_size[size_key] = conv_kernel_size
        previous = self._gathered(key) if self.previous else None
        if previous is None:
            full = conv_states
            if full.shape[-1] < conv_kernel_size:
                full = torch.nn.functional.pad(full, (conv_kernel_size - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([previous, conv_states], dim=-1)
        self._working[key] = full[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """Keep ``recurrent_states`` (``[B, ...]``) as the rows' new state; returns it."""
        self._working[(layer_idx, _RECURRENT, state_idx)] = recurrent_states
        return recurrent_states

    # MiniMax's lightning attention keeps its state through ``MiniMaxCache``'s own two methods.
    def get_linear_cache(self, layer_idx: int) -> Optional[torch.Tensor]:
        """The recurrent state of ``layer_idx`` (MiniMax's name for it), or None (a prefill)."""
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        """Keep ``linear_cache`` as ``layer_idx``'s recurrent state (MiniMax's name for it)."""
        self.update_recurrent_state(linear_cache, layer_idx)

    @property
    def holds_states(self) -> bool:
        """Whether this forward's layers handed it any state (a prefill's always do)."""
        return bool(self._working)

    def commit(self) -> None:
        """Write every state this forward produced into its rows' slots (after the whole step ran)."""
        for key, state in self._working.items():
            self.pool.write(key, self.slots, state, self._index_on(state.device))
        self._working.clear()

    # --- positions, for a model that reads them from the cache (Inkling) -------------------------
    def _one_request(self) -> Optional[tuple[int, int]]:
        """``(context length, query rows)`` of this forward's one request, or None when it has
        several (a ``[B, 1]`` batch of decodes) or no metadata."""
        meta = self.metadata
        if meta is None or meta.num_requests != 1:
            return None
        return meta.seq_lens_cpu[0], meta.query_start_loc_cpu[1] - meta.query_start_loc_cpu[0]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """The position of this forward's first query row, for a forward of one request (its
        tokens before this forward); 0 otherwise, as :class:`PagedCacheStep`. Inkling computes its
        relative position bias and its log-scaled queries from it."""
        one = self._one_request()
        return 0 if one is None else one[0] - one[1]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: for a forward of one request its whole context from
        position 0, this forward's rows included (the paged kernels attend over it, masking a
        sliding window themselves, so a sliding layer gets it whole too); ``(query_length, 0)``
        otherwise, as :class:`PagedCacheStep`."""
        one = self._one_request()
        return (query_length, 0) if one is None else (one[0], 0)

    # --- attention layers of a hybrid model over a [B, 1] batch of decodes -----------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """As :meth:`PagedCacheStep.update`; ``[B, KVH, 1, D]`` decode rows are stored as the ``B``
        rows of one flattened ``[1, KVH, B, D]`` sequence."""
        if key_states.shape[0] == 1:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        super().update(key_states.transpose(0, 2), value_states.transpose(0, 2), layer_idx)
        note_stored(self, layer_idx, key_states, value_states)  # what the attention call will get
        return key_states, value_states

    def attend(self, layer_idx: int, query, key, value, *args, **kwargs):
        """As :meth:`PagedCacheStep.attend` (the other arguments pass through unchanged); a
        ``[B, H, 1, D]`` query of decode rows comes back as ``[B, 1, H, D]``."""
        if query.shape[0] == 1:
            return super().attend(layer_idx, query, key, value, *args, **kwargs)
        out = super().attend(
            layer_idx, query.transpose(0, 2), key.transpose(0, 2), value.transpose(0, 2), *args, **kwargs
        )  # [1, B, H, D]
        return out.transpose(0, 1)


def step_class_for(model) -> type:
    """The view class a forward of ``model`` gets: :class:`RecurrentStateStep`, or, for a model whose
    forward accepts only a cache class of its own (MiniMax checks ``isinstance(cache,
    MiniMaxCache)``), a subclass of both whose methods are :class:`RecurrentStateStep`'s (that class's
    ``__init__`` never runs). The own class is the one ``transformers.Cache`` subclass that the model's
    modeling module defines and names in an ``isinstance`` check."""
    import inspect
    import sys

    from transformers.cache_utils import Cache

    module = sys.modules.get(type(model).__module__)
    if module is None:
        return RecurrentStateStep
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return RecurrentStateStep
    own = [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, Cache)
        and cls.__module__ == module.__name__
        and f"isinstance(cache, {cls.__name__})" in source
    ]
    if len(own) != 1:
        return RecurrentStateStep
    # ``Cache.is_sliding`` is a read-only property, which would win over the attribute the view's
    # ``__init__`` sets: the view's own value instead (no sliding layer: the kernels get windows
    # as attention arguments).
    is_sliding = property(lambda self: [False] * self.cache.num_layers, lambda self, value: None)
    return type(
        f"{own[0].__name__}Step", (RecurrentStateStep, own[0]), {"__module__": __name__, "is_sliding": is_sliding}
    )
