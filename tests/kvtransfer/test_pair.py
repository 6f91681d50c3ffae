"""PairChannel: byte-exact ordered transfer, bounded waits, and prompt failure on teardown."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kvtransfer.device import GLOO
from kvtransfer.pair import RECEIVER_RANK, SENDER_RANK, ChannelError, PairChannel
from kvtransfer.stores import clone, serve_store

pytestmark = pytest.mark.timeout(30)
CPU = torch.device("cpu")


@pytest.fixture
def channels() -> Iterator[tuple[PairChannel, PairChannel]]:
    """Both ends of one Gloo pair in this process (built concurrently, as two workers would)."""
    store, _ = serve_store("127.0.0.1", 0, 5)
    prefix = f"test/{uuid.uuid4().hex}"
    ends: dict[int, PairChannel] = {}

    def build(rank: int) -> None:
        client = dist.PrefixStore(prefix, clone(store, timedelta(seconds=5)))
        ends[rank] = PairChannel.open(
            client, rank, GLOO, CPU, time.monotonic() + 5, gloo_address="127.0.0.1"
        )

    threads = [threading.Thread(target=build, args=(r,)) for r in (SENDER_RANK, RECEIVER_RANK)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    yield ends[SENDER_RANK], ends[RECEIVER_RANK]
    for end in ends.values():
        end.close()


def test_bytes_arrive_exactly_and_in_order(channels):
    tx, rx = channels
    payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1, 1000, 65537)]
    got = [torch.empty_like(p) for p in payloads]

    def receive() -> None:
        for buf in got:
            rx.recv(buf, time.monotonic() + 5)

    worker = threading.Thread(target=receive)
    worker.start()
    for p in payloads:
        tx.send(p, time.monotonic() + 5)
    worker.join(10)
    assert all(torch.equal(a, b) for a, b in zip(payloads, got, strict=True))


def test_a_wait_past_its_deadline_raises(channels):
    _, rx = channels
    start = time.monotonic()
    with pytest.raises(ChannelError, match="recv failed"):
        rx.recv(torch.empty(8, dtype=torch.uint8), time.monotonic() + 0.3)
    assert time.monotonic() - start < 2


def test_closing_one_end_fails_the_other_ends_pending_receive_at_once(channels):
    tx, rx = channels
    threading.Timer(0.2, tx.close).start()
    start = time.monotonic()
    with pytest.raises(ChannelError):
        rx.recv(torch.empty(8, dtype=torch.uint8), time.monotonic() + 10)
    assert time.monotonic() - start < 2
    assert tx.closed
    with pytest.raises(RuntimeError, match="closed"):
        tx.send(torch.empty(1, dtype=torch.uint8), time.monotonic() + 1)
