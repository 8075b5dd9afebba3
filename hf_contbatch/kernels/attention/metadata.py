"""One step's attention metadata: where each new token's K/V goes and which context each request
reads. Built once a step by the engine's attention backend (``AttentionBackend.build_metadata``)
and handed to the model through the step's cache view (``PagedKVCache.for_step``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs about one flattened, unpadded step.

    Requests are ordered decodes first (one query token each), then prefill chunks.

    Attributes:
        slot_mapping: int64 ``[T]``; flat slot ``block * block_size + offset`` of each new token.
        query_start_loc: int32 ``[B + 1]``; cumulative query lengths.
        seq_lens: int32 ``[B]``; context length of each request including this step's tokens.
        block_tables: int32 ``[B, max_blocks]``; padded with 0 (never read past ``seq_lens``).
        num_decodes: the first ``num_decodes`` requests have exactly one query token.
        max_query_len, max_seq_len: maxima over the batch (ints, for kernel grids).
        query_start_loc_cpu, seq_lens_cpu: the same as Python lists (the torch path loops on them).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    num_kv_heads: int = 0
    # Per-step derived tensors shared by every layer (built lazily once, then reused).
    _derived: dict = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)

    def derived(self, key, builder):
        """Memoise a per-step tensor (masks, gather indices) across layers."""
        value = self._derived.get(key)
        if value is None:
            value = builder()
            self._derived[key] = value
        return value

    def query_positions(self) -> torch.Tensor:
        """int64 ``[T]``: the position of each query row in its request (a request's rows are the
        last ``q_len`` positions of its ``seq_len``), on the metadata's device; built once a step."""

        def build() -> torch.Tensor:
            qsl, lens = self.query_start_loc_cpu, self.seq_lens_cpu
            parts = [torch.arange(n - (b - a), n) for a, b, n in zip(qsl, qsl[1:], lens)]
            return torch.cat(parts).to(self.slot_mapping.device)

        return self.derived(("query_positions",), build)

    def to(self, device: torch.device) -> "AttentionMetadata":
        """This metadata with its tensors on ``device`` (memoised; for models spread by device_map)."""
        if self.slot_mapping.device == device:
            return self
        return self.derived(
            ("to", str(device)),
            lambda: AttentionMetadata(
                slot_mapping=self.slot_mapping.to(device),
                query_start_loc=self.query_start_loc.to(device),
                seq_lens=self.seq_lens.to(device),
                block_tables=self.block_tables.to(device),
                num_decodes=self.num_decodes,
                max_query_len=self.max_query_len,
                max_seq_len=self.max_seq_len,
                query_start_loc_cpu=self.query_start_loc_cpu,
                seq_lens_cpu=self.seq_lens_cpu,
                block_size=self.block_size,
                num_kv_heads=self.num_kv_heads,
            ),
        )
