"""Per-request block tables on top of the block pool: allocate, append, free, prefix hits.

The scheduler sees only block ids (opaque integers to it) and counts; the engine turns them
into slot mappings and block tables.
"""

from __future__ import annotations

from services.scheduling.block_pool import Block, BlockHash, BlockPool, hash_block
from services.scheduling.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._tables: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def _block_hashes(self, request: Request, upto_tokens: int) -> list[BlockHash]:
        """Chained hashes of the request's full blocks among its first ``upto_tokens`` tokens."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= upto_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.token_ids(start, start + bs)))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Longest run of cached blocks matching the request's leading tokens.

        At least one token is always left to compute, so the last position has logits.
        """
        if not self.pool.enable_caching:
            return []
        limit = request.num_tokens - 1
        hashes = self._block_hashes(request, limit)
        hit: list[Block] = []
        for h in hashes[: limit // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def record_prefix_query(self, request: Request, num_cached_tokens: int) -> None:
        """Count one admission in the prefix-cache metrics (not every failed attempt)."""
        self.pool.queries += request.num_tokens
        self.pool.hits += num_cached_tokens

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached: list[Block] | None = None,
        *,
        register: bool = True,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones; False if full.

        ``register=False`` keeps the new blocks out of the prefix cache (KV still in flight).
        """
        table = self._tables.get(request.request_id, [])
        cached = cached or []
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_for(total) - len(table) - len(cached)
        reviving = sum(1 for b in cached if b.ref_cnt == 0)  # cached blocks now in the free queue
        if need > self.pool.num_free_blocks - reviving:
            return False
        self.pool.touch(cached)
        table = table + cached + self.pool.allocate(max(need, 0))
        self._tables[request.request_id] = table
        if register:
            self._cache_full_blocks(request, table, total)
        return True

    def _cache_full_blocks(self, request: Request, table: list[Block], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        known = min(num_tokens, request.num_tokens)
        # the memo may hold hashes past ``known`` (find_cached_prefix hashes the whole prompt)
        hashes = self._block_hashes(request, known)[: known // self.block_size]
        for block, h in zip(table, hashes, strict=False):
            self.pool.cache(block, h)

    def free(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self.pool.free(reversed(table))

    def reset_hashes(self, request: Request) -> None:
        self._hashes.pop(request.request_id, None)

    def check_invariants(self) -> None:
        held: dict[int, int] = {}
        for table in self._tables.values():
            for block in table:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        self.pool.check_invariants(held)

    def all_free(self) -> bool:
        return not self._tables and self.pool.num_free_blocks == self.pool.num_blocks
