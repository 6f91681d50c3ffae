"""Handoffs: which transfers the engine's final-chunk hook submits, and that a request's blocks
are released only once no transfer reads them (a fake sender: no model, no pair)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer import LayerReady
from kvtransfer.grants import Grant
from services.engine.kv_handoff import FinalChunk
from services.prefill.handoff import Handoffs

LAYERS = 4


@dataclass
class FakeLayout:
    num_layers: int = LAYERS


@dataclass
class FakeSender:
    layout: FakeLayout = field(default_factory=FakeLayout)
    sent: list[tuple[str, str, list[int], Any]] = field(default_factory=list)
    grants: list[Grant | None] = field(default_factory=list)
    futures: list[Future[Any]] = field(default_factory=list)

    def submit(
        self, endpoint: str, transfer_id: str, block_ids: list[int], timeout_s: float,
        ready: LayerReady | None = None, grant: Grant | None = None,
    ) -> Future[Any]:  # fmt: skip
        self.sent.append((endpoint, transfer_id, block_ids, ready))
        self.grants.append(grant)
        self.futures.append(Future())
        return self.futures[-1]


def _handoffs() -> tuple[Handoffs, FakeSender]:
    sender = FakeSender()
    return Handoffs(sender, torch.device("cpu"), 5.0), sender  # type: ignore[arg-type]


def test_the_hook_submits_each_open_call_once_with_one_shared_ready() -> None:
    handoffs, sender = _handoffs()
    a = handoffs.open("a", "host:1", "res-a")
    b = handoffs.open("b", "host:2", "res-b")
    assert a is not None and b is not None
    assert handoffs.open("a", "host:9", "other") is None  # one call per request id
    finals = [FinalChunk("a", [3, 4], 20), FinalChunk("x", [7], 5), FinalChunk("b", [5], 9)]
    ready = handoffs.on_final_chunks(finals)  # "x" has no open call (no KV target)
    assert ready is not None and ready.num_layers == LAYERS
    assert sender.sent == [("host:1", "res-a", [3, 4], ready), ("host:2", "res-b", [5], ready)]
    assert a.streamed and a.future is sender.futures[0]
    assert handoffs.on_final_chunks(finals) is None  # never twice
    assert len(sender.sent) == 2


def test_a_queued_transfer_is_cancelled_and_its_blocks_released_at_once() -> None:
    handoffs, sender = _handoffs()
    handoff = handoffs.open("q", "host:1", "res-q")
    assert handoff is not None
    handoffs.on_final_chunks([FinalChunk("q", [1], 4)])
    released: list[str] = []
    handoffs.finish(handoff, lambda: released.append("q"))
    assert sender.futures[0].cancelled() and released == ["q"]
    assert handoffs.open("q", "host:1", "res-q2") is not None  # the id is free again


def test_a_running_transfer_keeps_its_blocks_until_it_ends() -> None:
    handoffs, sender = _handoffs()
    handoff = handoffs.open("r", "host:1", "res-r")
    assert handoff is not None
    handoffs.on_final_chunks([FinalChunk("r", [1], 4)])
    future = sender.futures[0]
    assert future.set_running_or_notify_cancel()  # the pair's thread took it
    released: list[str] = []
    assert handoffs.close("r", lambda: released.append("abort"))  # an Abort RPC
    handoffs.finish(handoff, lambda: released.append("release"))  # then the call ends
    assert released == []
    future.set_exception(RuntimeError("receiver went away"))
    assert released == ["abort", "release"]


def test_after_close_no_transfer_starts() -> None:
    handoffs, sender = _handoffs()
    streamed = handoffs.open("s", "host:1", "res-s")
    whole = handoffs.open("w", "host:1", "res-w")
    assert streamed is not None and whole is not None
    released: list[str] = []
    assert handoffs.close("s", lambda: released.append("s"))
    assert handoffs.close("w", lambda: released.append("w"))
    assert not handoffs.close("nobody", lambda: released.append("nobody"))
    assert handoffs.on_final_chunks([FinalChunk("s", [1], 4)]) is None
    assert handoffs.submit_whole(whole, [2]) is None
    assert sender.sent == [] and released == ["s", "w"]


def test_the_whole_kv_is_submitted_without_readiness() -> None:
    handoffs, sender = _handoffs()
    handoff = handoffs.open("o", "host:1", "res-o")
    assert handoff is not None
    future = handoffs.submit_whole(handoff, [8, 9])
    assert future is sender.futures[0] and sender.sent == [("host:1", "res-o", [8, 9], None)]
    assert not handoff.streamed
    assert sender.grants == [None]


def test_a_whole_kv_goes_with_its_grant_when_the_grant_fits() -> None:
    """Blocks granted with the reservation reach the sender with the whole KV; a grant of
    another block count (the decode side reserved for another length) is not passed on."""
    handoffs, sender = _handoffs()
    grant = Grant("pool", 3, 8, (5, 6))
    fits = handoffs.open("g", "host:1", "res-g", grant)
    other = handoffs.open("h", "host:1", "res-h", grant)
    assert fits is not None and other is not None
    handoffs.submit_whole(fits, [8, 9])
    handoffs.submit_whole(other, [8, 9, 10])
    assert sender.grants == [grant, None]
