"""Persistent host and device tensors that a step's flattened inputs are copied into.

The runner builds a step's token ids, positions, slot mapping, query start locations, sequence
lengths and block tables as Python ints (a step's few hundred rows: cheaper than tensor ops) and
copies each into a preallocated buffer with one NumPy assignment, instead of allocating a new tensor
per input per step; on an accelerator, each buffer then reaches its persistent device twin in one
copy from pinned memory, queued without waiting. The tensors handed out are slices of the buffers:
valid until the next step fills them again (as vLLM v1's input batch, which CUDA-graph capture and
an overlapped scheduler need: fixed addresses, no per-step allocation).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["InputBuffers"]

# name -> (dtype, extra entries beyond the capacity, which dimension sizes it)
_LAYOUT = {
    "input_ids": (torch.int64, 0, "tokens"),
    "positions": (torch.int64, 0, "tokens"),
    "slot_mapping": (torch.int64, 0, "tokens"),
    "query_start_loc": (torch.int32, 1, "tokens"),  # one more than the rows of the metadata
    "seq_lens": (torch.int32, 0, "tokens"),  # the metadata's rows are at most the step's tokens
    "logits_rows": (torch.int64, 0, "tokens"),
    "block_tables": (torch.int32, 0, "table"),
}


class InputBuffers:
    """Preallocated 1-D buffers, one per step input, grown (doubled) when a step needs more.

    Args:
        device: where the model reads its inputs; on ``cpu`` the host buffers are handed out.
        num_tokens: initial capacity in rows of the flattened batch (``max_num_batched_tokens``
            avoids any growth: a step's metadata never has more rows than tokens).
        num_table_entries: initial capacity of the flattened ``[rows, max_blocks]`` block table.
    """

    def __init__(self, device: torch.device, num_tokens: int = 256, num_table_entries: int = 4096) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._capacity = {"tokens": 0, "table": 0}
        self._host: dict[str, torch.Tensor] = {}
        self._host_np: dict[str, np.ndarray] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._grow(max(1, num_tokens), max(1, num_table_entries))

    @torch.inference_mode(False)
    def _grow(self, num_tokens: int, num_table_entries: int) -> None:
        # Ordinary tensors even when a step (in inference mode) grows them: a compiled forward
        # guards on its inputs' dispatch keys, and an inference tensor would compile a new graph.
        self._capacity = {"tokens": num_tokens, "table": num_table_entries}
        for name, (dtype, extra, dim) in _LAYOUT.items():
            host = torch.zeros(self._capacity[dim] + extra, dtype=dtype, pin_memory=self._pin)
            self._host[name] = host
            self._host_np[name] = host.numpy()
            self._device[name] = host if self.device.type == "cpu" else torch.zeros_like(host, device=self.device)

    def reserve(self, num_tokens: int, num_table_entries: int) -> None:
        """Make room for a step of ``num_tokens`` rows and a block table of ``num_table_entries``
        entries (buffers at least double when they grow, so growth stops early)."""
        tokens, table = self._capacity["tokens"], self._capacity["table"]
        if num_tokens > tokens or num_table_entries > table:
            self._grow(
                max(tokens, num_tokens, 2 * tokens if num_tokens > tokens else 0),
                max(table, num_table_entries, 2 * table if num_table_entries > table else 0),
            )

    def fill(self, name: str, values: Sequence[int]) -> torch.Tensor:
        """Copy ``values`` into buffer ``name`` (after ``reserve``); returns the device slice
        ``[len(values)]`` holding them (valid until the next ``fill`` of that buffer)."""
        n = len(values)
        self._host_np[name][:n] = values
        if self.device.type == "cpu":
            return self._host[name][:n]
        dst = self._device[name][:n]
        dst.copy_(self._host[name][:n], non_blocking=self._pin)
        return dst

    def fill_block_tables(self, tables: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        """The rows of ``tables`` padded with 0 to ``width`` blocks, as a contiguous int32
        ``[len(tables), width]`` device tensor (slice of the buffer, valid until the next fill)."""
        flat: list[int] = []
        for t in tables:
            flat.extend(t)
            if len(t) < width:
                flat.extend([0] * (width - len(t)))
        return self.fill("block_tables", flat).view(len(tables), width)
