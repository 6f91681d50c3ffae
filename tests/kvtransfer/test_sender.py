"""KvSender: failures surface as TransferError within the timeout, and the sender recovers."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from kvtransfer import KvReceiver, KvSender, SenderOptions, TransferError
from tests.kvtransfer.conftest import Peer, assert_blocks_equal, blocks
from tests.kvtransfer.peer import make_caches

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_receiver_death_fails_sends_within_their_timeout_then_a_new_receiver_works():
    first, second = Peer("receiver"), Peer("receiver")  # started together: startup overlaps
    sender = KvSender(make_caches(1, 12), "s6")
    try:
        endpoint = first.started().hello["endpoint"]
        assert first.call(op="expect", transfer_id="a", blocks=[1], deadline=10) == {"ok": True}
        assert sender.send(endpoint, "a", [2], timeout_s=10).bytes > 0
        first.kill()  # idle pair: the sender learns of it on its next send
        start = time.monotonic()
        with pytest.raises(TransferError):
            sender.send(endpoint, "b", [2], timeout_s=3)
        assert time.monotonic() - start < 3.5
        endpoint = second.started().hello["endpoint"]
        assert second.call(op="expect", transfer_id="c", blocks=[1], deadline=10) == {"ok": True}
        sender._after_header = second.kill  # dies between our header and our data
        start = time.monotonic()
        with pytest.raises(TransferError):
            sender.send(endpoint, "c", [2], timeout_s=3)
        assert time.monotonic() - start < 3.5
        sender._after_header = None
        with KvReceiver(make_caches(0, 16, zero=True)) as rx:
            handle = rx.expect("d", [0, 1], deadline_s=10)
            stats = sender.send(rx.endpoint, "d", [4, 5], timeout_s=10)
            assert handle.wait(5).ok and stats.bytes == 2 * rx.layout.block_bytes
        assert (sender.stats().transfers, sender.stats().failures) == (2, 2)
    finally:
        sender.close()
        first.close()
        second.close()


def test_send_to_an_endpoint_nobody_listens_on_fails_in_time():
    with KvSender(make_caches(2, 4), "lonely") as sender:
        start = time.monotonic()
        with pytest.raises(TransferError):
            sender.send(f"127.0.0.1:{free_port()}", "x", [0], timeout_s=1)
        assert time.monotonic() - start < 3


def test_sender_rejects_bad_arguments_before_touching_the_network():
    with KvSender(make_caches(3, 4), "strict") as sender:
        for ids in ([], [4], [-1], [1, 1]):
            with pytest.raises(ValueError):
                sender.send("127.0.0.1:1", "t", ids)
        with pytest.raises(ValueError, match="host:port"):
            sender.send("nowhere", "t", [0])
    with pytest.raises(ValueError, match="sender_id"):
        KvSender(make_caches(3, 4), "has/slash")


def test_checksum_mode_round_trips_and_a_receiver_can_rebuild_after_a_sender_close(rx_caches):
    src = make_caches(4, 12)
    with KvReceiver(rx_caches) as rx:
        for attempt in range(2):  # the second sender object reuses the id: a restart
            with KvSender(src, "dbg", SenderOptions(checksum=True, chunk_bytes=1)) as sender:
                handle = rx.expect(f"t{attempt}", [7, 8], deadline_s=10)
                sender.send(rx.endpoint, f"t{attempt}", [10 - attempt, 3], timeout_s=10)
                assert handle.wait(5).ok
                assert_blocks_equal(blocks(rx_caches, [7, 8]), blocks(src, [10 - attempt, 3]))
        assert rx.stats().transfers == 2


def test_a_closed_sender_refuses_new_sends():
    sender = KvSender(make_caches(5, 4), "gone")
    sender.close()
    with pytest.raises(TransferError, match="closed"):
        sender.send("127.0.0.1:1", "t", [0])


def test_bytes_changed_on_the_way_fail_the_transfer_on_both_ends(rx_caches):
    """With checksums on, a byte flipped after the sender checksummed its chunk (as a bad link
    or a bad buffer would) fails the transfer: the sender's send raises, the receiver's handle
    says which chunk, both count a failure, and the next transfer on the same pair is fine."""

    def corrupt(chunk: torch.Tensor) -> None:
        chunk[chunk.numel() // 2] ^= 0x40

    src = make_caches(6, 12)
    with (
        KvReceiver(rx_caches) as rx,
        KvSender(src, "bad", SenderOptions(checksum=True, chunk_bytes=1)) as tx,
    ):
        handle = rx.expect("t", [3, 4], deadline_s=10)
        tx._after_gather = corrupt
        with pytest.raises(TransferError, match="KV checksum mismatch for transfer 't': chunk 0"):
            tx.send(rx.endpoint, "t", [1, 2], timeout_s=10)
        result = handle.wait(0)
        assert not result.ok and "checksum mismatch" in result.error
        assert (tx.stats().failures, rx.stats().failures) == (1, 1)
        tx._after_gather = None
        again = rx.expect("t2", [3, 4], deadline_s=10)
        assert tx.send(rx.endpoint, "t2", [1, 2], timeout_s=10).bytes > 0  # same pair
        assert again.wait(5).ok
        assert_blocks_equal(blocks(rx_caches, [3, 4]), blocks(src, [1, 2]))


def test_without_checksums_nothing_is_verified_and_no_trailer_is_sent(rx_caches):
    """The check costs a pass over the bytes on each end, so it is the sender's choice
    (--kv-checksum): off, a changed byte goes through (what the check is for)."""
    src = make_caches(6, 12)
    with KvReceiver(rx_caches) as rx, KvSender(src, "plain", SenderOptions(chunk_bytes=1)) as tx:
        handle = rx.expect("t", [3], deadline_s=10)
        tx._after_gather = lambda chunk: chunk.__setitem__(0, chunk[0] ^ 1)
        tx.send(rx.endpoint, "t", [1], timeout_s=10)
        assert handle.wait(5).ok
        assert not torch.equal(blocks(rx_caches, [3])[0], blocks(src, [1])[0])
