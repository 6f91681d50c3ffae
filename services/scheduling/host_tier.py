"""The host tier of the prefix cache: blocks the device pool evicted, kept in host memory.

When the device pool reuses a cached block (its LRU eviction), the block's KV is copied into a
host slot under the same hash; a later prefix lookup that misses on the device finds it here and
the block is copied back instead of recomputed. Slots are evicted least recently used. This class
only keeps the books (hash to slot); the engine's runner moves the bytes (``kv_offloads`` and
``kv_restores`` of a step's ``SchedulerOutput``, done before its forward).
"""

from __future__ import annotations

from collections import OrderedDict

from services.scheduling.block_pool import BlockHash


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # being restored this step: not to be overwritten
        self.stored = 0  # blocks copied in
        self.restored = 0  # blocks copied back to the device
        self.evicted = 0  # blocks dropped to make room

    def __len__(self) -> int:
        return len(self._slots)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._slots.get(block_hash)

    def offer(self, block_hash: BlockHash) -> int | None:
        """A slot to copy an evicted device block into; None if the hash is here already (or
        every slot is pinned)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            return None
        self._slots[block_hash] = slot
        self.stored += 1
        return slot

    def _evict_one(self) -> int | None:
        for h, slot in self._slots.items():
            if slot not in self._pinned:
                del self._slots[h]
                self.evicted += 1
                return slot
        return None

    def take(self, hashes: list[BlockHash]) -> list[int]:
        """The slots of blocks about to be restored: used now (LRU) and pinned until
        ``unpin``, so no offload of the same step overwrites them."""
        slots = []
        for h in hashes:
            self._slots.move_to_end(h)
            slots.append(self._slots[h])
        self._pinned.update(slots)
        self.restored += len(slots)
        return slots

    def unpin(self) -> None:
        self._pinned.clear()

    def check_invariants(self) -> None:
        used = set(self._slots.values())
        assert len(used) == len(self._slots), "two hashes share a host slot"
        assert used.isdisjoint(self._free), "a host slot is both used and free"
        assert len(used) + len(self._free) == self.num_slots, "host slots leaked"
