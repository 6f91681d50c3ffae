"""The one-GPU path (cuda_ipc) of a pair, on the CPU: the protocol and the receiver's copies.

CUDA IPC itself needs a GPU (tests/kvtransfer/test_gpu.py); here both ends run in this process,
the backend choice is forced to cuda_ipc and "opening" the shared pool hands the sender the
receiver's own tensors, so everything else (handshake, Go with the receiver's blocks, layers
copied as they are written, cancels with Stop, checksums, a sender giving up, the Gloo
fallback) runs as it does between two processes on one GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtransfer import (
    KvReceiver,
    KvSender,
    LayerReady,
    ReceiverOptions,
    SenderOptions,
    receiver_pair,
    sender_pair,
)
from kvtransfer import receiver as receiver_mod
from kvtransfer.device import IPC
from kvtransfer.results import TransferError
from kvtransfer.wire import Done, Go, Opened, Share, Stop, WireError, decode, encode, from_runs
from tests.kvtransfer.conftest import assert_blocks_equal, blocks
from tests.kvtransfer.peer import LAYOUT, make_caches

LAYERS = LAYOUT["num_layers"]


class FakeEvent:
    """Stands in for the sender's interprocess event: CPU copies are done once queued, unless
    a test holds them (``held``: query() says they are still running)."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.records = 0
        self.queries = 0

    def record(self, stream: Any = None) -> None:
        self.records += 1

    def query(self) -> bool:
        self.queries += 1
        return not self.held.is_set()

    def synchronize(self) -> None:
        while self.held.is_set():
            time.sleep(0.001)


class FakeIpc:
    """Stands in for CUDA IPC: the receiver "exports" a key, the sender "opens" its tensors."""

    def __init__(self) -> None:
        self.pools: dict[str, list[torch.Tensor]] = {}
        self.fail_open = ""
        self.events: dict[str, FakeEvent] = {}

    def share_event(self, device: Any) -> tuple[FakeEvent, str]:
        handle = f"{len(self.events):04x}"
        self.events[handle] = FakeEvent()
        return self.events[handle], handle

    def open_event(self, device: Any, handle: str) -> FakeEvent:
        return self.events[handle]

    def export(self, caches: list[torch.Tensor]) -> list[dict[str, Any]]:
        key = str(len(self.pools))
        self.pools[key] = caches
        return [{"key": key, "layer": i} for i in range(len(caches))]

    def check(self, pool: list[dict[str, Any]], layout: Any) -> int:
        if self.fail_open:
            raise RuntimeError(self.fail_open)
        return self.pools[pool[0]["key"]][0].shape[1]

    def open(self, pool: list[dict[str, Any]], layout: Any, device: Any) -> list[torch.Tensor]:
        return self.pools[pool[0]["key"]]


@pytest.fixture
def ipc(monkeypatch: pytest.MonkeyPatch) -> FakeIpc:
    fake = FakeIpc()
    monkeypatch.setattr(receiver_mod, "choose_backend", lambda _s, _r: IPC)
    monkeypatch.setattr(receiver_pair, "export_pool", fake.export)
    monkeypatch.setattr(sender_pair, "check_pool", fake.check)
    monkeypatch.setattr(sender_pair, "open_pool", fake.open)
    monkeypatch.setattr(sender_pair, "share_event", fake.share_event)
    monkeypatch.setattr(receiver_pair, "open_event", fake.open_event)
    return fake


@pytest.fixture
def rx(ipc: FakeIpc) -> Iterator[tuple[KvReceiver, list[torch.Tensor]]]:
    caches = make_caches(0, 16, zero=True)
    with KvReceiver(caches, ReceiverOptions(io_timeout_s=5, unknown_grace_s=0.2)) as receiver:
        yield receiver, caches


def landed(rx: torch.Tensor, dst: list[int], tx: torch.Tensor, src: list[int], what: str) -> None:
    """Wait (5 s at most) until blocks ``dst`` of the receiver's layer ``rx`` hold blocks
    ``src`` of the sender's ``tx``."""
    deadline = time.monotonic() + 5
    while not torch.equal(rx[:, dst], tx[:, src]):
        assert time.monotonic() < deadline, f"{what} was not copied once written"
        time.sleep(0.005)


