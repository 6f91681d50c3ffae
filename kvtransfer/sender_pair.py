"""The sending end of one pair: handshake with a receiver, then transfers in order.

Handshake: open the control connection to the receiver's endpoint, send a :class:`Hello`
(sender id, fresh generation, device), read the :class:`Welcome` (backend, store port), build
the 2-rank group as rank 0 over the receiver's store. Transfer: send the header (the receiver
posts its receives meanwhile), then per chunk of layers gather the blocks into one buffer and
post the chunk's send (gathers overlap earlier chunks on the wire; NCCL runs on its own stream,
which waits for each gather), then wait for the receiver's :class:`Ack`, which also proves every
send completed. With a :class:`LayerReady`, a chunk is gathered once its layers are written:
the gather stream waits on the producer's event, the host only for the producer's ``record``.
On one GPU (``cuda_ipc``) the handshake opens the receiver's pool instead of building a group,
and a transfer is: header -> the receiver's :class:`Go` (its blocks) -> we copy our blocks into
its pool with one kernel per range of written layers, on our stream, right after the prefill
that writes them (the copy runs in the producer's own GPU context: no other process is
scheduled in between; the copy stream waits on each range's event, the host never syncs
mid-forward) -> a pending :class:`Done`, sent once every range is queued and the layer before the
last is computed (the copies may still run: we record the event shared at the handshake after
them, and the receiver polls it, so no message is left after the last copy) -> ack. On an H100
that made the tail after a 4096-token prefill's last layer 0.10 ms to the receiver's "landed",
against 0.8 ms when we waited for our copies and then sent a Done. A :class:`Stop` (the receiver
cancelled) ends the copying: no more ranges are queued, and the Done (stopped) follows once those
queued have run, which can be as late as the end of the forward computing them (the receiver's
cancel waits that long; holding the host back to a few layers ahead of the GPU instead made the
tail after the last layer 3.7 ms instead of 0.8 on an H100).
Not thread-safe: each pair belongs to the one thread of its ``send_queue.PairQueue``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.auth import hello_proof, proven, welcome_proof
from kvtransfer.blockcopy import Copier, make_copier
from kvtransfer.chunks import LayerRange, plan_layers
from kvtransfer.control import ConnectionClosed, ControlConn
from kvtransfer.device import GLOO, IPC, DeviceInfo, local_address_towards, on_stream
from kvtransfer.grants import Grant
from kvtransfer.layout import KvLayout
from kvtransfer.pair import SENDER_RANK, PairChannel, precise_sleeps
from kvtransfer.pusher import Pusher
from kvtransfer.ready import LayerReady
from kvtransfer.results import TransferError
from kvtransfer.shared_pool import check_pool, open_fence, open_pool, share_event
from kvtransfer.staging import DeviceIds, HostStaging, to_wire
from kvtransfer.wire import (
    Ack,
    Control,
    Done,
    Go,
    Header,
    Hello,
    Opened,
    Pushed,
    Share,
    Stop,
    Trailer,
    Welcome,
    WireError,
    checksum_tensor,
    checksum_value,
    pair_prefix,
)

log = logging.getLogger(__name__)


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
    chunk_bytes: int
    streaming_chunk_bytes: int
    copier: Copier
    auth_token: str = ""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6addr]:port`` -> (host, port); raises ValueError."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


def _seconds(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


_STOP_CHECK_S = 2e-3  # how often it looks for a Stop while the next layer is not recorded
_POLL_S, _POLL_FINE_S, _POLL_MAX_S = 20e-6, 1e-3, 200e-6  # waiting for our copies (cuda_ipc)


def _offsets(sizes: tuple[int, ...]) -> list[int]:
    return [sum(sizes[:k]) for k in range(len(sizes))]


class SenderPair:
    def __init__(self, endpoint: str, ctx: SenderContext) -> None:
        self.endpoint = endpoint
        self.host, self.port = parse_endpoint(endpoint)
        self._ctx = ctx
        self._staging = HostStaging()
        self._ids = DeviceIds(ctx.caches[0].device)
        self._dst_ids = DeviceIds(ctx.caches[0].device)  # cuda_ipc: the receiver's blocks
        self._channel: PairChannel | None = None
        self._conn: ControlConn | None = None
        self._ipc = False  # we copy into the receiver's shared pool (one GPU)
        self._remote: Copier | None = None  # its pool, opened here
        self._remote_blocks = 0
        self._copied: torch.cuda.Event | None = None  # cuda_ipc: shared with the receiver
        self._fence: torch.Tensor | None = None  # cuda_ipc: the receiver's grant fence, opened
        self._pusher: Pusher | None = None  # cuda_ipc: our copies into its granted blocks
        self._grants = ""  # the name of the receiver's grants that fence guards
        self._seq = 0
        # test hook: sees each chunk as gathered, after its checksum, before it is sent
        self.after_gather: Callable[[torch.Tensor], None] | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def hung_up(self) -> bool:
        """Whether the receiver closed the control connection (its process died or it closed):
        the pair cannot be used again. Only the pair's own thread may ask, while idle."""
        return self._conn is not None and self._conn.hung_up()

    @property
    def backend(self) -> str:
        """The pair's transport once connected: cuda_ipc, nccl or gloo ('' before)."""
        if self._ipc:
            return IPC
        return self._channel.backend if self._channel is not None else ""

    def connect(self, deadline: float) -> None:
        ctx = self._ctx
        conn = ControlConn.connect(self.host, self.port, _seconds(deadline))
        try:
            gen, issued = uuid.uuid4().hex, time.time()
            proof = hello_proof(ctx.auth_token, ctx.sender_id, gen, issued)
            conn.send(Hello(ctx.sender_id, gen, ctx.device, issued=issued, proof=proof))
            welcome = conn.recv(_seconds(deadline))
            if not isinstance(welcome, Welcome):
                raise WireError(f"expected a welcome, got {welcome!r}")
            if welcome.error:
                raise TransferError(f"KV receiver at {self.endpoint} refused: {welcome.error}")
            if ctx.auth_token and not proven(welcome_proof(ctx.auth_token, gen), welcome.proof):
                raise TransferError(
                    f"KV receiver at {self.endpoint} did not prove the internal token: "
                    "no KV is sent to it"
                )
            backend = welcome.backend
            if backend == IPC:
                backend = self._open_pool(conn, deadline)
            if backend == IPC:
                precise_sleeps()  # this pair's thread polls layer events with short sleeps
                self._ipc, self._conn, self._seq = True, conn, 0
                return
            timeout = timedelta(seconds=_seconds(deadline))
            client = dist.TCPStore(self.host, welcome.store_port, None, False, timeout)
            self._channel = PairChannel.open(
                dist.PrefixStore(pair_prefix(ctx.sender_id, gen), client),
                SENDER_RANK,
                backend,
                ctx.caches[0].device,
                deadline,
                gloo_address=local_address_towards(self.host, self.port),
                gloo_interface=ctx.gloo_interface,
            )
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._seq = 0

    def _open_pool(self, conn: ControlConn, deadline: float) -> str:
        """Open the pool a receiver on our GPU shares; returns the backend of the pair from
        now on (gloo, told to the receiver, if it cannot be opened here)."""
        ctx = self._ctx
        share = conn.recv(_seconds(deadline))
        if not isinstance(share, Share):
            raise WireError(f"expected the receiver's pool, got {share!r}")
        try:
            self._remote_blocks = check_pool(list(share.pool), ctx.layout)
            caches = open_pool(list(share.pool), ctx.layout, ctx.caches[0].device)
            self._remote = make_copier(caches)
            self._copied, handle = share_event(ctx.caches[0].device)
            self._fence, self._grants, self._pusher = None, "", None
            if share.fence is not None:
                self._fence = open_fence(share.fence, ctx.caches[0].device)
                self._pusher = Pusher(self._remote, ctx.copier, self._fence, ctx.stream,
                                      ctx.caches[0].shape[1])  # fmt: skip
                self._grants = share.grants
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.warning("cannot open the pool of the KV receiver at %s (%s): using Gloo "
                        "through host memory", self.endpoint, error)  # fmt: skip
            self._remote = self._copied = self._fence = self._pusher = None
            conn.send(Opened(GLOO, error))
            return GLOO
        conn.send(Opened(IPC, event=handle))
        return IPC

    def transfer(
        self,
        transfer_id: str,
        block_ids: list[int],
        deadline: float,
        ready: LayerReady | None = None,
        after_header: Callable[[], None] | None = None,
        computed: torch.cuda.Event | None = None,
        grant: Grant | None = None,
    ) -> int:
        """Ship the blocks; returns the bytes acknowledged. Raises TransferRejected if the
        receiver refused them (the pair stays usable), anything else if the pair broke."""
        ctx, channel, conn = self._ctx, self._channel, self._conn
        if conn is not None and self._ipc and ready is None and self._granted(grant, block_ids):
            assert grant is not None
            return self._push(conn, transfer_id, block_ids, grant, deadline, computed)
        if conn is not None and self._ipc:
            return self._transfer_ipc(
                conn, transfer_id, block_ids, deadline, ready, after_header, computed
            )
        if channel is None or conn is None:
            raise TransferError("not connected")
        self._seq += 1
        layer_bytes = ctx.layout.block_bytes // ctx.layout.num_layers * len(block_ids)
        chunk_bytes = ctx.chunk_bytes if ready is None else ctx.streaming_chunk_bytes
        ranges = plan_layers(ctx.layout.num_layers, layer_bytes, chunk_bytes)
        sizes = tuple((last - first) * layer_bytes for first, last in ranges)
        header = Header(
            self._seq, transfer_id, len(block_ids), ctx.layout, sum(sizes), sizes, ctx.use_checksum
        )
        conn.send(header)  # first of all: the receiver gets ready while we gather
        if ready is None and ctx.stream is not None:  # the KV was computed on the caller's stream
            if computed is not None:
                ctx.stream.wait_event(computed)
            else:
                ctx.stream.wait_stream(torch.cuda.current_stream(ctx.stream.device))
        in_flight: list[Any] = []  # buffers and works stay alive until the ack
        sums: list[torch.Tensor] = []  # each chunk's checksum, on the device, read after sending
        with on_stream(ctx.stream):
            ids = self._ids.upload(block_ids)
            out = torch.empty(sum(sizes), dtype=torch.uint8, device=channel.device)
            spans = [(o, o + n) for o, n in zip(_offsets(sizes), sizes, strict=True)]
            in_flight.append(out)
            if after_header is not None:
                after_header()
            staged = channel.wire_device != channel.device
            host = self._staging.get(sum(sizes)) if staged else None
            for k, ((a, b), layers) in enumerate(zip(spans, ranges, strict=True)):
                self._gather(ids, layers, out[a:b], ready, deadline)
                if ctx.use_checksum:
                    sums.append(checksum_tensor(out[a:b]))
                if self.after_gather is not None:  # test hook: what happens on the way
                    self.after_gather(out[a:b])
                wire = to_wire(
                    out[a:b], channel.wire_device, host[a:b] if host is not None else None
                )
                in_flight.append((wire, channel.post_send(wire, tag=k)))
        if sums:  # every send is posted: reading the sums waits for the gathers only
            conn.send(Trailer(header.seq, tuple(map(checksum_value, sums))))
        return self._await_ack(conn, header, deadline)

    def _transfer_ipc(
        self,
        conn: ControlConn,
        transfer_id: str,
        block_ids: list[int],
        deadline: float,
        ready: LayerReady | None,
        after_header: Callable[[], None] | None,
        computed: torch.cuda.Event | None,
    ) -> int:
        """One GPU: copy our blocks into the receiver's, each range of layers once written."""
        ctx, remote, copied = self._ctx, self._remote, self._copied
        assert remote is not None and copied is not None
        n = len(block_ids)
        self._seq += 1
        header = Header(self._seq, transfer_id, n, ctx.layout, ctx.layout.block_bytes * n,
                        (ctx.layout.block_bytes * n,), ctx.use_checksum)  # fmt: skip
        conn.send(header)  # first of all: the receiver claims its blocks while we wait
        stream = ctx.stream
        with on_stream(stream):
            src = self._ids.upload(block_ids)
        if after_header is not None:
            after_header()
        go = conn.recv(_seconds(deadline))
        if isinstance(go, Ack):  # refused (unknown, cancelled, layout): the pair is fine
            return self._check_ack(go, header)
        if not isinstance(go, Go) or go.seq != header.seq or len(go.blocks) != n:
            raise WireError(f"expected the receiver's {n} blocks for #{header.seq}, got {go!r}")
        if n and not (min(go.blocks) >= 0 and max(go.blocks) < self._remote_blocks):
            raise WireError(f"the receiver's blocks for #{header.seq} are outside its pool")
        with on_stream(stream):
            dst = self._dst_ids.upload(go.blocks)
        try:
            stopped, near = self._copy(conn, header.seq, src, dst, ready, computed, deadline)
            copied.record(stream)  # after every copy queued: the receiver waits for it
            # the receiver polls finely from our Done on: send it once the copies are near
            # their end (the layer before the last is computed), not a whole prefill ahead
            stopped = stopped or self._until(conn, header.seq, near, deadline)
            if stopped:  # what is queued still runs: the receiver may reuse its blocks after
                self._until(conn, header.seq, copied, deadline)
                conn.send(Done(header.seq, stopped=True))
            else:
                conn.send(Done(header.seq, checksums=self._checksums(src), pending=True))
            return self._await_ack(conn, header, deadline)
        except BaseException:
            # the pair breaks and the receiver frees its blocks once it sees that: our copies
            # already queued must have landed first (they wait only on layers recorded)
            if stream is not None:
                stream.synchronize()
            raise

    def _granted(self, grant: Grant | None, block_ids: list[int]) -> bool:
        """Whether ``grant`` can be used on this pair: blocks of the pool we opened, as many."""
        fence = self._fence
        if grant is None or fence is None or self._pusher is None or grant.pool != self._grants:
            return False
        return (
            grant.slot < fence.shape[0]
            and len(grant.blocks) == len(block_ids)
            and 0 <= min(grant.blocks) <= max(grant.blocks) < self._remote_blocks
        )

    def _push(
        self,
        conn: ControlConn,
        transfer_id: str,
        block_ids: list[int],
        grant: Grant,
        deadline: float,
        computed: torch.cuda.Event | None,
    ) -> int:
        """One GPU, blocks granted ahead: copy into them at once, fenced (the receiver may
        have taken the grant back: the kernel then writes nothing), then tell the receiver."""
        header = self._start_push(conn, transfer_id, block_ids, grant, computed)
        return self.finish_push(header, deadline)

    def start_push(
        self,
        transfer_id: str,
        block_ids: list[int],
        grant: Grant,
        computed: torch.cuda.Event | None,
    ) -> Header | None:
        """The first half of a granted transfer (launch the copy, tell the receiver), run by
        the submitting thread while the pair's own thread is idle (``PairQueue.run_inline``);
        None when this pair cannot use the grant (the thread then sends the usual way)."""
        conn = self._conn
        if conn is None or not self._ipc or not self._granted(grant, block_ids):
            return None
        return self._start_push(conn, transfer_id, block_ids, grant, computed)

    def _start_push(
        self,
        conn: ControlConn,
        transfer_id: str,
        block_ids: list[int],
        grant: Grant,
        computed: torch.cuda.Event | None,
    ) -> Header:
        ctx, copied, pusher = self._ctx, self._copied, self._pusher
        assert copied is not None and pusher is not None
        self._seq += 1
        n, stream = len(block_ids), ctx.stream
        if stream is not None and computed is not None:
            stream.wait_event(computed)
        src = pusher.push(grant.token, grant.slot, block_ids, grant.blocks)
        copied.record(stream)  # the receiver waits for it before it uses the blocks
        try:
            sums = self._checksums(src)
            conn.send(Pushed(self._seq, transfer_id, n, ctx.layout, grant.slot, grant.token, sums))
        except BaseException:
            self._sync()
            raise
        nbytes = ctx.layout.block_bytes * n
        return Header(self._seq, transfer_id, n, ctx.layout, nbytes, (nbytes,), ctx.use_checksum)

    def finish_push(self, header: Header, deadline: float) -> int:
        """The second half of a granted transfer: the receiver's ack."""
        conn = self._conn
        try:
            if conn is None:
                raise TransferError("the pair closed before the transfer's acknowledgement")
            return self._await_ack(conn, header, deadline)
        except BaseException:
            self._sync()
            raise

    def _checksums(self, src: torch.Tensor) -> tuple[int, ...]:
        """cuda_ipc: the checksum of our blocks ``src`` that were copied (none without
        --kv-checksum), computed on our stream after the copies; waits for it."""
        if not self._ctx.use_checksum:
            return ()
        with on_stream(self._ctx.stream):
            ours = self._ctx.copier.gather(src).view(-1).view(torch.uint8)
            return (checksum_value(checksum_tensor(ours)),)

    def _sync(self) -> None:
        """Before a pair breaks: our copies already queued land first (as in _transfer_ipc)."""
        if self._ctx.stream is not None:
            self._ctx.stream.synchronize()

    def _copy(
        self,
        conn: ControlConn,
        seq: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        ready: LayerReady | None,
        computed: torch.cuda.Event | None,
        deadline: float,
    ) -> tuple[bool, torch.cuda.Event | None]:
        """Queue the copies, each range once its layers are recorded, chained on their event.
        Returns whether the receiver said Stop meanwhile, and the event of the layers before
        the last range (None: nothing to wait for before the last copy)."""
        ctx, remote, stream = self._ctx, self._remote, self._ctx.stream
        assert remote is not None
        num_layers = ctx.layout.num_layers
        done, stopped = 0, False
        near: torch.cuda.Event | None = None
        if ready is None:  # computed before submit, on the submitting thread's stream
            if stream is not None and computed is not None:
                stream.wait_event(computed)
            done, near = num_layers, computed  # the Done waits for the KV to be computed
            with on_stream(stream):
                remote.copy_from(ctx.copier, src, dst)
        last: torch.cuda.Event | None = None
        while done < num_layers and not stopped:
            assert ready is not None
            got = ready.latest(done, min(deadline, time.monotonic() + _STOP_CHECK_S))
            if got is not None:  # layers [done, upto] are recorded: copy each once computed
                for first, end, event in ready.ranges(done, got[0] + 1):
                    if event is not None and stream is not None:
                        stream.wait_event(event)  # the GPU waits; the host never syncs mid-forward
                    elif event is not None:
                        event.synchronize()
                    with on_stream(stream):
                        remote.copy_from(ctx.copier, src, dst, first, end)
                    near, last = last, event
                done = got[0] + 1
            elif time.monotonic() >= deadline:
                raise TransferError("the KV was not computed before the transfer's deadline")
            stopped = self._stop_asked(conn, seq)
        return stopped, near

    def _until(
        self, conn: ControlConn, seq: int, event: torch.cuda.Event | None, deadline: float
    ) -> bool:
        """Poll until ``event`` (layers computed, or our copies) is done; True if the receiver
        said Stop meanwhile (what is queued still finishes). Polling, not a driver wait: a
        blocking event wakes ~0.3 ms late, a spinning one holds a core; the first millisecond
        is polled finely, then less often, so a long wait does not take the GIL from the
        engine thread."""
        stop, pause, start = False, _POLL_S, time.monotonic()
        while event is not None and not event.query():
            stop = stop or self._stop_asked(conn, seq)
            now = time.monotonic()
            if now >= deadline:
                raise TransferError(
                    "the KV was not computed and copied before the transfer's deadline"
                )
            time.sleep(pause)
            if now - start > _POLL_FINE_S:
                pause = min(pause * 2, _POLL_MAX_S)
        return stop or self._stop_asked(conn, seq)

    @staticmethod
    def _stop_asked(conn: ControlConn, seq: int) -> bool:
        if conn.idle():
            return False
        msg = conn.recv(1.0)
        if isinstance(msg, Stop) and msg.seq == seq:
            return True
        raise WireError(f"expected nothing or a stop of #{seq}, got {msg!r}")

    def _gather(
        self,
        ids: torch.Tensor,
        layers: LayerRange,
        part: torch.Tensor,  # [bytes] uint8: where layers [first, last) go
        ready: LayerReady | None,
        deadline: float,
    ) -> None:
        """Issue the gather of one chunk on the current stream, once its layers are written."""
        ctx, (first, last) = self._ctx, layers
        if ready is not None:
            event = ready.wait(last - 1, deadline)  # layers are written in order
            if event is not None and ctx.stream is not None:
                ctx.stream.wait_event(event)  # the GPU waits, not us
            elif event is not None:
                event.synchronize()
        shape = (last - first, *ctx.layout.buffer_shape(ids.numel())[1:])
        ctx.copier.gather(ids, first, last, out=part.view(ctx.layout.torch_dtype).view(shape))

    def _await_ack(self, conn: ControlConn, header: Header, deadline: float) -> int:
        try:
            ack = conn.recv(_seconds(deadline))
            while isinstance(ack, Stop) and ack.seq == header.seq:  # came after our Done
                ack = conn.recv(_seconds(deadline))
        except TimeoutError:
            raise TransferError(
                f"no acknowledgement from the KV receiver at {self.endpoint} within the deadline"
            ) from None
        except ConnectionClosed as e:
            raise TransferError(f"KV receiver at {self.endpoint} is gone: {e}") from None
        return self._check_ack(ack, header)

    def _check_ack(self, ack: object, header: Header) -> int:
        if not isinstance(ack, Ack) or ack.seq != header.seq:
            raise WireError(f"expected ack #{header.seq}, got {ack!r}")
        if ack.broken:
            raise TransferError(f"KV receiver at {self.endpoint}: {ack.error}")
        if not ack.ok:
            raise TransferRejected(
                f"KV receiver at {self.endpoint} rejected transfer "
                f"{header.transfer_id!r}: {ack.error}"
            )
        return header.nbytes

    def close(self, farewell: bool = True) -> None:
        """Drop the pair; with ``farewell``, tell the receiver so its pair thread ends."""
        channel, conn = self._channel, self._conn
        self._channel = self._conn = None
        self._ipc, self._remote, self._fence, self._pusher = False, None, None, None
        if conn is not None:
            if farewell:
                with suppress(OSError):  # a receiver that is gone needs no goodbye
                    conn.send(Control("bye"))
            conn.close()
        if channel is not None:
            channel.close()
