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
        self._ids: dict[str, list[int]] = {}  # the same tables as block ids (read every step)
        self._hashes: dict[str, list[BlockHash]] = {}
        self._registered: dict[str, int] = {}  # leading blocks already offered to the cache

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
        """A copy of the request's block table, as ids."""
        return list(self._ids.get(request_id, ()))

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
        if not self.pool.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every position's logits: compute the whole prompt
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
        rid = request.request_id
        table = self._tables.get(rid)
        have = len(table) if table is not None else 0
        cached = cached or []
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_for(total) - have - len(cached)
        if cached or need > 0:
            reviving = sum(1 for b in cached if b.ref_cnt == 0)  # cached blocks in the free queue
            if need > self.pool.num_free_blocks - reviving:
                return False
            self.pool.touch(cached)
            added = cached + self.pool.allocate(max(need, 0))
            if table is None:
                table = self._tables[rid] = []
                self._ids[rid] = []
            table.extend(added)
            self._ids[rid].extend(b.block_id for b in added)
        elif table is None:
            self._tables[rid], self._ids[rid] = [], []
        if register:
            self._cache_full_blocks(request, self._tables[rid], total)
        return True

    def _cache_full_blocks(self, request: Request, table: list[Block], num_tokens: int) -> None:
        """Offer the request's newly full blocks to the prefix cache (each block once)."""
        if not self.pool.enable_caching:
            return
        known = min(num_tokens, request.num_tokens)
        full = min(known // self.block_size, len(table))
        done = self._registered.get(request.request_id, 0)
        if full <= done:
            return
        # the memo may hold hashes past ``known`` (find_cached_prefix hashes the whole prompt)
        hashes = self._block_hashes(request, known)
        for i in range(done, full):
            self.pool.cache(table[i], hashes[i])
        self._registered[request.request_id] = full

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self._tables.pop(rid, [])
        self._ids.pop(rid, None)
        self._hashes.pop(rid, None)
        self._registered.pop(rid, None)
        self.pool.free(reversed(table))

    def reset_hashes(self, request: Request) -> None:
        self._hashes.pop(request.request_id, None)
        self._registered.pop(request.request_id, None)

    def check_invariants(self) -> None:
        held: dict[int, int] = {}
        for rid, table in self._tables.items():
            assert self._ids[rid] == [b.block_id for b in table], f"stale block ids for {rid}"
            for block in table:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        self.pool.check_invariants(held)

    def all_free(self) -> bool:
        return not self._tables and self.pool.num_free_blocks == self.pool.num_blocks