def _pair_backend(sender: KvSender) -> str:
    queues = list(sender._queues.values())
    return queues[0].pair.backend if queues else ""


def test_a_computed_kv_is_copied_out_of_the_shared_pool(rx, ipc: FakeIpc) -> None:
    receiver, rx_caches = rx
    src = make_caches(1, 12)
    with KvSender(src, "one-gpu") as tx:
        for k, (s, d) in enumerate((([4, 5, 6, 11], [9, 1, 2, 3]), ([0], [15]))):
            handle = receiver.expect(f"t{k}", d)
            stats = tx.send(receiver.endpoint, f"t{k}", s, timeout_s=10)
            assert stats.bytes == tx.layout.block_bytes * len(s)
            assert handle.wait(5).ok
            assert_blocks_equal(blocks(rx_caches, d), blocks(src, s))
        assert _pair_backend(tx) == IPC  # one pair, no process group
        assert receiver.backends() == {"one-gpu": IPC}
    assert receiver.stats().transfers == 2
    assert list(ipc.pools) == ["0"]  # the pool is shared once per pair


def test_the_receiver_waits_for_copies_still_running_after_the_senders_done(rx, ipc) -> None:
    """Done comes once the copies are queued: until the sender's event says they ran, the
    receiver neither resolves the transfer nor acknowledges it."""
    receiver, rx_caches = rx
    src = make_caches(10, 12)
    with KvSender(src, "pending") as tx:
        first = receiver.expect("warm", [0])
        tx.send(receiver.endpoint, "warm", [1], timeout_s=10)  # builds the pair
        assert first.wait(5).ok
        (event,) = ipc.events.values()
        event.held.set()  # the next copies "run" until released
        handle = receiver.expect("held", [2, 3])
        future = tx.submit(receiver.endpoint, "held", [4, 5], timeout_s=10)
        deadline = time.monotonic() + 5
        while event.queries < 3:  # the receiver got the Done and polls the event
            assert time.monotonic() < deadline, "the receiver never waited on the event"
            time.sleep(0.005)
        assert not handle.done() and not future.done()
        event.held.clear()
        assert future.result(10).bytes > 0
        assert handle.wait(5).ok and event.records == 2  # once a transfer, after its copies
    assert_blocks_equal(blocks(rx_caches, [2, 3]), blocks(src, [4, 5]))


def test_layers_are_copied_as_they_are_written_and_land_before_the_last_one(rx) -> None:
    receiver, rx_caches = rx
    src = make_caches(2, 12)
    ready = LayerReady(LAYERS)
    handle = receiver.expect("s", [7, 8])
    with KvSender(src, "stream") as tx:
        future = tx.submit(receiver.endpoint, "s", [3, 4], timeout_s=10, ready=ready)
        for layer in range(LAYERS - 1):
            ready.record(layer)
            landed(rx_caches[layer], [7, 8], src[layer], [3, 4], f"layer {layer}")
        assert not handle.done() and torch.all(rx_caches[LAYERS - 1] == 0)  # not yet written
        ready.record(LAYERS - 1)
        assert future.result(10).bytes > 0
    assert handle.wait(5).ok
    assert_blocks_equal(blocks(rx_caches, [7, 8]), blocks(src, [3, 4]))


def test_a_failed_prefill_fails_the_transfer_and_the_pair_is_rebuilt(rx, ipc: FakeIpc) -> None:
    receiver, rx_caches = rx
    src = make_caches(3, 12)
    ready = LayerReady(LAYERS)
    handle = receiver.expect("f", [1])
    with KvSender(src, "fails") as tx:
        future = tx.submit(receiver.endpoint, "f", [2], timeout_s=10, ready=ready)
        ready.record(0)
        ready.fail("the forward raised")
        with pytest.raises(TransferError, match="the forward raised"):
            future.result(10)
        result = handle.wait(5)
        assert result is not None and not result.ok and "gave up" in result.error
        again = receiver.expect("g", [1])
        tx.send(receiver.endpoint, "g", [2], timeout_s=10)  # a new pair, a new share
        assert again.wait(5).ok and len(ipc.pools) == 2
    assert_blocks_equal(blocks(rx_caches, [1]), blocks(src, [2]))


