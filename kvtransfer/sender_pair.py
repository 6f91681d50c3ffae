"""The sending end of one pair: handshake with a receiver, then transfers in order.

Handshake: connect a store client to the receiver's endpoint, push a :class:`Hello` (sender id,
fresh generation, device), read the :class:`Welcome` (backend), build the 2-rank group as
rank 0. Transfer: gather the blocks into one buffer, push the header, send the bytes, wait for
the receiver's :class:`Ack`. Not thread-safe: :class:`KvSender` serializes calls per pair.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.blockcopy import gather_blocks
from kvtransfer.device import DeviceInfo, local_address_towards
from kvtransfer.layout import KvLayout
from kvtransfer.pair import SENDER_RANK, PairChannel
from kvtransfer.results import TransferError
from kvtransfer.staging import HostStaging, as_bytes, to_wire
from kvtransfer.stores import clone
from kvtransfer.wire import (
    HEADER_QUEUE,
    HELLO_QUEUE,
    Ack,
    Control,
    Header,
    Hello,
    Welcome,
    WireError,
    ack_key,
    checksum,
    decode,
    encode,
    pair_prefix,
    welcome_key,
)


class TransferRejected(TransferError):
    """The receiver got every byte but refused the transfer; the pair itself is fine."""


@dataclass
class SenderContext:
    """What every pair of one sender shares."""

    caches: list[torch.Tensor]
    layout: KvLayout
    sender_id: str
    device: DeviceInfo
    stream: torch.cuda.Stream | None
    use_checksum: bool
    gloo_interface: str


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6addr]:port`` -> (host, port); raises ValueError."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


class SenderPair:
    def __init__(self, endpoint: str, ctx: SenderContext) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint)
        self._ctx = ctx
        self._staging = HostStaging()
        self._channel: PairChannel | None = None
        self._control: dist.Store | None = None
        self._seq = 0

    @property
    def connected(self) -> bool:
        return self._channel is not None

    def connect(self, deadline: float) -> None:
        ctx = self._ctx
        client = dist.TCPStore(self.host, self.port, None, False, _remaining(deadline))
        gen = uuid.uuid4().hex
        client.queue_push(HELLO_QUEUE, encode(Hello(ctx.sender_id, gen, ctx.device)))
        key = welcome_key(ctx.sender_id, gen)
        try:
            client.wait([key], _remaining(deadline))
        except Exception as e:
            raise TransferError(f"KV receiver at {self.endpoint} did not answer: {e}") from None
        welcome = decode(client.get(key))
        client.delete_key(key)
        if not isinstance(welcome, Welcome):
            raise WireError(f"expected a welcome, got {welcome!r}")
        if welcome.error:
            raise TransferError(f"KV receiver at {self.endpoint} refused: {welcome.error}")
        prefix = pair_prefix(ctx.sender_id, gen)
        group_client = clone(client, _remaining(deadline))
        self._channel = PairChannel.open(
            dist.PrefixStore(prefix, group_client), SENDER_RANK, welcome.backend,
            ctx.caches[0].device, deadline,
            gloo_address=local_address_towards(self.host, self.port),
            gloo_interface=ctx.gloo_interface,
        )  # fmt: skip
        self._control = dist.PrefixStore(prefix, client)
        self._seq = 0

    def transfer(
        self,
        transfer_id: str,
        block_ids: list[int],
        deadline: float,
        after_header: Callable[[], None] | None = None,
    ) -> int:
        """Ship the blocks; returns the bytes acknowledged. Raises TransferRejected if the
        receiver refused them (the pair stays usable), anything else if the pair broke."""
        ctx, channel, control = self._ctx, self._channel, self._control
        if channel is None or control is None:
            raise TransferError("not connected")
        self._seq += 1
        stream = ctx.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            ids = torch.tensor(block_ids, dtype=torch.int64).to(channel.device)
            data = as_bytes(gather_blocks(ctx.caches, ids))  # [L*2*n*bs*H*D*itemsize] uint8
            digest = checksum(data) if ctx.use_checksum else None
            wire = to_wire(data, channel.wire_device, self._staging)
            header = Header(
                self._seq, transfer_id, len(block_ids), ctx.layout, data.numel(), digest
            )
            control.queue_push(HEADER_QUEUE, encode(header))
            if after_header is not None:
                after_header()
            channel.send(wire, deadline)
        return self._await_ack(control, header, deadline)

    def _await_ack(self, control: dist.Store, header: Header, deadline: float) -> int:
        key = ack_key(header.seq)
        try:
            control.wait([key], _remaining(deadline))
        except Exception as e:
            raise TransferError(f"no acknowledgement from the KV receiver at {self.endpoint} "
                                f"in time: {e}") from None  # fmt: skip
        ack = decode(control.get(key))
        control.delete_key(key)
        if not isinstance(ack, Ack) or ack.seq != header.seq:
            raise WireError(f"expected ack #{header.seq}, got {ack!r}")
        if not ack.ok:
            raise TransferRejected(f"KV receiver at {self.endpoint} rejected transfer "
                                   f"{header.transfer_id!r}: {ack.error}")  # fmt: skip
        return header.nbytes

    def close(self, farewell: bool = True) -> None:
        """Drop the pair; with ``farewell``, tell the receiver so its pair thread ends."""
        channel, control = self._channel, self._control
        self._channel = self._control = None
        if channel is not None:
            channel.close()
        if farewell and control is not None:
            with suppress(Exception):  # a receiver that is gone needs no goodbye
                control.queue_push(HEADER_QUEUE, encode(Control("bye")))
