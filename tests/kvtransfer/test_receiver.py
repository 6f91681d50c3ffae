"""KvReceiver end to end: senders in real processes (Gloo on CPU), the receiver in this one."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kvtransfer import KvReceiver, KvSender, ReceiverOptions, TransferError
from tests.kvtransfer.conftest import Peer, add_sender, assert_blocks_equal, blocks
from tests.kvtransfer.peer import make_caches

pytestmark = pytest.mark.timeout(120)


def send(
    peer: Peer, rx: KvReceiver, sender_id: str, tid: str, ids: list[int], **extra: object
) -> dict:
    return peer.call(
        op="send",
        id=sender_id,
        endpoint=rx.endpoint,
        transfer_id=tid,
        blocks=ids,
        timeout=10,
        **extra,
    )


def untouched(caches: list[torch.Tensor], ids: list[int]) -> bool:
    return not any(c[:, ids].any() for c in caches)


def test_round_trip_writes_exactly_the_registered_blocks(peers, receiver, rx_caches):
    add_sender(peers[0], "rt", seed=1)
    handle = receiver.expect("t1", [0, 5, 2], deadline_s=10)
    reply = send(peers[0], receiver, "rt", "t1", [3, 7, 1])
    assert reply["ok"], reply
    result = handle.wait(5)
    assert result is not None and result.ok, result
    assert result.bytes == reply["bytes"] == 3 * receiver.layout.block_bytes
    assert result.sender_id == "rt"
    assert_blocks_equal(blocks(rx_caches, [0, 5, 2]), blocks(make_caches(1, 12), [3, 7, 1]))
    assert untouched(rx_caches, [b for b in range(16) if b not in (0, 5, 2)])
    stats = receiver.stats()
    assert (stats.transfers, stats.bytes, stats.failures) == (1, result.bytes, 0)


def test_many_transfers_from_two_concurrent_senders_all_land(peers, receiver, rx_caches):
    add_sender(peers[0], "ca", seed=2)
    add_sender(peers[1], "cb", seed=3)
    src = {"ca": make_caches(2, 12), "cb": make_caches(3, 12)}
    for r in range(6):
        plan = {"ca": ([r, r + 1], [2 * (r % 4), 2 * (r % 4) + 1]), "cb": ([11 - r], [8 + r])}
        handles = {sid: receiver.expect(f"{sid}-{r}", dst, 10) for sid, (_, dst) in plan.items()}
        for peer, (sid, (ids, _)) in zip(peers, plan.items(), strict=True):
            peer.write(
                op="send",
                id=sid,
                endpoint=receiver.endpoint,
                transfer_id=f"{sid}-{r}",
                blocks=ids,
                timeout=10,
            )
        assert all(peer.read(30)["ok"] for peer in peers)
        for sid, (ids, dst) in plan.items():
            result = handles[sid].wait(5)
            assert result is not None and result.ok, result
            assert_blocks_equal(blocks(rx_caches, dst), blocks(src[sid], ids))
    assert receiver.stats().transfers == 12
    assert receiver.senders() == ["ca", "cb"]


def test_unknown_and_cancelled_transfers_are_drained_and_the_stream_stays_usable(
    peers, receiver, rx_caches
):
    add_sender(peers[0], "un", seed=4)
    reply = send(peers[0], receiver, "un", "ghost", [1, 2])
    assert not reply["ok"] and "not expected" in reply["error"]
    handle = receiver.expect("gone", [4], 10)
    assert receiver.cancel("gone") is True
    assert receiver.cancel("gone") is False  # idempotent
    result = handle.wait(0)
    assert result is not None and not result.ok and "cancel" in result.error
    reply = send(peers[0], receiver, "un", "gone", [3])
    assert not reply["ok"] and "no longer expected" in reply["error"]
    assert untouched(rx_caches, list(range(16)))
    handle = receiver.expect("next", [4], 10)
    assert send(peers[0], receiver, "un", "next", [6])["ok"]
    assert handle.wait(5).ok
    assert_blocks_equal(blocks(rx_caches, [4]), blocks(make_caches(4, 12), [6]))
    assert (receiver.stats().transfers, receiver.stats().failures) == (1, 2)


def test_layout_or_block_count_mismatch_fails_clearly_and_the_pair_survives(
    peers, receiver, rx_caches
):
    add_sender(peers[1], "wide", seed=5, head_dim=16)
    handle = receiver.expect("w1", [1], 10)
    reply = send(peers[1], receiver, "wide", "w1", [0])
    assert not reply["ok"] and "head_dim 16 != 8" in reply["error"]
    assert "layout mismatch" in handle.wait(5).error
    add_sender(peers[1], "cnt", seed=6)
    handle = receiver.expect("c1", [1, 2], 10)
    reply = send(peers[1], receiver, "cnt", "c1", [0, 1, 2])
    assert not reply["ok"] and "carries 3 blocks but 2 were reserved" in reply["error"]
    assert not handle.wait(5).ok
    assert untouched(rx_caches, list(range(16)))
    handle = receiver.expect("c2", [1, 2], 10)
    assert send(peers[1], receiver, "cnt", "c2", [0, 1])["ok"]
    assert handle.wait(5).ok
    assert_blocks_equal(blocks(rx_caches, [1, 2]), blocks(make_caches(6, 12), [0, 1]))


def test_killed_sender_fails_its_transfer_fast_and_its_restart_reconnects(receiver, rx_caches):
    victim, successor = Peer("sender"), Peer("sender")  # started together: startup overlaps
    try:
        add_sender(victim.started(), "pf", seed=7)
        handle = receiver.expect("k1", [3], deadline_s=60)
        victim.write(
            op="send",
            id="pf",
            endpoint=receiver.endpoint,
            transfer_id="k1",
            blocks=[2],
            timeout=60,
            pause_after_header=60,
        )
        assert victim.read(30) == {"event": "header_sent"}
        start = time.monotonic()
        victim.kill()
        result = handle.wait(10)
        assert result is not None and not result.ok and "broke" in result.error
        assert time.monotonic() - start < 2.5  # the peer's death, not the 3 s I/O timeout
        assert untouched(rx_caches, [3])
        add_sender(successor.started(), "pf", seed=8)  # same sender id, new process
        handle = receiver.expect("k2", [3], deadline_s=10)
        assert send(successor, receiver, "pf", "k2", [5])["ok"]
        assert handle.wait(5).ok
        assert_blocks_equal(blocks(rx_caches, [3]), blocks(make_caches(8, 12), [5]))
        assert receiver.senders() == ["pf"]
    finally:
        victim.close()
        successor.close()


def test_stalled_sender_times_out_and_the_pair_is_rebuilt(rx_caches):
    options = ReceiverOptions(io_timeout_s=0.5, unknown_grace_s=0.1)
    with KvReceiver(rx_caches, options) as rx, KvSender(make_caches(9, 12), "slow") as tx:
        handle = rx.expect("s1", [0], deadline_s=30)
        tx._after_header = lambda: time.sleep(1.5)
        with pytest.raises(TransferError):
            tx.send(rx.endpoint, "s1", [1], timeout_s=5)
        result = handle.wait(0)
        assert result is not None and not result.ok and "broke" in result.error
        assert untouched(rx_caches, [0])
        tx._after_header = None
        handle = rx.expect("s2", [0], deadline_s=10)
        tx.send(rx.endpoint, "s2", [1], timeout_s=5)
        assert handle.wait(5).ok
        assert_blocks_equal(blocks(rx_caches, [0]), blocks(make_caches(9, 12), [1]))


def test_cancel_during_the_transfer_keeps_the_blocks_untouched(rx_caches):
    with KvReceiver(rx_caches) as rx, KvSender(make_caches(10, 12), "mid") as tx:
        handle = rx.expect("m1", [6], deadline_s=30)
        tx._after_header = lambda: (time.sleep(0.3), rx.cancel("m1"))  # header already claimed
        with pytest.raises(TransferError, match="cancelled"):
            tx.send(rx.endpoint, "m1", [2], timeout_s=10)
        assert "cancel" in handle.wait(0).error
        assert untouched(rx_caches, [6])


def test_deadline_fails_a_transfer_that_never_comes(receiver):
    start = time.monotonic()
    result = receiver.expect("late", [1], deadline_s=0.3).wait(5)
    assert result is not None and not result.ok and "deadline" in result.error
    assert time.monotonic() - start < 2
    assert receiver.stats().failures == 1


def test_close_fails_pending_handles_stops_threads_and_frees_the_port(rx_caches):
    before = set(threading.enumerate())
    rx = KvReceiver(rx_caches)
    tx = KvSender(make_caches(11, 12), "closer")
    handle = rx.expect("t", [0], 10)
    tx.send(rx.endpoint, "t", [1], timeout_s=10)
    assert handle.wait(5).ok
    pending = rx.expect("never", [1], 60)
    start = time.monotonic()
    tx.close()
    rx.close()
    assert time.monotonic() - start < 5
    assert "closed" in pending.wait(0).error
    time.sleep(0.1)
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", rx.port), timeout=1).close()
    with pytest.raises(RuntimeError, match="closed"):
        rx.expect("after", [0], 1)


def test_a_sender_that_hangs_up_is_dropped_at_once(rx_caches):
    with KvReceiver(rx_caches) as rx:
        tx = KvSender(make_caches(12, 12), "brief")
        handle = rx.expect("t", [0], 10)
        tx.send(rx.endpoint, "t", [1], timeout_s=10)
        assert handle.wait(5).ok and rx.senders() == ["brief"]
        tx.close()
        deadline = time.monotonic() + 2
        while rx.senders() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.senders() == []


def test_senders_beyond_max_pairs_are_refused_with_a_reason(rx_caches):
    with (
        KvReceiver(rx_caches, ReceiverOptions(max_pairs=1)) as rx,
        KvSender(make_caches(13, 12), "first") as first,
        KvSender(make_caches(14, 12), "second") as second,
    ):
        handle = rx.expect("a", [0], 10)
        first.send(rx.endpoint, "a", [1], timeout_s=10)
        assert handle.wait(5).ok
        with pytest.raises(TransferError, match="max_pairs"):
            second.send(rx.endpoint, "b", [1], timeout_s=10)
        handle = rx.expect("c", [2], 10)
        first.send(rx.endpoint, "c", [3], timeout_s=10)  # the admitted sender is unaffected
        assert handle.wait(5).ok
