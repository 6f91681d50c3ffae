from __future__ import annotations

import pytest

from services.scheduling.kv_manager import KVCacheManager
from services.scheduling.request import Request
from tests.services.scheduling.conftest import make_request, prompt

BS = 4


def computed(kv: KVCacheManager, req: Request, cached_hit: bool = True) -> Request:
    """Allocate a request's whole prompt (after its prefix hit) and mark it computed."""
    hit = kv.find_cached_prefix(req) if cached_hit else []
    assert kv.allocate(req, req.num_prompt_tokens - len(hit) * kv.block_size, hit)
    req.num_computed_tokens = req.num_prompt_tokens
    return req


def test_allocate_grows_the_table_block_by_block() -> None:
    kv = KVCacheManager(8, BS)
    req = make_request("a", 5)
    assert kv.allocate(req, 5)
    assert len(kv.block_ids("a")) == 2
    req.num_computed_tokens = 5
    assert kv.allocate(req, 3)  # 8 tokens still fit in 2 blocks
    assert len(kv.block_ids("a")) == 2
    req.num_computed_tokens = 8
    assert kv.allocate(req, 1)
    assert len(kv.block_ids("a")) == 3
    assert kv.usage == pytest.approx(3 / 8)
    kv.check_invariants()


def test_longest_cached_prefix_of_full_blocks_is_found() -> None:
    kv = KVCacheManager(16, BS)
    system = prompt(8, "system")
    first = computed(kv, make_request("a", system + prompt(6, "a")))
    kv.free(first)
    second = make_request("b", system + prompt(6, "b"))
    hit = kv.find_cached_prefix(second)
    assert len(hit) == 2, "the two full blocks of the shared system prompt"


def test_a_different_first_block_breaks_the_chain() -> None:
    kv = KVCacheManager(16, BS)
    tokens = prompt(12, "x")
    kv.free(computed(kv, make_request("a", tokens)))
    assert kv.find_cached_prefix(make_request("b", [-5, *tokens[1:]])) == []


@pytest.mark.parametrize(("length", "max_hit_blocks"), [(8, 1), (9, 2), (4, 0), (3, 0)])
def test_a_hit_always_leaves_a_token_to_compute(length: int, max_hit_blocks: int) -> None:
    kv = KVCacheManager(16, BS)
    tokens = prompt(length, "same")
    kv.free(computed(kv, make_request("a", [*tokens, 1, 2, 3, 4])))
    hit = kv.find_cached_prefix(make_request("b", tokens))
    assert len(hit) == max_hit_blocks
    assert len(hit) * BS < length


def test_a_hit_is_shared_while_both_requests_run() -> None:
    kv = KVCacheManager(16, BS)
    system = prompt(8, "system")
    a = computed(kv, make_request("a", [*system, 1]))
    b = computed(kv, make_request("b", [*system, 2]))
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert kv.block_ids("a")[2] != kv.block_ids("b")[2]
    kv.check_invariants()
    kv.free(a)
    kv.check_invariants()
    assert kv.num_free_blocks == 16 - 3
    kv.free(b)
    assert kv.all_free()


def test_allocation_failure_on_a_full_pool_leaks_nothing() -> None:
    kv = KVCacheManager(4, BS)
    hog = computed(kv, make_request("hog", 12), cached_hit=False)  # 3 of 4 blocks
    req = make_request("big", 8)
    assert not kv.allocate(req, 8)
    assert kv.block_ids("big") == []
    assert kv.num_free_blocks == 1
    kv.check_invariants()
    kv.free(req)  # freeing a request that got nothing is harmless
    kv.free(hog)
    assert kv.all_free()


def test_failed_allocation_does_not_take_the_cached_blocks_it_would_reuse() -> None:
    kv = KVCacheManager(4, BS)
    system = prompt(8, "system")
    kv.free(computed(kv, make_request("a", [*system, 1])))  # 2 cached + 1 plain block free
    filler = computed(kv, make_request("filler", 4), cached_hit=False)
    req = make_request("b", system + prompt(9, "b"))  # needs 2 cached + 3 new blocks
    hit = kv.find_cached_prefix(req)
    assert len(hit) == 2
    assert not kv.allocate(req, 9, hit)
    assert all(b.ref_cnt == 0 for b in hit)
    assert kv.num_free_blocks == 3
    kv.check_invariants()
    kv.free(filler)
    assert kv.all_free()


def test_reviving_cached_blocks_counts_against_free_space() -> None:
    kv = KVCacheManager(3, BS)
    system = prompt(8, "system")
    kv.free(computed(kv, make_request("a", [*system, 1])))  # all 3 blocks free, 2 cached
    req = make_request("b", system + prompt(5, "b"))  # 2 cached + 2 new blocks > 3
    hit = kv.find_cached_prefix(req)
    assert not kv.allocate(req, 5, hit)
    kv.check_invariants()
    assert kv.all_free()


def test_free_returns_every_block() -> None:
    kv = KVCacheManager(8, BS)
    reqs = [computed(kv, make_request(f"r{i}", 6)) for i in range(3)]
    assert kv.usage == pytest.approx(6 / 8)
    for req in reqs:
        kv.free(req)
    assert kv.all_free()
    assert kv.usage == 0.0


def test_caching_disabled_finds_no_prefix() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    tokens = prompt(9, "x")
    kv.free(computed(kv, make_request("a", tokens)))
    assert kv.find_cached_prefix(make_request("b", tokens)) == []


def test_a_freed_request_is_evicted_tail_first() -> None:
    kv = KVCacheManager(5, BS)
    tokens = prompt(17, "x")
    kv.free(computed(kv, make_request("a", tokens)))  # 5 blocks, 4 of them full and cached
    other = computed(kv, make_request("other", 3), cached_hit=False)  # a partial, uncached block
    assert len(kv.find_cached_prefix(make_request("b", tokens))) == 4, "the plain block went"
    kv.free(other)
    computed(kv, make_request("other2", 8), cached_hit=False)
    assert len(kv.find_cached_prefix(make_request("c", tokens))) == 3, "the prefix head survives"


def test_a_partly_computed_block_is_not_offered_as_a_prefix() -> None:
    kv = KVCacheManager(16, BS)
    tokens = prompt(13, "x")
    req = make_request("a", tokens)
    kv.find_cached_prefix(req)  # hashes every full block of the prompt up front
    assert kv.allocate(req, 6)  # a chunk that ends inside the second block
    assert len(kv.find_cached_prefix(make_request("b", tokens))) == 1
