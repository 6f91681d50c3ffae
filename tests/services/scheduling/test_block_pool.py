from __future__ import annotations

import pytest

from services.scheduling.block_pool import (
    Block,
    BlockHash,
    BlockPool,
    hash_block,
    hash_prefix_blocks,
)


def cached_blocks(pool: BlockPool, n: int, tag: str = "x") -> list[Block]:
    """Allocate ``n`` blocks and register each under its own chained hash."""
    blocks = pool.allocate(n)
    parent = None
    for i, block in enumerate(blocks):
        parent = hash_block(parent, [ord(c) for c in tag] + [i])
        pool.cache(block, parent)
    return blocks


def hash_of(block: Block) -> BlockHash:
    assert block.block_hash is not None
    return block.block_hash


def held_map(*tables: list[Block]) -> dict[int, int]:
    held: dict[int, int] = {}
    for table in tables:
        for block in table:
            held[block.block_id] = held.get(block.block_id, 0) + 1
    return held


def test_allocate_and_free_track_counts_and_usage() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len({b.block_id for b in blocks}) == 3
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.check_invariants(held_map(blocks))
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    pool.check_invariants({})


def test_allocating_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    taken = pool.allocate(1)
    with pytest.raises(MemoryError, match="2 KV blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants(held_map(taken))


def test_shared_block_is_free_only_after_the_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = cached_blocks(pool, 1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.check_invariants({block.block_id: 1})
    pool.free([block])
    assert pool.num_free_blocks == 2


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)


def test_a_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_chained_hashes_identify_prefixes() -> None:
    tokens = list(range(40))
    hashes = hash_prefix_blocks(tokens, 8)
    assert len(hashes) == 5
    assert len(set(hashes)) == 5
    assert hash_prefix_blocks(tokens[:35], 8) == hashes[:4], "a partial block has no hash"
    assert hash_prefix_blocks([*tokens[:16], 99, 98], 8) == hashes[:2]

    changed_first = hash_prefix_blocks([-1, *tokens[1:]], 8)
    assert all(a != b for a, b in zip(changed_first, hashes, strict=True))
    changed_third = hash_prefix_blocks([*tokens[:16], -1, *tokens[17:]], 8)
    assert changed_third[:2] == hashes[:2]
    assert all(a != b for a, b in zip(changed_third[2:], hashes[2:], strict=True))


def test_equal_blocks_after_different_prefixes_hash_differently() -> None:
    block = [5, 6, 7, 8]
    assert hash_block(None, block) != hash_block(hash_block(None, [1, 2, 3, 4]), block)
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_freed_cached_blocks_stay_findable_until_evicted_lru_first() -> None:
    pool = BlockPool(4)
    a, b, c = cached_blocks(pool, 3)
    hashes = [hash_of(a), hash_of(b), hash_of(c)]
    pool.free([a])
    pool.free([b])
    pool.free([c])
    assert [pool.lookup(h) for h in hashes] == [a, b, c]

    (never_used,) = pool.allocate(1)
    assert never_used not in (a, b, c), "an uncached block goes before any cached one"
    assert pool.allocate(1) == [a], "the least recently freed cached block is evicted first"
    assert pool.lookup(hashes[0]) is None
    assert a.block_hash is None
    assert pool.lookup(hashes[1]) is b and pool.lookup(hashes[2]) is c
    assert pool.allocate(1) == [b]


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(3)
    cached = cached_blocks(pool, 2)
    plain = pool.allocate(1)
    pool.free(cached)
    pool.free(plain)
    assert pool.allocate(1) == plain
    assert all(pool.lookup(hash_of(b)) is b for b in cached)


def test_touch_revives_a_cached_block_and_refreshes_its_age() -> None:
    pool = BlockPool(2)
    a, b = cached_blocks(pool, 2)
    pool.free([a, b])  # a is older
    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.num_free_blocks == 1
    pool.check_invariants({a.block_id: 1})
    pool.free([a])  # a is now the most recently freed
    assert pool.allocate(1) == [b]
    assert pool.lookup(hash_of(a)) is a


def test_a_duplicate_block_stays_private() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    h = hash_block(None, [1, 2, 3])
    pool.cache(first, h)
    pool.cache(second, h)
    assert pool.lookup(h) is first
    assert second.block_hash is None
    pool.free([second])
    assert pool.lookup(h) is first


def test_reset_prefix_cache_forgets_free_blocks() -> None:
    pool = BlockPool(3)
    free, used = cached_blocks(pool, 2)
    h_free = hash_of(free)
    pool.free([free])
    pool.reset_prefix_cache()
    assert pool.lookup(h_free) is None
    assert free.block_hash is None
    pool.check_invariants({used.block_id: 1})


def test_caching_disabled_never_finds_anything() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1])
    pool.cache(block, h)
    assert pool.lookup(h) is None
    assert block.block_hash is None


def test_check_invariants_catches_a_wrong_owner_count() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.check_invariants(held_map(blocks))
    with pytest.raises(AssertionError, match="ref_cnt"):
        pool.check_invariants(held_map(blocks[:1]))
    with pytest.raises(AssertionError, match="ref_cnt"):
        pool.check_invariants(held_map(blocks, blocks))


def test_a_pool_of_a_hundred_million_blocks_makes_only_the_ones_used() -> None:
    """A tiny model on a large GPU gets millions of blocks: making an object per block up
    front took minutes. The queue keeps its order: blocks freed without a hash first (last
    freed first), then never-used ones in id order, then cached ones, least recently freed
    first."""
    pool = BlockPool(100_000_000)
    assert pool.num_free_blocks == 100_000_000 and pool.usage == 0.0
    first = pool.allocate(4)
    assert [b.block_id for b in first] == [0, 1, 2, 3] and len(pool.blocks) == 4
    cached = cached_blocks(pool, 2)  # 4, 5
    pool.free(cached)
    pool.free([first[1]])
    pool.free([first[2]])
    assert pool.num_free_blocks == 100_000_000 - 2
    pool.check_invariants({0: 1, 3: 1})
    got = [b.block_id for b in pool.allocate(3)]
    assert got == [2, 1, 6], "freed plain blocks (last freed first), then a never-used one"
    assert all(pool.lookup(hash_of(b)) is b for b in cached)
    pool.check_invariants({0: 1, 1: 1, 2: 1, 3: 1, 6: 1})
    with pytest.raises(AssertionError, match="never allocated"):
        pool.check_invariants({0: 1, 1: 1, 2: 1, 3: 1, 6: 1, 7: 1})


def test_cached_blocks_are_evicted_only_once_every_never_used_block_is_taken() -> None:
    pool = BlockPool(5)
    a, b = cached_blocks(pool, 2)
    pool.free([b, a])  # tail first: b is the older
    assert [x.block_id for x in pool.allocate(3)] == [2, 3, 4]
    assert pool.lookup(hash_of(a)) is a
    assert pool.allocate(2) == [b, a]
    with pytest.raises(MemoryError, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)