def test_a_cancel_mid_stream_stops_the_copies_and_the_sender_is_told(rx) -> None:
    receiver, rx_caches = rx
    src = make_caches(4, 12)
    ready = LayerReady(LAYERS)
    handle = receiver.expect("c", [5])
    with KvSender(src, "cancelled") as tx:
        future = tx.submit(receiver.endpoint, "c", [6], timeout_s=10, ready=ready)
        ready.record(0)
        landed(rx_caches[0], [5], src[0], [6], "layer 0")
        assert receiver.cancel("c", "client went away")  # the blocks are the caller's again
        for layer in range(1, LAYERS):
            ready.record(layer)
        with pytest.raises(TransferError, match="client went away"):
            future.result(10)
    assert not handle.wait(0).ok
    assert all(torch.all(rx_caches[layer][:, 5] == 0) for layer in range(1, LAYERS))


def test_checksums_compare_the_copy_with_the_senders_blocks(rx, monkeypatch) -> None:
    from kernels.block_copy import RefBlockCopier

    receiver, rx_caches = rx
    src = make_caches(5, 12)
    with KvSender(src, "sums", SenderOptions(checksum=True)) as tx:
        ok = receiver.expect("ok", [2, 3])
        tx.send(receiver.endpoint, "ok", [0, 1], timeout_s=10)
        assert ok.wait(5).ok

        real = RefBlockCopier.copy_from

        def corrupting(self: Any, *args: Any) -> None:
            real(self, *args)
            rx_caches[0][0, 2, 0, 0, 0] += 1.0  # a bad copy

        monkeypatch.setattr(RefBlockCopier, "copy_from", corrupting)
        bad = receiver.expect("bad", [2, 3])
        with pytest.raises(TransferError, match="checksum mismatch"):
            tx.send(receiver.endpoint, "bad", [0, 1], timeout_s=10)
        result = bad.wait(5)
        assert result is not None and "checksum mismatch" in result.error
    assert receiver.stats().failures == 1


def test_refusals_keep_the_pair(rx) -> None:
    receiver, _ = rx
    with KvSender(make_caches(6, 12), "refused") as tx:
        with pytest.raises(TransferError, match="not expected"):
            tx.send(receiver.endpoint, "nobody", [0], timeout_s=10)
        receiver.expect("short", [1, 2])
        with pytest.raises(TransferError, match="2 were reserved"):
            tx.send(receiver.endpoint, "short", [0], timeout_s=10)
        assert receiver.senders() == ["refused"]  # same pair throughout


def test_a_receiver_that_cannot_open_the_pool_falls_back_to_gloo(rx, ipc: FakeIpc) -> None:
    receiver, rx_caches = rx
    ipc.fail_open = "cudaIpcOpenMemHandle: invalid argument"
    src = make_caches(7, 12)
    with KvSender(src, "fallback") as tx:
        handle = receiver.expect("t", [4])
        tx.send(receiver.endpoint, "t", [9], timeout_s=10)
        assert handle.wait(5).ok and _pair_backend(tx) == "gloo"
        assert receiver.backends() == {"fallback": "gloo"}
    assert_blocks_equal(blocks(rx_caches, [4]), blocks(src, [9]))


def test_messages_of_the_shared_path_round_trip_and_bad_ones_are_refused() -> None:
    for msg in (Share(({"a": 1},)), Opened(IPC), Opened("gloo", "why"), Go(3, (7, 8, 9, 2, 3)),
                Opened(IPC, event="00ff"), Done(3), Done(4, True), Done(5, False, (12345,)),
                Done(6, pending=True), Stop(3)):  # fmt: skip
        assert decode(encode(msg)) == msg
    assert encode(Go(1, (4, 5, 6, 9))).count(b"[") == 3  # runs, not every id
    assert from_runs([[0, 3], [10, 1]]) == (0, 1, 2, 10)
    for runs in ([[0, 0], [1, 4]], [[-1, 4]], "0-4", [], [[1]]):
        with pytest.raises(WireError):
            from_runs(runs)
    for bad in (b'{"t": "opened", "backend": "nccl", "error": ""}',
                b'{"t": "done", "seq": 1, "stopped": 1, "checksums": [], "pending": false}',
                b'{"t": "done", "seq": 1, "stopped": false, "checksums": [], "pending": 0}',
                b'{"t": "opened", "backend": "cuda_ipc", "error": "", "event": "zz"}',
                b'{"t": "opened", "backend": "gloo", "error": "", "event": "00"}',
                b'{"t": "go", "seq": 0, "runs": [[0, 1]]}'):  # fmt: skip
        with pytest.raises(WireError):
            decode(bad)


