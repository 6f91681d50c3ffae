"""The draft model's KV bookkeeping: what it still holds after drafts are rejected, blocks
given back, and least recently used entries evicted (never one that is proposing)."""

from __future__ import annotations

from services.engine.draft_tables import DraftTables, tokens_between


def test_tokens_between_spans_prompt_and_output() -> None:
    prompt, output = [1, 2, 3], [4, 5]
    assert [tokens_between(prompt, output, 0, n) for n in range(6)] == [
        (prompt + output)[:n] for n in range(6)
    ]
    assert tokens_between(prompt, output, 2, 5) == [3, 4, 5]
    assert tokens_between(prompt, output, 3, 5) == [4, 5]


def test_the_valid_prefix_ends_at_the_first_rejected_draft_and_never_covers_the_last() -> None:
    t = DraftTables(num_blocks=8, block_size=4)
    prompt = [10, 11, 12, 13, 14]
    assert t.valid_prefix("a", prompt, []) == 0
    assert t.reserve("a", 5 + 2, keep={"a"})
    t.record("a", [*prompt, 20, 21], known=5)  # fed the prompt, then drafts 20 21 (22 not fed)
    assert t.valid_prefix("a", prompt, []) == 4  # unchanged tokens: the last is fed again
    assert t.valid_prefix("a", prompt, [20, 21, 22, 7]) == 7  # all kept, bonus 7 unseen
    assert t.valid_prefix("a", prompt, [20, 9]) == 6  # the second draft was rejected
    assert t.valid_prefix("a", prompt, [8]) == 5  # the first was
    t.check_invariants()


def test_rewind_gives_back_the_blocks_past_the_kept_tokens() -> None:
    t = DraftTables(num_blocks=4, block_size=4)
    assert t.reserve("a", 13, keep={"a"})  # four blocks
    t.record("a", list(range(13)), known=10)
    assert t.pool.num_free_blocks == 0
    t.rewind("a", 9)  # three blocks hold 9 tokens
    assert t.pool.num_free_blocks == 1 and len(t.block_ids("a")) == 3
    assert t.valid_prefix("a", list(range(9)), [9, 10]) == 9
    t.check_invariants()
    t.drop("a")
    assert t.pool.num_free_blocks == 4 and "a" not in t
    t.check_invariants()


def test_a_full_pool_evicts_the_least_recently_used_entry_not_a_proposing_one() -> None:
    t = DraftTables(num_blocks=4, block_size=4)
    for rid in ("old", "mid"):
        assert t.reserve(rid, 8, keep={rid})
        t.record(rid, list(range(8)), known=8)
    assert t.reserve("mid", 8, keep={"mid"})  # used again: "old" is now the oldest
    assert t.reserve("new", 4, keep={"new"})
    assert "old" not in t and "mid" in t and t.evictions == 1
    # neither "mid" nor "new" may go while both propose: the pool cannot hold 12 more tokens
    assert not t.reserve("new", 16, keep={"mid", "new"})
    assert "mid" in t and len(t.block_ids("new")) == 1
    t.check_invariants()


def test_a_prompt_chunk_takes_free_blocks_only_never_evicting() -> None:
    """What the draft prefills beside the target waits for room; a proposing request evicts."""
    t = DraftTables(num_blocks=4, block_size=4)
    assert t.reserve("a", 12, keep=(), evict=False)  # three blocks: free ones
    t.record("a", list(range(12)), known=12)
    assert not t.reserve("b", 8, keep=(), evict=False)  # two needed, one free: "a" stays
    assert t.block_ids("a") and t.pool.num_free_blocks == 1
    assert t.reserve("b", 8, keep={"b"})  # a proposal may evict "a"
    assert "a" not in t and t.evictions == 1
    t.check_invariants()
