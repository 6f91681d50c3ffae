"""Per-request block tables on top of the block pool: allocate, append, free, prefix hits.

The scheduler sees only block ids (opaque integers to it) and counts; the engine turns them
into slot mappings and block tables.
"""

from __future__ import annotations

from protos.blocks import blocks_for
from services.scheduling.block_pool import Block, BlockHash, BlockPool, hash_block, salt_root
from services.scheduling.host_tier import HostTier
from services.scheduling.request import Request


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, host_slots: int = 0
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host = HostTier(host_slots) if host_slots > 0 and enable_caching else None
        # (device block, host slot) and (host slot, device block) copies for the next step
        self.offloads: list[tuple[int, int]] = []
        self.restores: list[tuple[int, int]] = []
        # evictions are offloaded only while the scheduler plans a step (its copies run before
        # that step's forward); a reservation's blocks are written by a KV transfer at any time
        self.offload_on_evict = False
        self.host_hits = 0  # prompt tokens restored from the host tier
        self.pool.on_evict = self._offload
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
        return blocks_for(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table, as ids."""
        return list(self._ids.get(request_id, ()))

    def _block_hashes(self, request: Request, upto_tokens: int) -> list[BlockHash]:
        """Chained hashes of the request's full blocks among its first ``upto_tokens`` tokens."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        root = salt_root(request.cache_salt)
        while (len(hashes) + 1) * bs <= upto_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else root
            images = [im.content_hash for im in request.images
                      if im.offset < start + bs and im.end > start]  # fmt: skip
            hashes.append(hash_block(parent, request.token_ids(start, start + bs), images))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Longest run of cached blocks matching the request's leading tokens.

        At least one token is always left to compute, so the last position has logits.
        """
        if not self.pool.enable_caching or not request.reads_prefix_cache:
            return []  # prompt logprobs (or mean pooling) need every position: compute it whole
        limit = request.num_tokens - 1
        hashes = self._block_hashes(request, limit)
        hit: list[Block] = []
        for h in hashes[: limit // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def find_host_prefix(self, request: Request, num_device_blocks: int) -> list[BlockHash]:
        """The blocks after a device hit of ``num_device_blocks`` that the host tier holds."""
        if self.host is None or not request.reads_prefix_cache:
            return []
        limit = request.num_tokens - 1
        hashes = self._block_hashes(request, limit)
        found = []
        for h in hashes[num_device_blocks : limit // self.block_size]:
            if self.host.lookup(h) is None:
                break
            found.append(h)
        return found

    def _offload(self, block_id: int, block_hash: BlockHash) -> None:
        if self.host is not None and self.offload_on_evict:
            slot = self.host.offer(block_hash)
            if slot is not None:
                self.offloads.append((block_id, slot))

    def drain_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's copies: (device block, host slot) offloads, (host slot, device block)
        restores; the runner does the offloads first."""
        moves = (self.offloads, self.restores)
        self.offloads, self.restores = [], []
        if self.host is not None:
            self.host.unpin()
        return moves

    def record_prefix_query(self, request: Request, num_cached_tokens: int, host: int = 0) -> None:
        """Count one admission in the prefix-cache metrics (not every failed attempt); ``host``
        of the cached tokens came back from the host tier."""
        self.pool.queries += request.num_tokens
        self.pool.hits += num_cached_tokens - host
        self.host_hits += host

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached: list[Block] | None = None,
        *,
        register: bool = True,
        restore: list[BlockHash] | None = None,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones; False if full.

        ``register=False`` keeps the new blocks out of the prefix cache (KV still in flight).
        ``restore``: host-tier blocks after ``cached`` (``find_host_prefix``), copied back into
        the first new blocks before the step runs.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is not None and not cached and not restore:  # most steps: room in its blocks
            total = request.num_computed_tokens + num_new_tokens
            if total <= len(table) * self.block_size:
                # (a block fills once every block_size tokens: the registered count says when)
                if register and total // self.block_size > self._registered.get(rid, 0):
                    self._cache_full_blocks(request, table, total)
                return True
        have = len(table) if table is not None else 0
        cached, restore = cached or [], restore or []
        hit = len(cached) + len(restore)
        total = request.num_computed_tokens + hit * self.block_size + num_new_tokens
        need = self.blocks_for(total) - have - len(cached)
        if cached or need > 0:
            reviving = sum(1 for b in cached if b.ref_cnt == 0)  # cached blocks in the free queue
            if need > self.pool.num_free_blocks - reviving:
                return False
            self.pool.touch(cached)
            slots = self.host.take(restore) if self.host is not None and restore else []
            new = self.pool.allocate(max(need, 0))
            self.restores.extend(zip(slots, (b.block_id for b in new), strict=False))
            added = cached + new
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

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens' (those that held only
        rejected draft tokens: never registered in the prefix cache, so simply free)."""
        rid, keep = request.request_id, self.blocks_for(num_tokens)
        table = self._tables.get(rid)
        if table is None or len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:], self._ids[rid][keep:]
        assert self._registered.get(rid, 0) <= keep
        self.pool.free(reversed(extra))

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self._tables.pop(rid, [])
        self._ids.pop(rid, None)
        self._hashes.pop(rid, None)
        self._registered.pop(rid, None)
        self.pool.free(reversed(table))

    def check_invariants(self) -> None:
        if self.host is not None:
            self.host.check_invariants()
        held: dict[int, int] = {}
        for rid, table in self._tables.items():
            assert self._ids[rid] == [b.block_id for b in table], f"stale block ids for {rid}"
            for block in table:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        self.pool.check_invariants(held)

    def all_free(self) -> bool:
        return not self._tables and self.pool.num_free_blocks == self.pool.num_blocks
