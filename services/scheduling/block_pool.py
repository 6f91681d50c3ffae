"""The pool of KV blocks: reference counts, prefix hashes and LRU eviction of cached blocks.

A full block is identified by the hash of its tokens chained with its parent's hash, so equal
prefixes map to equal blocks. A block whose reference count drops to zero stays in the cache
(still findable by hash) at the tail of the free queue; allocation takes from the head, evicting
the least recently freed cached block first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, tokens: Sequence[int], extra: Sequence[bytes] = ()
) -> BlockHash:
    """``extra``: the content hashes of the images whose tokens the block holds (their
    placeholder ids are the same for every image)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(array("q", tokens).tobytes())
    for key in extra:
        h.update(key)
    return h.digest()


def salt_root(salt: str) -> BlockHash | None:
    """The parent of a salted request's first block (None: unsalted, the plain root)."""
    if not salt:
        return None
    return hashlib.blake2b(b"salt:" + salt.encode(), digest_size=16).digest()


def hash_prefix_blocks(tokens: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of every full block of ``tokens``."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """The free queue is, head first: blocks freed with no hash (reused first, last freed
    first), blocks never used yet (in id order), then blocks freed with a hash (LRU). A block
    object is made the first time it is allocated, so a pool of millions of blocks (a tiny model
    on a large GPU) costs nothing until they are used."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[Block] = []  # every block made so far; blocks[i].block_id == i
        self._front: OrderedDict[int, Block] = OrderedDict()  # freed without a hash
        self._back: OrderedDict[int, Block] = OrderedDict()  # freed with a hash, LRU first
        self._cached: dict[BlockHash, Block] = {}
        self.queries = 0
        self.hits = 0
        # told of a cached block about to be reused for something else (the host tier keeps it)
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._front) + (self.num_blocks - len(self.blocks)) + len(self._back)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[Block]:
        free = self.num_free_blocks
        if n > free:
            raise MemoryError(f"asked for {n} KV blocks, {free} free")
        out = []
        for _ in range(n):
            if self._front:
                _, block = self._front.popitem(last=False)
            elif len(self.blocks) < self.num_blocks:
                block = Block(len(self.blocks))
                self.blocks.append(block)
            else:
                _, block = self._back.popitem(last=False)
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference to cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and self._back.pop(block.block_id, None) is None:
                del self._front[block.block_id]  # not cached, so queued at the front
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference; pass blocks tail first so a prefix's tail is evicted before its head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._front[block.block_id] = block
                    self._front.move_to_end(block.block_id, last=False)  # uncached: reuse first
                else:
                    self._back[block.block_id] = block

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is cached already; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)

    def check_invariants(self, held: dict[int, int]) -> None:
        """``held`` maps block id to how many owners hold it; raises AssertionError if inconsistent."""
        for block in self.blocks:
            expected = held.get(block.block_id, 0)
            assert block.ref_cnt == expected, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {expected}"
            )
            queued = block.block_id in self._front or block.block_id in self._back
            assert queued == (block.ref_cnt == 0), (
                f"block {block.block_id}: free-queue membership disagrees with ref_cnt"
            )
        made = len(self.blocks)
        assert all(i < made for i in held), "a block that was never allocated is held"
        assert not set(self._front) & set(self._back), "a block is queued twice"
        for h, block in self._cached.items():
            assert block.block_hash == h, "cached block lost its hash"
