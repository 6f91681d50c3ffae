"""Routing: prefix affinity that yields to load, and decode admission by free blocks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gateway.workers.router import prefix_key, rank_by_affinity, rank_decode
from protos.blocks import blocks_for
from protos.multimodal import ImageItem, content_hash


@dataclass
class W:
    address: str
    queue_depth: int = 0
    free_blocks: int = 100


WORKERS = [W(f"10.0.0.{i}:50051") for i in range(4)]


def test_prefix_key_covers_the_leading_blocks_only() -> None:
    shared = list(range(64))  # 4 blocks of 16
    assert prefix_key([*shared, 1, 2], 16, 4) == prefix_key([*shared, 9, 9, 9], 16, 4)
    assert prefix_key(shared, 16, 4) != prefix_key([7, *shared[1:]], 16, 4)
    assert prefix_key([1, 2, 3], 16, 4) != prefix_key([1, 2, 4], 16, 4)  # short: whole prompt
    assert prefix_key(list(range(20)), 16, 4) == prefix_key([*range(16), 0, 0, 0, 0], 16, 4)


def test_prefix_key_tells_images_and_adapters_apart() -> None:
    """An image's placeholder ids are the same whatever the image: its content decides whether
    cached blocks can be shared, and so does the adapter."""

    def image(offset: int, data: bytes) -> ImageItem:
        return ImageItem(offset, 8, (1, 4, 4), content_hash(data), data)

    ids = [1, 2, *[151655] * 8, *range(40)]  # an image's placeholders in the first block
    cat, dog = image(2, b"cat"), image(2, b"dog")
    assert prefix_key(ids, 16, 4, (cat,)) != prefix_key(ids, 16, 4, (dog,))
    assert prefix_key(ids, 16, 4, (cat,)) == prefix_key(ids, 16, 4, (image(2, b"cat"),))
    assert prefix_key(ids, 16, 4, (cat,)) != prefix_key(ids, 16, 4)
    late = image(70, b"cat")  # past the leading blocks the key covers: no effect
    assert prefix_key([*ids, *range(30)], 16, 4, (late,)) == prefix_key([*ids, *range(30)], 16, 4)
    assert prefix_key(ids, 16, 4, lora="sql") != prefix_key(ids, 16, 4)
    assert prefix_key(ids, 16, 4, lora="sql") != prefix_key(ids, 16, 4, lora="chat")
    # a cache salt's blocks are found only with that salt: keyed apart too
    assert prefix_key(ids, 16, 4, cache_salt="a") != prefix_key(ids, 16, 4)
    assert prefix_key(ids, 16, 4, cache_salt="a") != prefix_key(ids, 16, 4, cache_salt="b")
    assert prefix_key(ids, 16, 4, cache_salt="a") == prefix_key(ids, 16, 4, cache_salt="a")


def test_same_prefix_same_worker_and_keys_spread_evenly() -> None:
    key = prefix_key([5] * 64, 16, 4)
    assert rank_by_affinity(WORKERS, key)[0] is rank_by_affinity(list(reversed(WORKERS)), key)[0]
    counts = Counter(
        rank_by_affinity(WORKERS, prefix_key([i], 16, 4))[0].address for i in range(2000)
    )
    assert len(counts) == 4 and all(350 < c < 650 for c in counts.values())


def test_removing_a_worker_moves_only_its_keys() -> None:
    keys = [prefix_key([i], 16, 4) for i in range(500)]
    before = {k: rank_by_affinity(WORKERS, k)[0].address for k in keys}
    after = {k: rank_by_affinity(WORKERS[1:], k)[0].address for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == WORKERS[0].address for k in moved)


def test_a_loaded_worker_loses_most_keys() -> None:
    loaded = [W(w.address, queue_depth=30 if i == 0 else 0) for i, w in enumerate(WORKERS)]
    counts = Counter(
        rank_by_affinity(loaded, prefix_key([i], 16, 4))[0].address for i in range(1000)
    )
    assert counts[WORKERS[0].address] < 40


def test_decode_ranking_prefers_room_then_free_blocks_per_queued_request() -> None:
    a, b, c = (
        W("a", queue_depth=0, free_blocks=5),
        W("b", queue_depth=1, free_blocks=50),
        W("c", queue_depth=9, free_blocks=60),
    )
    assert [w.address for w in rank_decode([a, b, c], needed_blocks=10)] == ["b", "c", "a"]
    assert [w.address for w in rank_decode([a, b, c], needed_blocks=1)] == ["b", "c", "a"]
    assert rank_decode([a], needed_blocks=100) == [a]  # still tried: Reserve has the last word
    assert blocks_for(17, 16) == 2 and blocks_for(16, 16) == 1
