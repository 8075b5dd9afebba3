"""KV block bookkeeping: free block queue, per-request block tables, reference counts, prefix hashes.

Pure Python, no tensors, so it can be tested without a model (the nano-vllm / vLLM v1 split
between the block manager and the cache tensors). The same class serves the device pool and the
host swap pool (the latter without prefix caching).

Prefix caching (vLLM v1 ``BlockPool``, nano-vllm ``BlockManager``): every full, computed block gets a
chained hash ``hash((parent_hash, tokens))`` and enters a hash -> block map. A freed block keeps its
hash and stays in the free queue, reusable by a later request with the same prefix until it is
evicted; the free queue is ordered least-recently-freed first, so eviction is LRU. An *extra key*
(the request's LoRA adapter, ``Request.prefix_cache_key``) seeds the chain as the first block's
parent, as vLLM puts its extra keys into the hash: the same tokens under two keys never share a block.

Sliding-window KV cache group (``sliding_window=W``): a query at position ``q`` reads the keys at
``q - W + 1 .. q`` (W tokens, itself included: transformers' ``kv_idx > q_idx - sliding_window``).
Once a request has computed ``c`` tokens, no future query reads a position below ``c - W + 1``, so
its leading blocks whose every token lies below that are released (:meth:`free_out_of_window`) and
their table entries become :attr:`BlockManager.null_block`: an id one past the pool's blocks that is
never handed out (the pool tensors keep one zeroed block there, so a kernel that reads it in a
masked lane reads zeros, never NaN). Table positions stay logical (``table[p // block_size]``), so
slot mappings and kernels do not change. The null entries are always a leading run of the table.
Prefix caching stays on for such a group: a block's KV depends only on the tokens up to its end,
whatever the windows, so a hashed block is as reusable as under full attention. A hit of ``k``
blocks needs only the blocks its window reads to be cached (from ``first_live_block(k *
block_size)`` on); the entries before are null, whether those blocks were evicted or not. Blocks
released out of the window keep their hash in the free queue (LRU, so the oldest go first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Hashable, Optional, Sequence


def hash_block_tokens(parent_hash: Optional[int], token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: depends on every token before it through ``parent_hash``.

    Python's ``hash`` of a tuple of ints is deterministic across processes (``PYTHONHASHSEED`` only
    salts str/bytes). A hit is also checked against the stored tokens, so only a 64-bit collision of
    two *parent* hashes with equal block tokens could alias two prefixes.
    """
    return hash((parent_hash, tuple(token_ids)))


def chain_root(extra_key: Optional[str]) -> Optional[int]:
    """The parent hash of a chain's first block: None without an extra key (the plain chain), else
    a 64-bit digest of the key (blake2b: deterministic across processes, unlike ``hash`` of a str)."""
    if extra_key is None:
        return None
    return int.from_bytes(hashlib.blake2b(extra_key.encode(), digest_size=8).digest(), "little")