def test_a_stalled_stream_fails_at_the_receivers_io_timeout(ipc: FakeIpc) -> None:
    caches = make_caches(0, 4, zero=True)
    opts = ReceiverOptions(io_timeout_s=0.3, unknown_grace_s=0.2)
    with KvReceiver(caches, opts) as receiver, KvSender(make_caches(8, 4), "slow") as tx:
        ready = LayerReady(LAYERS)
        handle = receiver.expect("t", [0])
        future = tx.submit(receiver.endpoint, "t", [1], timeout_s=10, ready=ready)
        ready.record(0)  # and nothing more: the prefill hangs
        result = handle.wait(5)
        assert result is not None and not result.ok and "broke" in result.error
        threading.Thread(target=ready.fail, args=("stopped",), daemon=True).start()
        with pytest.raises(TransferError):
            future.result(10)


def test_a_cancel_with_on_free_never_waits_for_a_sender_still_copying(rx) -> None:
    """The decode worker cancels on its event loop: while a sender on the same GPU is still
    copying, cancel returns at once and on_free runs from another thread once it stopped."""
    receiver, rx_caches = rx
    src = make_caches(9, 12)
    ready = LayerReady(LAYERS)
    handle = receiver.expect("d", [5])
    freed: list[int] = []
    with KvSender(src, "deferred") as tx:
        future = tx.submit(receiver.endpoint, "d", [6], timeout_s=10, ready=ready)
        ready.record(0)
        landed(rx_caches[0], [5], src[0], [6], "layer 0")  # it is copying
        done = threading.Event()
        assert receiver.cancel("d", "client went away", on_free=lambda: (
            freed.append(threading.get_ident()), done.set()))  # fmt: skip
        assert done.wait(5) and freed != [threading.get_ident()]
        for layer in range(1, LAYERS):
            ready.record(layer)
        with pytest.raises(TransferError, match="client went away"):
            future.result(10)
    assert not handle.wait(0).ok
    assert all(torch.all(rx_caches[layer][:, 5] == 0) for layer in range(1, LAYERS))
    immediate: list[int] = []
    assert not receiver.cancel("nobody", on_free=lambda: immediate.append(1))
    assert immediate == [1]  # nothing to wait for: freed right here


def test_a_sender_gone_while_its_copies_are_awaited_fails_the_transfer(ipc: FakeIpc) -> None:
    """The receiver polls the sender's event after a pending Done: a sender that hangs up
    meanwhile (its copies may never finish) fails the transfer at once, not at the I/O timeout
    (a minute here)."""
    caches = make_caches(0, 8, zero=True)
    opts = ReceiverOptions(io_timeout_s=60, unknown_grace_s=0.2)
    with KvReceiver(caches, opts) as receiver, KvSender(make_caches(11, 8), "vanishing") as tx:
        first = receiver.expect("warm", [0])
        tx.send(receiver.endpoint, "warm", [1], timeout_s=10)
        assert first.wait(5).ok
        (event,) = ipc.events.values()
        event.held.set()
        handle = receiver.expect("lost", [2])
        future = tx.submit(receiver.endpoint, "lost", [3], timeout_s=30)
        deadline = time.monotonic() + 5
        while event.queries < 3:
            assert time.monotonic() < deadline, "the receiver never waited on the event"
            time.sleep(0.005)
        (queue,) = tx._queues.values()
        conn = queue.pair._conn
        assert conn is not None
        conn.shutdown()  # the sender's end goes away mid-wait
        result = handle.wait(10)
        assert result is not None and not result.ok and "broke" in result.error
        event.held.clear()
        with pytest.raises(TransferError):
            future.result(10)
