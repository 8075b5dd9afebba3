"""KV block bookkeeping: free block queue, per-request block tables, reference counts.

Pure Python, no tensors, so it can be tested without a model (the nano-vllm / vLLM v1 split
between the block manager and the cache tensors).
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Owns which KV block belongs to which request.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.

    A request's block table maps its token at position ``p`` to block
    ``table[p // block_size]``, offset ``p % block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_tables: dict[int, list[int]] = {}

    # --- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, request_id: int, total_tokens: int) -> int:
        """Extra blocks ``request_id`` needs so that ``total_tokens`` of its tokens fit."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, self.blocks_for_tokens(total_tokens) - have)

    def get_block_table(self, request_id: int) -> list[int]:
        return self.block_tables.get(request_id, [])

    # --- mutations ---------------------------------------------------------------------------
    def allocate(self, request_id: int, total_tokens: int) -> list[int]:
        """Grow ``request_id``'s block table to hold ``total_tokens`` tokens.

        Returns the newly allocated block ids. Raises ``RuntimeError`` if the pool is short
        (the scheduler checks ``num_blocks_needed`` against its budget first).
        """
        need = self.num_blocks_needed(request_id, total_tokens)
        if need > len(self._free):
            raise RuntimeError(
                f"KV pool exhausted: request {request_id} needs {need} blocks, {len(self._free)} free"
            )
        table = self.block_tables.setdefault(request_id, [])
        new_blocks = [self._free.popleft() for _ in range(need)]
        for b in new_blocks:
            self.ref_counts[b] = 1
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: int) -> int:
        """Release every block of ``request_id``; returns how many returned to the free queue."""
        table = self.block_tables.pop(request_id, None)
        if not table:
            return 0
        released = 0
        # Freed in reverse so the tail blocks (least likely shared) are reused first.
        for b in reversed(table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} double-freed")
            if self.ref_counts[b] == 0:
                self._free.append(b)
                released += 1
        return released

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (used by tests after every iteration)."""
        counted = [0] * self.num_blocks
        for table in self.block_tables.values():
            for b in table:
                counted[b] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free queue"
        for b in range(self.num_blocks):
            assert counted[b] == self.ref_counts[b], f"block {b}: ref count {self.ref_counts[b]} != {counted[b]}"
            assert (b in free) == (counted[b] == 0), f"block {b}: free-queue membership disagrees with use"