class BlockManager:
    """Owns which KV block belongs to which request.

    Args:
        num_blocks: blocks in the pool (0 is allowed: an empty swap pool).
        block_size: tokens per block.
        enable_prefix_caching: keep hashes of full blocks and reuse them across requests.
        sliding_window: W for a sliding-window KV cache group (blocks no future query can read are
            released as a request advances), None for full attention.

    A request's block table maps its token at position ``p`` to block
    ``table[p // block_size]``, offset ``p % block_size``. Tables are keyed by any hashable (the
    scheduler uses request ids). A block is in the free queue exactly when its ref count is 0;
    free blocks that still carry a hash are "cached" and are evicted (hash dropped) only when the
    queue hands them out again.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        sliding_window: Optional[int] = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or positive, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        # The id of the null block: outside the pool's range, never in the free queue.
        self.null_block = num_blocks
        # Least recently freed first; OrderedDict so a prefix hit can take a block out of the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_tables: dict[Hashable, list[int]] = {}
        self._block_hash: list[Optional[int]] = [None] * num_blocks
        self._block_content: list[Optional[tuple]] = [None] * num_blocks  # (parent hash, tokens), to verify hits
        self._cached: dict[int, int] = {}  # hash -> block
        self._num_hashed: dict[Hashable, int] = {}  # leading blocks of a table already offered to the cache
        self._num_cached_free = 0  # a counter, so stats never iterate the queue the engine thread mutates
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evictions = 0

    # --- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (never-used, freed, and cached-but-unreferenced)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (evictable)."""
        return self._num_cached_free

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up (0.0 before any)."""
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def first_live_block(self, num_computed_tokens: int) -> int:
        """Index of the first table entry a request with ``num_computed_tokens`` computed tokens
        still needs: 0 under full attention; under a window W, the blocks ending before position
        ``num_computed_tokens - W + 1`` (the oldest key any later query reads) are not needed."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    @property
    def max_tokens_per_step(self) -> Optional[int]:
        """Most tokens one request may schedule in a step, or None for no limit.

        Under a window W a step of ``n`` tokens needs the blocks spanning ``W - 1 + n`` positions,
        at most ``ceil((W - 2 + n) / block_size) + 1`` blocks: so a request alone in the pool
        always progresses if ``n <= (num_blocks - 1) * block_size - W + 2``, however long it is
        (a prefill is then cut into chunks). None under full attention (chunking does not lower a
        request's total need) and when the pool cannot hold one window (the window then never frees
        a block within the pool: the group behaves as full attention).
        """
        if self.sliding_window is None:
            return None
        cap = (self.num_blocks - 1) * self.block_size - self.sliding_window + 2
        return cap if cap >= 1 else None

    def step_token_limit(self, num_computed_tokens: int) -> Optional[int]:
        """Most tokens a request with ``num_computed_tokens`` computed may schedule in one step, or
        None for no limit: :attr:`max_tokens_per_step`, or more while its whole context so far and
        the step's tokens fit the pool anyway (a short request's prefill is not cut for nothing)."""
        cap = self.max_tokens_per_step
        if cap is None:
            return None
        return max(cap, self.num_blocks * self.block_size - num_computed_tokens)

    def num_blocks_needed(self, request_id: Hashable, total_tokens: int, num_computed_tokens: int = 0) -> int:
        """Extra blocks ``request_id`` needs so that ``total_tokens`` of its tokens fit, when it has
        ``num_computed_tokens`` computed (a new table under a window starts with null entries for the
        blocks the window no longer reads; a table that exists already has them)."""
        have = max(len(self.block_tables.get(request_id, ())), self.first_live_block(num_computed_tokens))
        return max(0, self.blocks_for_tokens(total_tokens) - have)

    def live_blocks(self, request_id: Hashable) -> list[int]:
        """The blocks ``request_id`` holds: its table without the null entries."""
        return [b for b in self.block_tables.get(request_id, ()) if b != self.null_block]

    def get_block_table(self, request_id: Hashable) -> list[int]:
        return self.block_tables.get(request_id, [])

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def is_cached(self, block: int) -> bool:
        """True when ``block`` carries a prefix hash (it serves hits while it is not evicted)."""
        return self._block_hash[block] is not None

    def num_hashed_blocks(self, request_id: Hashable) -> int:
        """Leading blocks of ``request_id``'s table already offered to the prefix cache."""
        return self._num_hashed.get(request_id, 0)

    # --- prefix caching ----------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix hash (vLLM's ``reset_prefix_cache``). Only with no block in use
        and no request tracked, so nothing running loses a hit it holds; returns False otherwise,
        changing nothing. The free queue keeps its order; counters (hit rate) are kept."""
        if self.num_used_blocks or self.block_tables or self._num_hashed:
            return False
        self._block_hash = [None] * self.num_blocks
        self._block_content = [None] * self.num_blocks
        self._cached.clear()
        self._num_cached_free = 0
        return True

    def update_block_hashes(
        self, token_ids: Sequence[int], block_hashes: list[int], extra_key: Optional[str] = None
    ) -> list[int]:
        """Extend ``block_hashes`` in place to cover every full block of ``token_ids``; returns it.
        ``extra_key``: what besides the tokens decides the blocks' KV (see :func:`chain_root`)."""
        bs = self.block_size
        parent = block_hashes[-1] if block_hashes else chain_root(extra_key)
        for i in range(len(block_hashes), len(token_ids) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            block_hashes.append(parent)
        return block_hashes

    def match_prefix(
        self,
        token_ids: Sequence[int],
        block_hashes: list[int],
        extra_key: Optional[str] = None,
        max_blocks: Optional[int] = None,
    ) -> list[int]:
        """Cached blocks holding the longest full-block prefix of ``token_ids`` under ``extra_key``
        (read-only).

        At most ``(len(token_ids) - 1) // block_size`` blocks (and ``max_blocks``): at least one
        token is always recomputed, because the step that computes the last token is the one that
        samples. Under a window a prefix of ``k`` blocks needs only the blocks its window reads
        (from :meth:`first_live_block` of ``k * block_size``) to be cached: the entries before are
        the null block, whether or not those blocks were evicted.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        self.update_block_hashes(token_ids, block_hashes, extra_key)
        limit = (len(token_ids) - 1) // bs
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        found: list[Optional[int]] = []  # the verified cached block of each full block, or None
        parent = chain_root(extra_key)
        for i in range(limit):
            h = block_hashes[i]
            b = self._cached.get(h)
            ok = b is not None and self._block_content[b] == (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            if not ok and self.sliding_window is None:
                break  # full attention needs every block before the hit's end
            found.append(b if ok else None)
            parent = h
        # The longest k whose blocks from first_live_block(k * bs) to k are all found.
        run = 0  # found blocks ending at index k - 1
        best = 0
        for k in range(1, len(found) + 1):
            run = run + 1 if found[k - 1] is not None else 0
            if run >= k - self.first_live_block(k * bs):
                best = k
        first = self.first_live_block(best * bs)
        hits = found[first:best]
        assert None not in hits, "a hit's window reads a block that is not cached"
        return [self.null_block] * first + hits

    def num_blocks_needed_with_prefix(
        self, prefix_blocks: Sequence[int], total_tokens: int, num_computed_tokens: Optional[int] = None
    ) -> int:
        """Free-queue blocks a new table needs for ``total_tokens`` when it starts with ``prefix_blocks``
        and has ``num_computed_tokens`` computed (default: the prefix's tokens): fresh blocks for the
        rest, plus every hit the window still reads that is itself sitting free (cached, ref count 0)."""
        computed = len(prefix_blocks) * self.block_size if num_computed_tokens is None else num_computed_tokens
        first = self.first_live_block(computed)
        fresh = max(0, self.blocks_for_tokens(total_tokens) - max(len(prefix_blocks), first))
        return fresh + sum(1 for b in prefix_blocks[first:] if self.ref_counts[b] == 0)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_query_tokens += num_query_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def cache_full_blocks(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        block_hashes: list[int],
        num_computed_tokens: int,
        extra_key: Optional[str] = None,
    ) -> None:
        """Register the blocks of ``request_id`` that are full and computed in the hash map
        (``extra_key`` as for :meth:`match_prefix`).

        A block whose content is already cached under another block stays unhashed (no dedup, as in
        vLLM); its twin keeps serving hits.
        """
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request_id)
        if table is None:
            return
        full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_hashed.get(request_id, 0)
        if full <= start:
            return
        self.update_block_hashes(token_ids[: full * self.block_size], block_hashes, extra_key)
        bs = self.block_size
        root = chain_root(extra_key)
        for i in range(start, full):
            b = table[i]
            h = block_hashes[i]
            if b == self.null_block or self._block_hash[b] is not None or h in self._cached:
                continue
            self._cached[h] = b
            self._block_hash[b] = h
            self._block_content[b] = (block_hashes[i - 1] if i else root, tuple(token_ids[i * bs : (i + 1) * bs]))
        self._num_hashed[request_id] = full

    # --- mutations ---------------------------------------------------------------------------
    def _pop_free_block(self) -> int:
        b, _ = self._free.popitem(last=False)
        h = self._block_hash[b]
        if h is not None:  # eviction: the block is reused, its prefix is gone
            self._num_cached_free -= 1
            del self._cached[h]
            self._block_hash[b] = None
            self._block_content[b] = None
            self.num_evictions += 1
        self.ref_counts[b] = 1
        return b

    def allocate(
        self,
        request_id: Hashable,
        total_tokens: int,
        prefix_blocks: Sequence[int] = (),
        num_computed_tokens: Optional[int] = None,
    ) -> list[int]:
        """Grow ``request_id``'s block table to hold ``total_tokens`` tokens.

        Args:
            prefix_blocks: cached blocks (from ``match_prefix``) a *new* table starts with; they are
                shared (ref count + 1), not copied.
            num_computed_tokens: the request's computed tokens (default: the prefix's tokens). Under
                a window, new entries before :meth:`first_live_block` of it are null entries, and
                so are the hits there (not taken): a request resumed or admitted deep into its
                sequence holds only its window.

        Returns the newly allocated (fresh) block ids. Raises ``RuntimeError`` if the pool is short
        (the scheduler checks its budget first) or if ``prefix_blocks`` is given for an existing table.
        """
        if prefix_blocks and request_id in self.block_tables:
            raise RuntimeError(f"prefix blocks given for request {request_id}, which already has a block table")
        table = self.block_tables.get(request_id)
        if table is not None and not prefix_blocks and len(table) >= -(-total_tokens // self.block_size):
            # The table holds the tokens already (a decode inside its last block: most rows of most
            # steps): nothing to add, and the general path below would add nothing either.
            return []
        computed = len(prefix_blocks) * self.block_size if num_computed_tokens is None else num_computed_tokens
        need = (
            self.num_blocks_needed_with_prefix(prefix_blocks, total_tokens, computed)
            if prefix_blocks
            else self.num_blocks_needed(request_id, total_tokens, computed)
        )
        if need > len(self._free):
            raise RuntimeError(f"KV pool exhausted: request {request_id} needs {need} blocks, {len(self._free)} free")
        table = self.block_tables.setdefault(request_id, [])
        first = self.first_live_block(computed)
        for i, b in enumerate(prefix_blocks):
            if i < first:  # a hit the window no longer reads
                table.append(self.null_block)
                continue
            if self.ref_counts[b] == 0:
                del self._free[b]
                self._num_cached_free -= 1
            self.ref_counts[b] += 1
            table.append(b)
        if prefix_blocks:
            self._num_hashed[request_id] = len(prefix_blocks)
        table.extend([self.null_block] * max(0, min(first, self.blocks_for_tokens(total_tokens)) - len(table)))
        new_blocks = [self._pop_free_block() for _ in range(self.blocks_for_tokens(total_tokens) - len(table))]
        table.extend(new_blocks)
        return new_blocks

    def fork(self, parent_id: Hashable, child_id: Hashable, num_computed_tokens: int) -> Optional[tuple[int, int]]:
        """Give ``child_id`` the parent's first ``num_computed_tokens`` tokens of KV.

        Full blocks are shared (ref count + 1). A partial last block is copied at once into a fresh
        block, because the child's very next token is written into it (copy-on-write, done eagerly:
        every child writes in the step it is forked). Returns that ``(src, dst)`` copy, or None.
        Raises ``RuntimeError`` if the child already has a table or the pool is empty.
        """
        if child_id in self.block_tables:
            raise RuntimeError(f"fork target {child_id} already has a block table")
        parent = self.block_tables[parent_id]
        num_full, partial = divmod(num_computed_tokens, self.block_size)
        if partial and not self._free:
            raise RuntimeError(f"KV pool exhausted: fork of request {parent_id} needs 1 block, 0 free")
        table = list(parent[:num_full])
        for b in table:
            if b != self.null_block:  # the window's null entries are shared as they are
                self.ref_counts[b] += 1
        self.block_tables[child_id] = table
        self._num_hashed[child_id] = min(self._num_hashed.get(parent_id, 0), num_full)
        if not partial:
            return None
        dst = self._pop_free_block()
        table.append(dst)
        return parent[num_full], dst

    def free(self, request_id: Hashable) -> int:
        """Release every block of ``request_id``; returns how many returned to the free queue."""
        table = self.block_tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        return self._release(table) if table else 0

    def free_out_of_window(self, request_id: Hashable, num_computed_tokens: int) -> int:
        """Release the blocks of ``request_id`` no future query reads once ``num_computed_tokens``
        of its tokens are computed (entries before :meth:`first_live_block`), putting the null block
        in their place; returns how many returned to the free queue. Nothing under full attention.
        Run after the request's full blocks were offered to the prefix cache: a released block
        keeps its hash and serves later hits until it is evicted."""
        table = self.block_tables.get(request_id)
        if not table or self.sliding_window is None:
            return 0
        out: list[int] = []
        # The null entries are a leading run: walk back from the first live entry until one.
        i = min(self.first_live_block(num_computed_tokens), len(table)) - 1
        while i >= 0 and table[i] != self.null_block:
            out.append(table[i])
            table[i] = self.null_block
            i -= 1
        # Oldest first into the free queue's tail (``_release`` walks its argument backwards).
        return self._release(out)

    def _release(self, blocks: Sequence[int]) -> int:
        """Drop one reference to each block (null entries skipped); those at 0 return to the free queue."""
        released = 0
        # Reverse order: a sequence's tail blocks are evicted before its head, which more requests share.
        for b in reversed(blocks):
            if b == self.null_block:
                continue
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} double-freed")
            if self.ref_counts[b] == 0:
                self._free[b] = None
                if self._block_hash[b] is None:  # nothing worth keeping: hand it out first
                    self._free.move_to_end(b, last=False)
                else:
                    self._num_cached_free += 1
                released += 1
        return released

    def trim(self, request_id: Hashable, num_tokens: int) -> int:
        """Release the blocks of ``request_id``'s table beyond what ``num_tokens`` tokens need
        (the KV of rejected speculative tokens); returns how many were released (0 for an unknown
        request). Trailing blocks past the computed tokens are never hashed, so they return to the
        front of the free queue. Raises ``RuntimeError`` if a block's ref count would go negative."""
        table = self.block_tables.get(request_id)
        keep = self.blocks_for_tokens(num_tokens)
        if not table or len(table) <= keep:
            return 0
        released = self._release(table[keep:])
        del table[keep:]
        return released

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (used by tests after every iteration).

        Ref counts equal table memberships; a block is free exactly when unreferenced; no table
        holds a block twice; null entries only under a window and only as a leading run; the
        hash -> block map and the per-block hashes agree both ways.
        """
        counted = [0] * self.num_blocks
        null = self.null_block
        for rid, table in self.block_tables.items():
            live = [b for b in table if b != null]
            assert len(set(live)) == len(live), f"table of {rid} holds a block twice"
            assert table[: len(table) - len(live)] == [null] * (len(table) - len(live)), (
                f"table of {rid}: null entries not a leading run"
            )
            assert self.sliding_window is not None or len(live) == len(table), f"null entries in {rid}'s table"
            for b in live:
                counted[b] += 1
        for b in range(self.num_blocks):
            assert counted[b] == self.ref_counts[b], f"block {b}: ref count {self.ref_counts[b]} != {counted[b]}"
            assert (b in self._free) == (counted[b] == 0), f"block {b}: free-queue membership disagrees with use"
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"hash map sends {h} to block {b}, which carries {self._block_hash[b]}"
        for b, h in enumerate(self._block_hash):
            if h is not None:
                assert self._cached.get(h) == b, f"block {b} carries hash {h} missing from the hash map"
                assert self._block_content[b] is not None, f"hashed block {b} has no recorded content"
        assert self.enable_prefix_caching or not self._cached, "hashes recorded with prefix caching off"
        cached_free = sum(1 for b in self._free if self._block_hash[b] is not None)
        assert cached_free == self._num_cached_free, f"cached-free counter {self._num_cached_free} != {cached_free}"
