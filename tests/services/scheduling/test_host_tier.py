"""The prefix cache's host tier, torch-free: what the device pool evicts is offered to host slots
(LRU), a later lookup that misses on the device continues into the host tier, restores pin their
slots for the step, and the books always balance."""

from __future__ import annotations

import pytest

from protos.sampling_params import SamplingParams
from services.scheduling.host_tier import HostTier
from services.scheduling.kv_manager import KVCacheManager
from services.scheduling.request import Request

BS = 4


def _req(rid: str, tokens: list[int], **kw: object) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, **kw))  # type: ignore[arg-type]


def test_slots_are_reused_least_recently_used_first() -> None:
    tier = HostTier(2)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    sa, sb = tier.offer(a), tier.offer(b)
    assert {sa, sb} == {0, 1} and tier.offer(a) is None  # known: no copy, but used now
    assert tier.offer(c) == sb and tier.lookup(b) is None and tier.evicted == 1
    assert tier.take([a, c]) == [sa, sb] and tier.restored == 2
    assert tier.offer(b) is None  # every slot is being restored from this step: no room
    tier.unpin()
    assert tier.offer(b) == sa and tier.lookup(a) is None  # a was the least recently used
    tier.check_invariants()
    with pytest.raises(ValueError):
        HostTier(0)


def _fill(kv: KVCacheManager, req: Request) -> None:
    assert kv.allocate(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens


def test_evicted_blocks_go_to_the_host_and_come_back() -> None:
    kv = KVCacheManager(4, BS, host_slots=8)
    first = _req("a", list(range(12)))  # 3 full blocks
    kv.offload_on_evict = True
    _fill(kv, first)
    kv.free(first)
    other = _req("b", list(range(100, 116)))  # needs all 4 blocks: evicts a's three
    _fill(kv, other)
    offloads, restores = kv.drain_moves()
    assert len(offloads) == 3 and not restores and kv.host is not None and len(kv.host) == 3
    kv.free(other)
    again = _req("c", [*range(12), 7])
    device = kv.find_cached_prefix(again)
    host = kv.find_host_prefix(again, len(device))
    assert device == [] and len(host) == 3
    assert kv.allocate(again, 1, device, restore=host)
    offloads, restores = kv.drain_moves()
    table = kv.block_ids("c")
    assert [b for _, b in restores] == table[:3] and len(table) == 4
    assert len(offloads) == 4  # b's blocks were cached on the device: they move out in turn
    kv.record_prefix_query(again, 12, 12)
    assert kv.host_hits == 12 and kv.pool.hits == 0
    kv.check_invariants()


def test_evictions_outside_a_schedule_and_scoring_requests_skip_the_tier() -> None:
    kv = KVCacheManager(2, BS, host_slots=4)
    first = _req("a", list(range(8)))
    _fill(kv, first)
    kv.free(first)
    _fill(kv, _req("b", list(range(50, 58))))  # offload_on_evict is off: dropped, not copied
    assert kv.drain_moves() == ([], []) and kv.host is not None and len(kv.host) == 0
    scored = _req("c", [*range(8), 1], prompt_logprobs=0)
    assert kv.find_host_prefix(scored, 0) == []
    assert KVCacheManager(2, BS, enable_caching=False, host_slots=4).host is None
