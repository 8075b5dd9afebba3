"""The cache view of a model that computes attention in its own code over what ``cache.update`` returns.

Bloom, Falcon, GPT-Neo, MPT, XGLM and a few other families (transformers 5.x) do not look their
attention function up in ``AttentionInterface``: each attention module calls
``cache.update(key, value, layer_idx)`` and attends, in its own code, over the K/V that call returns,
under the mask and position biases its model built (causal masks from ``create_causal_mask``,
GPT-Neo's local-window buffer, ALiBi from the 2-D attention mask, MPT's ALiBi counted from the last
key). There is no attention function to plug the paged one into, but there is the cache object:
:class:`DenseContextStep` is a ``DynamicCache`` as the model sees it, backed by the paged pools.
Its ``update`` stores the new K/V into their slots and returns each row's whole context, ``[B, KVH,
past + n, D]``, gathered from the pool; ``get_seq_length``/``get_mask_sizes``/``get_query_offset``
answer as a ``DynamicCache`` holding ``past`` tokens per row would, so transformers' mask code builds
the masks ``generate`` gets.

Every row of one forward brings ``n`` new tokens. Rows of equal stored length run exactly as
``generate`` runs a batch of unpadded sequences of one length: no padding, no mask of ours,
positions, ALiBi and windows as the model computes them (some of these families derive positions
from the cache length, which only equal lengths keep right). Rows of different stored lengths are
laid out as ``generate`` lays out a left-padded batch (each row's past right-aligned, zeros in
front, hidden by the 2-D attention mask the caller passes): ``engine.dense_runner`` does that for
decodes of models that take their positions as ``position_ids``.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from .attention.metadata import AttentionMetadata
from .attention.torch_paged import gather_contexts
from .paged_cache import PagedKVCache

__all__ = ["DenseContextStep"]


class DenseContextStep:
    """One forward's cache for ``B`` requests bringing ``num_new`` new tokens each, row ``b`` with
    ``pasts[b]`` positions stored before (see the module docstring).

    Rows of unequal stored lengths are laid out as ``generate`` lays out a left-padded batch: every
    row's context ends at the same key index, ``past = max(pasts)`` stored positions then the new
    tokens, row ``b``'s first ``past - pasts[b]`` keys zeros that the caller's 2-D attention mask
    hides (``padding``). Only a model whose positions come from ``position_ids`` or from that mask
    may be given such rows (``engine.dense_runner`` decides).

    Duck-typed as a ``transformers.Cache`` (what these models call), deliberately not a
    ``PagedAttentionCache``: transformers' mask code builds no mask for the latter, and these models'
    own attention needs the masks ``generate`` gets.

    Args:
        cache: the engine's paged pools.
        metadata: the forward's attention metadata: its ``slot_mapping`` holds the new tokens' slots,
            row by row (``[B * num_new]`` int64).
        block_tables: each row's block table (device block ids), ``B`` of them.
        pasts: positions each row has stored before this forward (tokens): one int for every row,
            or one per row.
        num_new: new tokens per row.
    """

    is_compileable = False

    def __init__(
        self,
        cache: PagedKVCache,
        metadata: AttentionMetadata,
        block_tables: Sequence[Sequence[int]],
        pasts: Union[int, Sequence[int]],
        num_new: int,
    ) -> None:
        self.cache = cache
        self.metadata = metadata
        self.block_tables = [tuple(t) for t in block_tables]
        self.pasts = [pasts] * len(self.block_tables) if isinstance(pasts, int) else [int(p) for p in pasts]
        self.past = max(self.pasts, default=0)
        self.num_new = num_new
        self.layers_stored: set[int] = set()
        self.is_sliding = [False] * cache.num_layers
        self._past_index: dict = {}  # device -> (slots, destinations): see _past_layout

    @property
    def batch_size(self) -> int:
        """Rows of the forward (requests)."""
        return len(self.block_tables)

    def padding(self) -> list[int]:
        """Per row, the zero keys before its context (``past - pasts[b]``): 0 everywhere for equal rows."""
        return [self.past - p for p in self.pasts]

    def _past_layout(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``(slots, destinations)``, ``[sum(pasts)]`` each: the pool slot of every stored
        position of every row (row by row, positions ascending), and where it goes in the
        ``[B * past]`` left-padded rows (row ``b``'s position ``j`` at ``b * past + past - pasts[b] + j``)."""
        layout = self._past_index.get(device)
        if layout is None:
            bs, past = self.cache.block_size, self.past
            slots: list[int] = []
            dest: list[int] = []
            for b, (t, n) in enumerate(zip(self.block_tables, self.pasts)):
                slots.extend(t[p // bs] * bs + p % bs for p in range(n))
                dest.extend(range(b * past + past - n, (b + 1) * past))
            layout = self._past_index[device] = (
                torch.tensor(slots, dtype=torch.long, device=device),
                torch.tensor(dest, dtype=torch.long, device=device),
            )
        return layout

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this forward's K/V (``[B, KVH, num_new, Dk]`` and ``[B, KVH, num_new, Dv]``) into their
        slots of layer ``layer_idx``'s pools, and return each row's whole context: the stored past
        (read back from the pool, dequantized for an int8 cache; left-padded with zeros to ``past``
        positions where rows differ, see :meth:`padding`) followed by the new K/V as given,
        ``[B, KVH, past + num_new, Dk]`` and ``[B, KVH, past + num_new, Dv]`` in their dtypes.

        Raises:
            ValueError: a layer index outside the pool, a layer storing twice in one forward, or K/V
                whose shape is not the layer pool's (one line: not served by hf_contbatch).
        """
        cache = self.cache
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < cache.num_layers:
            raise ValueError(f"cache.update for layer {layer_idx!r} outside the KV pool: not served by hf_contbatch")
        if layer_idx in self.layers_stored:
            raise ValueError(
                f"the model stores K/V for layer {layer_idx} twice in a forward: not served by hf_contbatch"
            )
        k_pool, v_pool = cache.key_cache[layer_idx], cache.value_cache[layer_idx]
        given_k, given_v = key_states, value_states
        key_states, value_states, repeat = _stored_heads(key_states, value_states, k_pool.shape[2])
        b, n = self.batch_size, self.num_new
        want_k = (b, k_pool.shape[2], n, k_pool.shape[3])
        want_v = (b, v_pool.shape[2], n, v_pool.shape[3])
        if tuple(key_states.shape) != want_k or tuple(value_states.shape) != want_v:
            raise ValueError(
                f"layer {layer_idx} stores K/V of shapes {tuple(given_k.shape)} and {tuple(given_v.shape)}, "
                f"the KV pool holds {want_k} and {want_v}: not served by hf_contbatch"
            )
        self.layers_stored.add(layer_idx)
        meta = self.metadata.to(k_pool.device)
        scales = cache.scales(layer_idx)
        # [B, KVH, n, D] -> [B * n, KVH, D], rows in the metadata's slot order (row by row).
        key = key_states.transpose(1, 2).reshape(b * n, key_states.shape[1], key_states.shape[3])
        value = value_states.transpose(1, 2).reshape(b * n, value_states.shape[1], value_states.shape[3])
        cache.backend.store_kv(key, value, k_pool, v_pool, meta, **scales)  # cast (or quantized) to the pool's
        if not self.past:
            return given_k, given_v
        past_k = self._read_past(k_pool, scales.get("k_scale"), key_states.dtype)
        past_v = self._read_past(v_pool, scales.get("v_scale"), value_states.dtype)
        if repeat > 1:  # the heads the model broadcast, as it broadcast them
            past_k, past_v = past_k.repeat_interleave(repeat, dim=1), past_v.repeat_interleave(repeat, dim=1)
        return (
            torch.cat([past_k.to(given_k.device), given_k], dim=2),
            torch.cat([past_v.to(given_v.device), given_v], dim=2),
        )

    def _read_past(self, pool: torch.Tensor, scales, dtype: torch.dtype) -> torch.Tensor:
        """Every row's stored positions from ``pool`` (dequantized with ``scales`` for an int8 pool)
        as ``[B, KVH, past, D]`` in ``dtype``, left-padded with zeros (see :meth:`padding`)."""
        slots, dest = self._past_layout(pool.device)
        rows = gather_contexts(pool, slots, scales, dtype)[0].transpose(0, 1)  # [sum(pasts), KVH, D]
        b, past = self.batch_size, self.past
        if dest.numel() == b * past:  # no padding: the rows are already in place
            out = rows
        else:
            out = rows.new_zeros((b * past, *rows.shape[1:])).index_copy_(0, dest, rows)
        return out.view(b, past, *rows.shape[1:]).transpose(1, 2)

    def check_stored(self) -> None:
        """Raise ``ValueError`` (one line) unless every layer with pools of its own stored its K/V in
        the forward just run: a model that kept its K/V elsewhere would attend over nothing next step."""
        missing = [i for i in self.cache.owning_layers if i not in self.layers_stored]
        if missing:
            raise ValueError(
                f"the model stored no K/V through cache.update for layers {missing[:8]}: not served by hf_contbatch"
            )

    # --- what transformers asks a cache (as a DynamicCache holding ``past`` tokens per row) ---------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.past + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1  # grows as a DynamicCache does

    @property
    def is_initialized(self) -> bool:
        return self.past > 0


def _stored_heads(key: torch.Tensor, value: torch.Tensor, kv_heads: int) -> tuple:
    """``(key, value, repeat)``: the heads of ``key``/``value`` ``[B, H, n, D]`` to store when the model
    broadcast each of ``kv_heads`` heads to ``repeat`` adjacent ones before ``cache.update`` (Falcon's
    new decoder architecture: its grouped K/V reach the cache expanded to the query heads), with
    ``repeat`` 1 and the tensors unchanged otherwise. Checked, not assumed: heads that are not such
    copies come back whole (and the caller refuses their shape)."""
    heads = key.shape[1]
    if heads == kv_heads or value.shape[1] != heads or heads % kv_heads:
        return key, value, 1
    repeat = heads // kv_heads
    k, v = key[:, ::repeat], value[:, ::repeat]
    if torch.equal(k.repeat_interleave(repeat, dim=1), key) and torch.equal(v.repeat_interleave(repeat, dim=1), value):
        return k, v, repeat
    return key, value, 1
