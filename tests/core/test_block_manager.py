"""Block manager specifications: pure bookkeeping, no model and no torch.

Expected values are arithmetic on the pool: ``ceil(tokens / block_size)`` blocks per table, a free
queue that hands out never-used blocks in id order, freed unhashed blocks first and cached blocks
least recently freed first, and ref counts equal to table memberships.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from hf_contbatch.core.block_manager import BlockManager, hash_block_tokens


def _tokens(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


# --- allocate / free ------------------------------------------------------------------------------
def test_allocate_grows_a_table_to_ceil_tokens_over_block_size_and_returns_only_the_new_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]  # ceil(5 / 4) = 2 blocks, never-used ones in id order
    assert bm.allocate("a", 8) == []  # 8 tokens still fit in 2 blocks
    assert bm.allocate("a", 9) == [2]
    assert bm.get_block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert bm.ref_counts[:4] == [1, 1, 1, 0]
    bm.check_invariants()


def test_blocks_for_tokens_and_num_blocks_needed_are_ceil_division():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.blocks_for_tokens(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert bm.num_blocks_needed("unknown", 9) == 3
    bm.allocate("a", 5)
    assert (bm.num_blocks_needed("a", 8), bm.num_blocks_needed("a", 9), bm.num_blocks_needed("a", 3)) == (0, 1, 0)


def test_free_returns_every_block_of_the_table_and_they_are_handed_out_again():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 12)
    bm.allocate("b", 4)
    assert bm.free("a") == 3
    assert bm.free("a") == 0  # a second free of the same request does nothing
    assert bm.free("never-allocated") == 0
    assert bm.num_free_blocks == 7 and bm.get_block_table("a") == []
    # Freed blocks without a prefix hash go to the front of the queue: reused before untouched ones.
    assert bm.allocate("c", 12) == [0, 1, 2]
    bm.check_invariants()


def test_over_allocation_raises_and_leaves_the_pool_unchanged():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 12)  # 3 of 4 blocks
    with pytest.raises(RuntimeError, match="KV pool exhausted: request b needs 2 blocks, 1 free"):
        bm.allocate("b", 8)
    with pytest.raises(RuntimeError, match="KV pool exhausted"):
        bm.allocate("a", 20)  # growing an existing table: 5 blocks, 3 held, 2 needed
    assert bm.num_free_blocks == 1 and "b" not in bm.block_tables and bm.get_block_table("a") == [0, 1, 2]
    bm.check_invariants()


def test_can_allocate_is_true_up_to_the_free_block_count():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert [bm.can_allocate(n) for n in (0, 3, 4)] == [True, True, False]
    bm.allocate("a", 3)  # 2 blocks
    assert [bm.can_allocate(n) for n in (1, 2)] == [True, False]
    empty_swap_pool = BlockManager(num_blocks=0, block_size=2)
    assert empty_swap_pool.can_allocate(0) and not empty_swap_pool.can_allocate(1)


# --- forks and copy-on-write ------------------------------------------------------------------------
def test_fork_shares_the_full_blocks_and_copies_the_partial_last_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("parent", 6)  # blocks 0 (full) and 1 (2 of 4 tokens)
    copy = bm.fork("parent", "child", 6)
    assert copy == (1, 2)  # the partial block 1 is copied into the next free block, 2
    assert bm.get_block_table("child") == [0, 2]
    assert bm.ref_counts[:3] == [2, 1, 1]
    assert bm.num_free_blocks == 5
    bm.check_invariants()
    assert bm.free("parent") == 1  # block 0 stays with the child
    assert bm.free("child") == 2
    assert bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8


def test_fork_at_a_block_boundary_shares_every_block_and_copies_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("parent", 8)
    assert bm.fork("parent", "child", 8) is None
    assert bm.get_block_table("child") == [0, 1] and bm.ref_counts[:2] == [2, 2]
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_fork_errors_for_an_existing_target_and_for_an_empty_pool():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("parent", 6)  # both blocks
    with pytest.raises(RuntimeError, match="fork of request parent needs 1 block, 0 free"):
        bm.fork("parent", "child", 6)
    assert "child" not in bm.block_tables
    bm.fork("parent", "child", 4)  # a whole block: nothing to copy
    with pytest.raises(RuntimeError, match="already has a block table"):
        bm.fork("parent", "child", 4)
    bm.check_invariants()


# --- trim ---------------------------------------------------------------------------------------------
def test_trim_releases_the_blocks_beyond_the_kept_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 11)  # blocks 0, 1, 2
    assert bm.trim("a", 5) == 1  # 5 tokens keep ceil(5 / 4) = 2 blocks
    assert bm.get_block_table("a") == [0, 1]
    assert bm.trim("a", 8) == 0 and bm.trim("unknown", 3) == 0
    assert bm.allocate("b", 1) == [2]  # the trimmed block is handed out first
    bm.check_invariants()


def test_trimming_a_shared_block_drops_one_reference_and_frees_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("parent", 8)
    bm.fork("parent", "child", 8)
    assert bm.trim("child", 4) == 0
    assert bm.get_block_table("child") == [0] and bm.ref_counts[:2] == [2, 1]
    assert bm.num_free_blocks == 2
    bm.check_invariants()


# --- prefix caching -------------------------------------------------------------------------------------
def test_full_computed_blocks_get_chained_hashes_and_a_later_prompt_hits_them():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(10)
    hashes: list[int] = []
    bm.allocate("a", 10)  # blocks 0, 1, 2
    bm.cache_full_blocks("a", tokens, hashes, num_computed_tokens=10)
    h0 = hash((None, tuple(tokens[0:4])))
    h1 = hash((h0, tuple(tokens[4:8])))
    assert hashes == [h0, h1] == [hash_block_tokens(None, tokens[0:4]), hash_block_tokens(h0, tokens[4:8])]
    assert [bm.is_cached(b) for b in (0, 1, 2)] == [True, True, False]  # block 2 is not full
    assert bm.num_hashed_blocks("a") == 2
    # Same first 8 tokens, another tail: both full blocks hit while "a" still holds them.
    other = tokens[:8] + [99, 98, 97]
    hits = bm.match_prefix(other, [])
    assert hits == [0, 1]
    assert bm.num_blocks_needed_with_prefix(hits, len(other)) == 1  # ceil(11 / 4) - 2 hits; hits are held
    assert bm.allocate("b", len(other), prefix_blocks=hits) == [3]
    assert bm.get_block_table("b") == [0, 1, 3] and bm.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.num_hashed_blocks("b") == 2
    bm.check_invariants()


def test_a_prefix_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(8)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", tokens, [], 8)
    # 8 identical tokens: at most (8 - 1) // 4 = 1 block may hit (the last token samples).
    assert bm.match_prefix(tokens, []) == [0]
    assert bm.match_prefix(tokens + [5], []) == [0, 1]


def test_hits_follow_the_hash_chain_a_changed_first_block_hits_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(12)
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", tokens, [], 12)
    changed_first = [0] + tokens[1:]  # same second and third blocks, different first
    assert bm.match_prefix(changed_first + [1], []) == []
    changed_second = tokens[:4] + [0] + tokens[5:]
    assert bm.match_prefix(changed_second + [1], []) == [0]


def test_an_extra_key_seeds_the_chain_so_the_same_tokens_under_two_keys_never_share_a_block():
    # The request's LoRA adapter is the extra key (vLLM's extra keys): a 64-bit blake2b digest of it
    # is the first block's parent; no key is the plain chain.
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(9)
    cached = {}
    for key in (None, "sql", "chat"):
        hashes: list[int] = []
        bm.allocate(key or "base", 9)
        bm.cache_full_blocks(key or "base", tokens, hashes, 9, extra_key=key)
        cached[key] = hashes
    root = int.from_bytes(hashlib.blake2b(b"sql", digest_size=8).digest(), "little")
    assert cached["sql"][0] == hash((root, tuple(tokens[0:4])))
    assert cached[None][0] == hash((None, tuple(tokens[0:4])))  # unchanged without a key
    assert len({h for hs in cached.values() for h in hs}) == 6  # three keys, two full blocks each
    for key, owner in ((None, "base"), ("sql", "sql"), ("chat", "chat")):
        assert bm.match_prefix(tokens, [], extra_key=key) == bm.get_block_table(owner)[:2]
    assert bm.match_prefix(tokens, [], extra_key="poem") == []
    bm.check_invariants()


def test_reset_prefix_cache_is_refused_while_a_block_is_in_use_then_forgets_every_prefix():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(10)
    bm.allocate("a", 10)
    bm.cache_full_blocks("a", tokens, [], num_computed_tokens=10)
    assert bm.reset_prefix_cache() is False  # "a" holds its blocks: nothing changes
    assert bm.match_prefix(tokens, []) == [0, 1]
    bm.free("a")
    assert bm.num_cached_free_blocks == 2 and bm.match_prefix(tokens, []) == [0, 1]
    assert bm.reset_prefix_cache() is True
    assert bm.num_cached_free_blocks == 0 and bm.match_prefix(tokens, []) == []
    assert not any(bm.is_cached(b) for b in range(8)) and bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_caching_off_never_hashes_or_hits():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = _tokens(9)
    bm.allocate("a", 9)
    bm.cache_full_blocks("a", tokens, [], 9)
    assert not bm.is_cached(0) and bm.match_prefix(tokens, []) == []
    bm.check_invariants()


def test_the_same_content_computed_twice_is_cached_under_one_block_only():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(5)
    bm.allocate("a", 5)  # block 0 full
    bm.allocate("b", 5)  # computed separately (no lookup): block 2 holds the same tokens
    bm.cache_full_blocks("a", tokens, [], 5)
    bm.cache_full_blocks("b", tokens, [], 5)
    assert bm.is_cached(0) and not bm.is_cached(2)
    assert bm.match_prefix(tokens, []) == [0]
    bm.check_invariants()


def test_a_freed_cached_block_serves_hits_until_the_queue_hands_it_out_tail_blocks_first():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(9)
    bm.allocate("a", 8)  # blocks 0, 1
    bm.cache_full_blocks("a", tokens, [], 8)
    bm.free("a")  # queue [2, 3] + [1, 0]: the tail block 1 is freed first, so it is evicted first
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    hits = bm.match_prefix(tokens, [])
    assert hits == [0, 1]
    assert bm.num_blocks_needed_with_prefix(hits, 9) == 3  # 1 fresh + 2 hits that sit in the free queue
    assert bm.allocate("b", 12) == [2, 3, 1]  # the third block evicts block 1's prefix
    assert bm.num_evictions == 1 and bm.num_cached_free_blocks == 1
    assert not bm.is_cached(1) and bm.is_cached(0)
    assert bm.match_prefix(tokens, []) == [0]
    bm.check_invariants()


def test_freed_blocks_without_a_hash_are_handed_out_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    bm.allocate("a", 6)  # block 0 full (hashed below), block 1 partial
    bm.cache_full_blocks("a", _tokens(6), [], 6)
    bm.free("a")  # block 1 to the front, cached block 0 to the back: [1, 2, 3, 0]
    assert bm.allocate("b", 12) == [1, 2, 3]
    assert bm.is_cached(0) and bm.num_evictions == 0
    assert bm.allocate("c", 1) == [0]  # only now is the prefix evicted
    assert bm.num_evictions == 1
    bm.check_invariants()


def test_taking_a_cached_free_block_as_a_prefix_hit_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    tokens = _tokens(5)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", tokens, [], 4)
    bm.free("a")
    assert bm.allocate("b", 5, prefix_blocks=[0]) == [1]
    assert bm.get_block_table("b") == [0, 1] and bm.ref_counts[:2] == [1, 1]
    assert bm.num_free_blocks == 2 and bm.num_cached_free_blocks == 0 and bm.num_evictions == 0
    bm.check_invariants()


def test_prefix_blocks_for_an_existing_table_raise():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", _tokens(4), [], 4)
    bm.allocate("b", 1)
    with pytest.raises(RuntimeError, match="already has a block table"):
        bm.allocate("b", 5, prefix_blocks=[0])


def test_prefix_hit_rate_is_hit_tokens_over_looked_up_tokens():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    assert bm.prefix_hit_rate == 0.0
    bm.record_prefix_lookup(10, 8)
    bm.record_prefix_lookup(6, 0)
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens, bm.prefix_hit_rate) == (16, 8, 0.5)


# --- no leaks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_every_block_is_free_after_freeing_every_table_whatever_happened_before(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    bm = BlockManager(num_blocks=24, block_size=bs, enable_prefix_caching=rng.random() < 0.5)
    prompts = [_tokens(rng.randint(1, 12), start=rng.choice([10, 10, 50])) for _ in range(4)]
    computed: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    hashes: dict[int, list[int]] = {}
    for _ in range(200):
        rid = rng.randint(0, 11)
        op = rng.choice(["allocate", "grow", "fork", "trim", "cache", "free"])
        try:
            if op == "allocate" and rid not in computed:
                tokens[rid], hashes[rid] = list(rng.choice(prompts)), []
                hits = bm.match_prefix(tokens[rid], hashes[rid])
                bm.allocate(rid, len(tokens[rid]), prefix_blocks=hits)
                computed[rid] = len(tokens[rid])
            elif op == "grow" and rid in computed:
                tokens[rid] += [rng.randint(3, 60) for _ in range(rng.randint(1, 5))]
                bm.allocate(rid, len(tokens[rid]))
                computed[rid] = len(tokens[rid])
            elif op == "fork" and rid in computed:
                child = rng.randint(0, 11)
                if child not in computed:
                    n = rng.randint(0, computed[rid])
                    bm.fork(rid, child, n)
                    tokens[child], hashes[child], computed[child] = tokens[rid][:n], [], n
            elif op == "trim" and rid in computed:
                computed[rid] = rng.randint(0, computed[rid])
                tokens[rid] = tokens[rid][: computed[rid]]
                hashes[rid] = hashes[rid][: computed[rid] // bs]
                bm.trim(rid, computed[rid])
            elif op == "cache" and rid in computed:
                bm.cache_full_blocks(rid, tokens[rid], hashes[rid], computed[rid])
            elif op == "free" and rid in computed:
                bm.free(rid)
                del computed[rid]
        except RuntimeError as exc:
            assert "KV pool exhausted" in str(exc)  # the only allowed failure: the pool is full
        bm.check_invariants()
    for rid in list(computed):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == 24 and bm.num_used_blocks == 0
    assert bm.ref_counts == [0] * 24 and bm.block_tables == {}


# --- sliding-window groups ------------------------------------------------------------------------
# A query at position q reads q - W + 1 .. q, so after c computed tokens the blocks ending before
# c - W + 1 are no longer read: the first (c - W + 1) // block_size entries of the table (when positive).
def _first_live(c: int, window: int, bs: int) -> int:
    return max(0, (c - window + 1) // bs)


@pytest.mark.parametrize("window, bs", [(6, 4), (1, 4), (4, 4), (5, 1), (16, 16), (17, 8)])
def test_a_decoding_request_holds_only_the_blocks_its_window_still_reads(window, bs):
    bm = BlockManager(num_blocks=40, block_size=bs, sliding_window=window)
    null = bm.null_block
    bm.allocate("a", 3)  # a 3-token prompt
    for c in range(3, 120):  # c tokens computed; the next step computes token c
        released = bm.free_out_of_window("a", c)
        bm.allocate("a", c + 1)
        table = bm.get_block_table("a")
        first = _first_live(c, window, bs)
        total = -(-(c + 1) // bs)
        assert len(table) == total  # positions stay logical
        assert table[:first] == [null] * first and null not in table[first:]
        assert bm.num_used_blocks == total - first
        # A whole block is released each time the window's edge crosses a block boundary.
        assert released == first - _first_live(c - 1, window, bs) if c > 3 else released == first
        bm.check_invariants()
    used = bm.num_used_blocks
    assert bm.free("a") == used  # finishing releases only the live blocks: the null entries hold none
    assert bm.num_free_blocks == bm.num_blocks and bm.block_tables == {}


def test_window_counts_by_arithmetic():
    # bs 4, W 6: 10 computed -> oldest read position 5 -> block 0 (0..3) goes, block 1 (4..7) stays.
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    assert bm.allocate("a", 10) == [0, 1, 2]
    assert bm.free_out_of_window("a", 10) == 1
    assert bm.get_block_table("a") == [8, 1, 2] and bm.null_block == 8
    assert bm.free_out_of_window("a", 10) == 0  # nothing more until the window moves
    assert bm.allocate("a", 13) == [0]  # the released block, unhashed, is handed out first
    # 13 computed -> oldest read position 8 -> blocks 0 and 1 (0..7) are out.
    assert bm.free_out_of_window("a", 13) == 1
    assert bm.get_block_table("a") == [8, 8, 2, 0] and bm.num_free_blocks == 6
    assert bm.free("a") == 2 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_the_null_block_is_never_handed_out_and_a_window_can_fill_the_whole_pool():
    bm = BlockManager(num_blocks=5, block_size=2, sliding_window=3)
    handed = bm.allocate("a", 10)  # every block of the pool
    assert handed == [0, 1, 2, 3, 4] and bm.num_free_blocks == 0
    for c in range(10, 60):  # the window keeps moving: released blocks come back, never the null one
        bm.free_out_of_window("a", c)
        handed += bm.allocate("a", c + 1)
        assert bm.num_used_blocks == -(-(c + 1) // 2) - (c - 3 + 1) // 2
    assert bm.null_block == 5 and 5 not in handed and set(handed) == set(range(5))
    with pytest.raises(IndexError):  # the null block has no ref count: it is no block of the pool
        bm.ref_counts[bm.null_block]
    bm.free("a")
    assert bm.num_free_blocks == 5
    bm.check_invariants()


def test_full_attention_releases_nothing_and_has_no_step_limit():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 30)
    assert bm.free_out_of_window("a", 30) == 0 and bm.max_tokens_per_step is None and bm.step_token_limit(0) is None
    assert bm.first_live_block(1000) == 0 and bm.get_block_table("a") == list(range(8))


@pytest.mark.parametrize(
    "num_blocks, bs, window, expected",
    [
        (6, 16, 16, 5 * 16 - 16 + 2),  # 66: a step of 66 tokens spans ceil((16 - 2 + 66) / 16) + 1 = 6 blocks
        (6, 16, 81, 1),  # the pool holds one window and a token
        (6, 16, 90, None),  # it cannot hold one window: the window never frees a block in it
        (3, 4, 1, 2 * 4 - 1 + 2),
    ],
)
def test_max_tokens_per_step_lets_a_request_alone_in_the_pool_always_progress(num_blocks, bs, window, expected):
    bm = BlockManager(num_blocks=num_blocks, block_size=bs, sliding_window=window)
    assert bm.max_tokens_per_step == expected
    if expected is None:
        return
    # Worst case over the starting position: the blocks a step of that many tokens needs fit the pool.
    for c in range(0, 5 * num_blocks * bs):
        need = -(-(c + expected) // bs) - _first_live(c, window, bs)
        assert need <= num_blocks
    # One more token does not fit somewhere.
    assert any(
        -(-(c + expected + 1) // bs) - _first_live(c, window, bs) > num_blocks for c in range(window, window + bs)
    )
    # While the whole context and the step fit the pool, a step may take all of it.
    assert bm.step_token_limit(0) == max(expected, num_blocks * bs)
    assert bm.step_token_limit(num_blocks * bs) == expected


def test_a_new_table_deep_into_a_sequence_starts_with_null_entries():
    # A swap-in or an admission after prefix hits: 16 computed, W 6, bs 4 -> the first (16-6+1)//4 = 2
    # entries are null; 20 tokens need 5 entries, so 3 fresh blocks.
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    assert bm.num_blocks_needed("b", 20, num_computed_tokens=16) == 3
    assert bm.num_blocks_needed("b", 20) == 5  # from the start: all of them
    assert bm.allocate("b", 20, num_computed_tokens=16) == [0, 1, 2]
    assert bm.get_block_table("b") == [8, 8, 0, 1, 2]
    assert bm.free("b") == 3 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_hits_the_window_no_longer_reads_are_not_taken():
    bs, window = 4, 5
    bm = BlockManager(num_blocks=10, block_size=bs, enable_prefix_caching=True, sliding_window=window)
    prompt = _tokens(17)
    hashes: list[int] = []
    bm.allocate("a", 17)
    bm.cache_full_blocks("a", prompt, hashes, 17)  # 4 full blocks hashed, before the window moves
    bm.free_out_of_window("a", 17)  # (17 - 5 + 1) // 4 = 3 blocks out, back to the queue, still cached
    assert bm.num_used_blocks == 2 and bm.num_cached_free_blocks == 3
    bm.free("a")
    hits = bm.match_prefix(prompt, [], None)
    # (17 - 1) // 4 = 4 full blocks hit; 16 computed from them: entries before (16 - 5 + 1) // 4 = 3
    # are null (not taken), hit 3 is (sitting free: 1 block), and position 16 needs one fresh block:
    # 2 blocks in all.
    assert hits == [bm.null_block] * 3 + [3]
    assert bm.num_blocks_needed_with_prefix(hits, 17) == 2
    bm.allocate("b", 17, prefix_blocks=hits)
    assert bm.get_block_table("b")[:4] == [bm.null_block] * 3 + [3]
    assert bm.ref_counts[:4] == [0, 0, 0, 1]
    bm.check_invariants()
    bm.free("b")
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_a_fork_shares_the_null_entries_and_its_parents_live_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=3)
    bm.allocate("p", 13)  # blocks 0..3
    bm.free_out_of_window("p", 13)  # (13 - 3 + 1) // 4 = 2 out
    copy = bm.fork("p", "c", 13)  # 3 full blocks shared (2 of them null), the partial one copied
    assert bm.get_block_table("c")[:3] == [8, 8, 2] and copy == (3, bm.get_block_table("c")[3])
    assert bm.ref_counts[2] == 2
    bm.check_invariants()
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_trim_and_cancel_under_a_window_leave_no_block_behind():
    bm = BlockManager(num_blocks=8, block_size=2, sliding_window=2)
    bm.allocate("a", 9)  # 5 blocks
    bm.free_out_of_window("a", 6)  # (6 - 2 + 1) // 2 = 2 out
    assert bm.trim("a", 6) == 2  # the rejected drafts' blocks 3 and 4 (positions 6..8)
    assert bm.get_block_table("a") == [8, 8, 2]
    assert bm.free("a") == 1 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_a_window_hit_needs_only_the_blocks_its_window_reads_to_be_cached():
    bs, window = 4, 5
    bm = BlockManager(num_blocks=10, block_size=bs, enable_prefix_caching=True, sliding_window=window)
    prompt = _tokens(17)
    bm.allocate("a", 17)  # blocks 0..4; 5..9 stay in the queue
    bm.cache_full_blocks("a", prompt, [], 17)
    bm.free_out_of_window("a", 17)  # 0, 1, 2 to the queue's tail, cached
    bm.free("a")  # 4 (partial, unhashed) to the front, 3 (cached) to the tail
    assert bm.allocate("x", 28) == [4, 5, 6, 7, 8, 9, 0]  # evicts block 0, the prefix's first
    assert bm.num_evictions == 1
    # A 4-block hit reads from position 16 - 5 + 1 = 12 on: block 3 only, still cached.
    assert bm.match_prefix(prompt, [], None) == [bm.null_block] * 3 + [3]
    # 3 blocks: from (12 - 4) // 4 = 2 on; 2 blocks: from (8 - 4) // 4 = 1 on; 1 block: block 0, evicted.
    assert bm.match_prefix(prompt, [], None, max_blocks=3) == [bm.null_block] * 2 + [2]
    assert bm.match_prefix(prompt, [], None, max_blocks=2) == [bm.null_block, 1]
    assert bm.match_prefix(prompt, [], None, max_blocks=1) == []
    full = BlockManager(num_blocks=10, block_size=bs, enable_prefix_caching=True)
    full.allocate("a", 17)
    full.cache_full_blocks("a", prompt, [], 17)
    full.free("a")
    full.allocate("x", 4 * 4)  # the never-used blocks 5..8 first
    assert full.match_prefix(prompt, [], None) == [0, 1, 2, 3]
    assert full.match_prefix(prompt, [], None, max_blocks=2) == [0, 1]
