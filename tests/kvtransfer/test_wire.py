"""Control messages: they round-trip, and anything malformed is refused (never eval'd)."""

from __future__ import annotations

import json

import pytest
import torch

from kvtransfer.device import DeviceInfo
from kvtransfer.layout import KvLayout
from kvtransfer.wire import (
    CHECKSUM_MOD,
    Ack,
    Control,
    Header,
    Hello,
    Pushed,
    Share,
    Trailer,
    Welcome,
    WireError,
    checksum,
    decode,
    encode,
)

LAYOUT = KvLayout(32, 16, 8, 128, "bfloat16")


@pytest.mark.parametrize(
    "msg",
    [
        Hello("prefill-0", "abc123", DeviceInfo("cuda", 1, "GPU-x", True)),
        Welcome("nccl", DeviceInfo("cpu")),
        Welcome("", None, error="too many senders"),
        Welcome("gloo", DeviceInfo("cpu"), store_port=29500),
        Header(3, "req-1/part", 4, LAYOUT, 4 * LAYOUT.block_bytes, (4 * LAYOUT.block_bytes,), True),
        Header(1, "r", 1, LAYOUT, LAYOUT.block_bytes, (100, LAYOUT.block_bytes - 100), False),
        Trailer(3, (0, 12345, (1 << 61) - 2)),
        Control("bye"),
        Ack(3, False, "layout mismatch"),
        Ack(4, False, "stream broke", broken=True),
        Pushed(5, "req-2", 3, LAYOUT, slot=7, token=1 << 40, checksums=(99,)),
        Share(({"device": 0},), {"device": 0, "slots": 4}, "pool-a"),
        Share(({"device": 0},)),
    ],
)
def test_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


def header_doc(**override: object) -> bytes:
    doc = json.loads(encode(Header(1, "t", 1, LAYOUT, LAYOUT.block_bytes, (LAYOUT.block_bytes,))))
    doc.update(override)
    return json.dumps(doc).encode()


def pushed_doc(**override: object) -> bytes:
    doc = json.loads(encode(Pushed(1, "t", 1, LAYOUT, 0, 4)))
    doc.update(override)
    return json.dumps(doc).encode()


def hello_doc(**override: object) -> bytes:
    doc = json.loads(encode(Hello("a", "g", DeviceInfo("cpu"))))
    doc.update(override)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'{"t": "pickle"}',
        header_doc(nbytes=-1),
        header_doc(seq=True),
        header_doc(num_blocks=0),
        header_doc(trailer="abc"),
        header_doc(trailer=1),
        b'{"t": "trailer", "seq": 1, "checksums": []}',
        b'{"t": "trailer", "seq": 1, "checksums": [-1]}',
        b'{"t": "trailer", "seq": 1, "checksums": ["1"]}',
        b'{"t": "trailer", "seq": 0, "checksums": [1]}',
        header_doc(chunks=[]),
        header_doc(chunks=[1, LAYOUT.block_bytes]),  # does not add up to nbytes
        header_doc(chunks=[0, LAYOUT.block_bytes]),
        header_doc(chunks=[1] * 2000),
        header_doc(transfer_id="x" * 10_000),
        header_doc(layout={**LAYOUT.to_json(), "dtype": "object"}),
        header_doc(layout={**LAYOUT.to_json(), "head_dim": 0}),
        hello_doc(sender_id="a/b"),
        hello_doc(device={"type": "tpu"}),
        hello_doc(gen=""),
        b" " * 100_000,
        pushed_doc(token=-4),
        pushed_doc(slot="1"),
        pushed_doc(checksums=[1, 2]),
        pushed_doc(num_blocks=0),
        b'{"t": "share", "pool": [{}], "fence": {"slots": 1}, "grants": ""}',
        b'{"t": "share", "pool": [{}], "fence": [1], "grants": "p"}',
    ],
)
def test_malformed_messages_are_refused(raw):
    with pytest.raises(WireError):
        decode(raw)


def test_checksum_sees_reordered_and_changed_bytes():
    data = torch.randint(0, 256, (4099,), dtype=torch.uint8)
    data[0], data[4] = 1, 2
    assert checksum(data) == checksum(data.clone())
    swapped = data.clone()
    swapped[[0, 4]] = swapped[[4, 0]]
    changed = data.clone()
    changed[-1] ^= 1
    assert len({checksum(data), checksum(swapped), checksum(changed)}) == 3


def test_checksum_values_stay_what_older_senders_send():
    """Pinned: a receiver on this version verifies what an older sender (or a CPU one) sent."""
    assert checksum((torch.arange(4099) * 7919 % 251).to(torch.uint8)) == 9447460755143
    words_then_tail = torch.tensor([255, 255, 255, 255, 7], dtype=torch.uint8)  # -1, then 7
    assert checksum(words_then_tail) == (-1 + 7 * 1_000_003) % CHECKSUM_MOD
    assert checksum(torch.arange(9, dtype=torch.uint8)[1:]) == checksum(torch.arange(1, 9, dtype=torch.uint8))  # fmt: skip
