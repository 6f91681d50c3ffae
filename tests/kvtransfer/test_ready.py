"""LayerReady, and sends that stream the KV out layer by layer while a producer writes it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtransfer import (
    KvReceiver,
    KvSender,
    LayerReady,
    LayerReadyError,
    ReceiverOptions,
    SenderOptions,
    TransferError,
)
from tests.kvtransfer.conftest import assert_blocks_equal, blocks
from tests.kvtransfer.peer import make_caches

pytestmark = pytest.mark.timeout(60)


def test_wait_blocks_until_the_layer_or_a_later_one_is_recorded():
    ready = LayerReady(4)
    threading.Timer(0.2, ready.record, args=(2,)).start()
    start = time.monotonic()
    assert ready.wait(1, time.monotonic() + 5) is None  # layer 2 covers layers 0..2 (on CPU)
    assert 0.15 < time.monotonic() - start < 2
    assert ready.wait(0, time.monotonic()) is None  # already recorded: no waiting
    with pytest.raises(ValueError, match="after layer 2"):
        ready.record(2)
    with pytest.raises(ValueError):
        ready.record(4)


def test_wait_raises_on_failure_or_deadline_but_recorded_layers_stay_usable():
    ready = LayerReady(3)
    ready.record(0)
    start = time.monotonic()
    with pytest.raises(LayerReadyError, match="deadline"):
        ready.wait(1, time.monotonic() + 0.2)
    assert time.monotonic() - start < 1
    threading.Timer(0.1, ready.fail, args=("forward raised",)).start()
    with pytest.raises(LayerReadyError, match="forward raised"):
        ready.wait(2, time.monotonic() + 10)
    assert ready.wait(0, time.monotonic()) is None
    assert LayerReady.written(3).wait(2, time.monotonic()) is None
    with pytest.raises(ValueError):
        LayerReady(0)


class Producer(threading.Thread):
    """Writes ``src`` into ``caches`` one layer at a time, recording each layer (a forward pass);
    with ``fail_at``, fails instead of writing that layer."""

    def __init__(
        self, caches: list[torch.Tensor], src: list[torch.Tensor], fail_at: int = -1
    ) -> None:
        super().__init__(daemon=True)
        self.caches, self.src, self.fail_at = caches, src, fail_at
        self.ready = LayerReady(len(caches))

    def run(self) -> None:
        for i, (cache, new) in enumerate(zip(self.caches, self.src, strict=True)):
            time.sleep(0.05)  # computing the layer
            if i == self.fail_at:
                self.ready.fail("the forward pass raised")
                return
            cache.copy_(new)
            self.ready.record(i)


@pytest.mark.parametrize("checksum", [False, True])
def test_a_streamed_send_ships_each_layer_only_once_it_is_written(checksum):
    caches = make_caches(20, 12, layout={"num_layers": 6})  # stale KV until the producer runs
    fresh = make_caches(21, 12, layout={"num_layers": 6})
    rx = [torch.zeros_like(c) for c in caches]
    options = SenderOptions(checksum=checksum, streaming_chunk_bytes=1)  # a chunk per layer
    with KvReceiver(rx) as receiver, KvSender(caches, "stream", options) as tx:
        handle = receiver.expect("s1", [4, 0], deadline_s=10)
        producer = Producer(caches, fresh)
        start = time.monotonic()
        producer.start()
        stats = tx.send(receiver.endpoint, "s1", [7, 2], timeout_s=10, ready=producer.ready)
        assert time.monotonic() - start >= 6 * 0.05  # the last layer came last
        assert handle.wait(5).ok and stats.bytes == 2 * receiver.layout.block_bytes
        assert_blocks_equal(blocks(rx, [4, 0]), blocks(fresh, [7, 2]))


def test_a_producer_failure_fails_both_ends_at_once_and_the_next_send_works():
    caches = make_caches(22, 12, layout={"num_layers": 6})
    rx = [torch.zeros_like(c) for c in caches]
    options = ReceiverOptions(io_timeout_s=30)  # the failure must not wait for this
    with (
        KvReceiver(rx, options) as receiver,
        KvSender(caches, "fails", SenderOptions(streaming_chunk_bytes=1)) as tx,
    ):
        handle = receiver.expect("f1", [1], deadline_s=30)
        producer = Producer(caches, make_caches(23, 12, layout={"num_layers": 6}), fail_at=3)
        producer.start()
        start = time.monotonic()
        with pytest.raises(TransferError, match="forward pass raised"):
            tx.send(receiver.endpoint, "f1", [5], timeout_s=30, ready=producer.ready)
        result = handle.wait(5)
        assert result is not None and not result.ok and "broke" in result.error
        assert time.monotonic() - start < 3
        handle = receiver.expect("f2", [1], deadline_s=10)
        tx.send(receiver.endpoint, "f2", [5], timeout_s=10, ready=LayerReady.written(6))
        assert handle.wait(5).ok
        assert_blocks_equal(blocks(rx, [1]), blocks(caches, [5]))


def test_a_send_refuses_readiness_for_another_layer_count():
    with KvSender(make_caches(24, 4), "count") as tx, pytest.raises(ValueError, match="layers"):
        tx.send("127.0.0.1:1", "t", [0], ready=LayerReady(5))


def test_ranges_follow_what_the_producer_recorded():
    ready = LayerReady(6)
    for layer in (0, 2, 3, 5):  # layer 1 comes with 2, layer 4 with 5
        ready.record(layer)
    assert [(a, b) for a, b, _ in ready.ranges(0, 6)] == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert [(a, b) for a, b, _ in ready.ranges(2, 5)] == [(2, 3), (3, 4), (4, 5)]
