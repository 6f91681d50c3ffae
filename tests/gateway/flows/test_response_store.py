"""The gateway's store of responses: bounded by count and by size, least recently used first."""

from __future__ import annotations

from typing import Any

from gateway.flows.response_store import ResponseStore


def response(rid: str, text: str = "x") -> dict[str, Any]:
    return {"id": rid, "output": [{"type": "message", "content": [{"text": text}]}]}


def test_the_history_is_the_context_then_the_output() -> None:
    store = ResponseStore(4, 1 << 20)
    store.put(response("a"), [{"type": "message", "id": "m1"}])
    entry = store.get("a")
    assert entry is not None
    assert [i.get("id", i["type"]) for i in entry.history] == ["m1", "message"]


def test_past_the_count_the_least_recently_used_goes() -> None:
    store = ResponseStore(2, 1 << 20)
    store.put(response("a"), [])
    store.put(response("b"), [])
    assert store.get("a") is not None  # a is now the most recent
    store.put(response("c"), [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2


def test_past_the_size_the_oldest_go_and_one_too_large_is_not_kept() -> None:
    store = ResponseStore(100, 300)
    store.put(response("a", "x" * 100), [])
    store.put(response("b", "y" * 100), [])
    store.put(response("c", "z" * 100), [])
    assert store.get("a") is None and store.get("c") is not None
    assert not store.put(response("big", "w" * 400), [])
    assert store.get("big") is None and store.get("c") is not None


def test_delete_and_a_store_of_size_zero() -> None:
    store = ResponseStore(2, 1 << 20)
    store.put(response("a"), [])
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    off = ResponseStore(0, 1 << 20)
    assert not off.enabled and not off.put(response("a"), []) and off.get("a") is None


def test_a_running_response_is_held_then_settled() -> None:
    store = ResponseStore(2, 1 << 20)
    store.start({**response("a"), "status": "in_progress"}, [])
    entry = store.get("a")
    assert entry is not None and entry.response["status"] == "in_progress"
    store.settle({**response("a"), "status": "completed"}, [], keep=True)
    entry = store.get("a")
    assert entry is not None and entry.response["status"] == "completed"
    store.settle({**response("a"), "status": "failed"}, [], keep=False)  # settled once only
    assert store.get("a") is not None


def test_a_response_deleted_while_it_runs_stays_deleted() -> None:
    store = ResponseStore(2, 1 << 20)
    store.start(response("a"), [])
    assert store.delete("a") and store.get("a") is None
    store.settle(response("a"), [], keep=True)
    assert store.get("a") is None and len(store) == 0 and not store._running


def test_a_failed_one_goes_and_one_the_bounds_dropped_comes_back_at_its_end() -> None:
    store = ResponseStore(1, 1 << 20)
    store.start(response("a"), [])
    store.settle(response("a"), [], keep=False)
    assert store.get("a") is None and not store._running
    store.start(response("b"), [])
    store.put(response("c"), [])  # the count drops b while it runs
    assert store.get("b") is None
    store.settle(response("b"), [], keep=True)
    assert store.get("b") is not None and not store._running
