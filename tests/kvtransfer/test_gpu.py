"""KV transfer on GPUs: NCCL between two GPUs (with a sender killed mid-transfer), two processes
on one GPU (CUDA IPC: GPU to GPU, also streamed layer by layer, and a sender killed meanwhile),
two ends in one process (IPC cannot open its own pool: Gloo with host staging). Skipped without
the GPUs."""

from __future__ import annotations

import time

import pytest
import torch

from kvtransfer import KvReceiver, KvSender, ReceiverOptions, SenderOptions
from tests.kvtransfer.conftest import Peer, add_sender, assert_blocks_equal, blocks
from tests.kvtransfer.peer import make_caches

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def on(device: str, caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [c.to(device) for c in caches]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_nccl_pair_round_trips_and_survives_a_sender_killed_mid_transfer():
    rx_caches = on("cuda:1", make_caches(0, 16, zero=True))
    options = ReceiverOptions(io_timeout_s=3, connect_timeout_s=60)
    victim, successor = Peer("sender"), Peer("sender")
    with KvReceiver(rx_caches, options) as rx:
        try:
            add_sender(victim.started(), "gpu-pf", seed=1, device="cuda:0")
            handle = rx.expect("g1", [0, 5, 2], deadline_s=60)
            reply = victim.call(
                op="send",
                id="gpu-pf",
                endpoint=rx.endpoint,
                transfer_id="g1",
                blocks=[3, 7, 1],
                timeout=60,
            )
            assert reply["ok"], reply
            assert handle.wait(5).ok
            got = [c.cpu() for c in blocks(rx_caches, [0, 5, 2])]
            assert_blocks_equal(got, blocks(make_caches(1, 12), [3, 7, 1]))
            handle = rx.expect("g2", [4], deadline_s=60)
            victim.write(
                op="send",
                id="gpu-pf",
                endpoint=rx.endpoint,
                transfer_id="g2",
                blocks=[2],
                timeout=60,
                pause_after_header=60,
            )
            assert victim.read(30) == {"event": "header_sent"}
            start = time.monotonic()
            victim.kill()
            result = handle.wait(30)
            assert result is not None and not result.ok
            assert time.monotonic() - start < 10  # the 3 s I/O timeout, then an NCCL abort
            assert not rx_caches[0][:, 4].any()
            add_sender(successor.started(), "gpu-pf", seed=2, device="cuda:0")
            handle = rx.expect("g3", [4], deadline_s=60)
            reply = successor.call(
                op="send",
                id="gpu-pf",
                endpoint=rx.endpoint,
                transfer_id="g3",
                blocks=[6],
                timeout=60,
            )
            assert reply["ok"], reply
            assert handle.wait(5).ok
            got = [c.cpu() for c in blocks(rx_caches, [4])]
            assert_blocks_equal(got, blocks(make_caches(2, 12), [6]))
        finally:
            victim.close()
            successor.close()


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_two_processes_on_one_gpu_copy_gpu_to_gpu_through_cuda_ipc():
    rx_caches = on("cuda:0", make_caches(0, 16, zero=True))
    options = ReceiverOptions(io_timeout_s=3, connect_timeout_s=60)
    peer, successor = Peer("sender"), Peer("sender")
    with KvReceiver(rx_caches, options) as rx:
        try:
            add_sender(peer.started(), "ipc-pf", seed=4, device="cuda:0")
            handle = rx.expect("i1", [0, 5, 2], deadline_s=60)
            reply = peer.call(op="send", id="ipc-pf", endpoint=rx.endpoint, transfer_id="i1",
                              blocks=[3, 7, 1], timeout=60)  # fmt: skip
            assert reply["ok"], reply
            assert handle.wait(5).ok and rx.backends() == {"ipc-pf": "cuda_ipc"}
            got = [c.cpu() for c in blocks(rx_caches, [0, 5, 2])]
            assert_blocks_equal(got, blocks(make_caches(4, 12), [3, 7, 1]))
            handle = rx.expect("i2", [4], deadline_s=60)
            peer.write(op="send", id="ipc-pf", endpoint=rx.endpoint, transfer_id="i2",
                       blocks=[2], timeout=60, pause_after_header=60)  # fmt: skip
            assert peer.read(30) == {"event": "header_sent"}
            peer.kill()  # after its header (the whole KV was written: the copy may be done)
            assert handle.wait(30) is not None  # resolved either way, never left pending
            add_sender(successor.started(), "ipc-pf", seed=5, device="cuda:0")
            handle = rx.expect("i3", [6], deadline_s=60)
            reply = successor.call(op="send", id="ipc-pf", endpoint=rx.endpoint,
                                   transfer_id="i3", blocks=[8], timeout=60)  # fmt: skip
            assert reply["ok"], reply
            assert handle.wait(5).ok
            got = [c.cpu() for c in blocks(rx_caches, [6])]
            assert_blocks_equal(got, blocks(make_caches(5, 12), [8]))
        finally:
            peer.close()
            successor.close()


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_blocks_granted_ahead_are_copied_without_asking_and_a_revoked_grant_writes_nothing():
    rx_caches = on("cuda:0", make_caches(0, 16, zero=True))
    options = ReceiverOptions(io_timeout_s=3, connect_timeout_s=60)
    peer = Peer("sender")
    with KvReceiver(rx_caches, options) as rx:
        try:
            add_sender(peer.started(), "grant-pf", seed=4, device="cuda:0")
            warm = rx.expect("g0", [9], deadline_s=60)  # builds the pair (no grant used)
            reply = peer.call(op="send", id="grant-pf", endpoint=rx.endpoint, transfer_id="g0",
                              blocks=[0], timeout=60)  # fmt: skip
            assert reply["ok"] and warm.wait(5).ok, reply
            handle = rx.expect("g1", [0, 5, 2], deadline_s=60, grant=True)
            assert handle.grant is not None and handle.grant.blocks == (0, 5, 2)
            reply = peer.call(op="send", id="grant-pf", endpoint=rx.endpoint, transfer_id="g1",
                              blocks=[3, 7, 1], timeout=60, grant=handle.grant.to_json())  # fmt: skip
            assert reply["ok"], reply
            assert handle.wait(5).ok and rx.stats().transfers == 2
            got = [c.cpu() for c in blocks(rx_caches, [0, 5, 2])]
            assert_blocks_equal(got, blocks(make_caches(4, 12), [3, 7, 1]))

            # cancelled before the copy: the grant is taken back, the copy writes nothing
            stale = rx.expect("g2", [4, 6], deadline_s=60, grant=True)
            assert stale.grant is not None
            assert rx.cancel("g2") and not stale.wait(5).ok
            reply = peer.call(op="send", id="grant-pf", endpoint=rx.endpoint, transfer_id="g2",
                              blocks=[3, 7], timeout=60, grant=stale.grant.to_json())  # fmt: skip
            assert not reply["ok"] and "no longer expected" in reply["error"], reply
            assert all(not c.any() for c in blocks(rx_caches, [4, 6]))

            # granted, but sent the usual way (no grant): the header takes the grant back
            usual = rx.expect("g3", [8], deadline_s=60, grant=True)
            reply = peer.call(op="send", id="grant-pf", endpoint=rx.endpoint, transfer_id="g3",
                              blocks=[2], timeout=60)  # fmt: skip
            assert reply["ok"] and usual.wait(5).ok, reply
            assert_blocks_equal([c.cpu() for c in blocks(rx_caches, [8])],
                                blocks(make_caches(4, 12), [2]))  # fmt: skip
            assert rx.pending() == 0
        finally:
            peer.close()


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU")
def test_two_ends_in_one_process_on_one_gpu_fall_back_to_host_staging():
    src = make_caches(3, 12)
    rx_caches = on("cuda:0", make_caches(0, 16, zero=True))
    with (
        KvReceiver(rx_caches) as rx,
        KvSender(on("cuda:0", src), "same-gpu", SenderOptions(chunk_bytes=1)) as tx,
    ):
        handle = rx.expect("s1", [9, 1], deadline_s=30)
        tx.send(rx.endpoint, "s1", [0, 11], timeout_s=30)
        assert handle.wait(5).ok
        got = [c.cpu() for c in blocks(rx_caches, [9, 1])]
        assert_blocks_equal(got, blocks(src, [0, 11]))
