"""The receiving end of one pair: a thread that serves one sender's control connection.

Handshake: read the :class:`Hello`, let the receiver admit it (which retires an older pair of
the same sender), answer with a :class:`Welcome`, build the group as rank 1. Then per
transfer: read the header -> claim the expectation -> validate the header -> receive exactly
its chunks (always, even for unknown, cancelled or mismatched transfers, so the stream stays in
step; a receive posted ``LOOKAHEAD`` chunks ahead keeps the wire busy), writing each chunk into
the registered blocks as it lands -> wait for the writes -> resolve the handle -> acknowledge.
The sender sends nothing between its header and our ack: a message or a hang-up meanwhile
means it gave up on the transfer (a streamed KV whose prefill failed).

On one GPU (``cuda_ipc``) the handshake opens the sender's pool instead of building a group, and
a transfer copies the header's source blocks of each written layer range straight into the
registered blocks (one kernel per range, on our stream, under the expectation's write lock as
any write), as the sender's :class:`Ready` messages say more layers are written. A broken stream (peer
death, giving up, timeout, protocol error) fails the transfer in flight and ends the thread;
the sender rebuilds the pair under a new generation. A sender that hangs up while idle ends
the thread at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.auth import welcome_proof
from kvtransfer.blockcopy import Copier, make_copier
from kvtransfer.chunks import LayerRange, layer_ranges
from kvtransfer.config import ReceiverOptions
from kvtransfer.control import ConnectionClosed, ControlConn
from kvtransfer.device import GLOO, IPC, DeviceInfo, on_stream
from kvtransfer.expectations import Expectation, ExpectationRegistry
from kvtransfer.landing import BlockWriter, Landing
from kvtransfer.layout import KvLayout
from kvtransfer.pair import RECEIVER_RANK, PairChannel, precise_sleeps
from kvtransfer.results import CounterBox, TransferResult
from kvtransfer.shared_pool import check_pool, open_pool
from kvtransfer.staging import DeviceIds, HostStaging
from kvtransfer.stores import clone
from kvtransfer.wire import (
    Ack,
    Control,
    Header,
    Hello,
    Opened,
    Ready,
    Share,
    Trailer,
    Welcome,
    WireError,
    checksum_tensor,
    checksum_value,
    pair_prefix,
)

log = logging.getLogger(__name__)
LOOKAHEAD = 3  # receives posted ahead: the wire stays busy while we write a landed chunk


@dataclass
class ReceiverContext:
    """What every pair of one receiver shares."""

    caches: list[torch.Tensor]
    layout: KvLayout
    device: DeviceInfo
    registry: ExpectationRegistry
    counters: CounterBox
    options: ReceiverOptions
    stream: torch.cuda.Stream | None  # dedicated CUDA stream for the writes
    store_port: int
    copier: Copier
    # receives are posted with this idle stream current: NCCL's stream waits on the current
    # one, and neither the decode engine's work nor our writes should hold a receive back
    post_stream: torch.cuda.Stream | None


# the receiver's decision on a hello: (backend, "") to admit, ("", reason) to refuse
Admit = Callable[["ReceiverPair", Hello], tuple[str, str]]


@dataclass
class RemotePool:
    """A sender's pool opened through CUDA IPC (one GPU)."""

    copier: Copier
    num_blocks: int


class IpcWriter:
    """Copies one transfer's source blocks out of a shared pool into the registered blocks."""

    def __init__(self, ctx: ReceiverContext, remote: RemotePool, src: torch.Tensor, dst: torch.Tensor) -> None:  # fmt: skip
        self._ctx, self._remote, self._src, self._dst = ctx, remote, src, dst

    def copy(self, first: int, last: int) -> None:
        with on_stream(self._ctx.stream):
            self._ctx.copier.copy_from(self._remote.copier, self._src, self._dst, first, last)

    def flush(self) -> None:
        if self._ctx.stream is not None:
            self._ctx.stream.synchronize()

    def compare(self, transfer_id: str) -> str:
        """Checksums of what the sender holds and what we hold now ('' if they agree)."""
        with on_stream(self._ctx.stream):
            theirs = checksum_tensor(
                self._remote.copier.gather(self._src).view(-1).view(torch.uint8)
            )
            ours = checksum_tensor(self._ctx.copier.gather(self._dst).view(-1).view(torch.uint8))
        if checksum_value(theirs) == checksum_value(ours):
            return ""
        return (
            f"KV checksum mismatch for transfer {transfer_id!r}: the blocks copied out of the "
            "sender's pool differ from its own"
        )


class ReceiverPair:
    def __init__(self, conn: ControlConn, store: dist.TCPStore, ctx: ReceiverContext, admit: Admit):
        self.sender_id = ""  # known once the hello arrived
        self.backend = ""  # known once the handshake settled it
        self._conn = conn
        # its own store connection (made here, so the pair never holds the server object)
        self._group_store = clone(store, timedelta(seconds=ctx.options.connect_timeout_s))
        self._ctx = ctx
        self._admit = admit
        self._staging = HostStaging()
        self._ids = DeviceIds(ctx.caches[0].device)
        self._next_seq = 1
        self._remote: RemotePool | None = None  # cuda_ipc: the sender's pool
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-recv-pair", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread: at once when idle, else after the transfer in flight fails."""
        self._stopping.set()
        self._conn.shutdown()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        precise_sleeps()
        try:
            channel = self._handshake()
        except Exception as e:
            if not self._stopping.is_set():
                log.warning("KV pair with sender %r not built: %s", self.sender_id or "?", e)
            self._conn.close()
            return
        try:
            if channel is not None or self._remote is not None:
                self._serve(channel)
        except ConnectionClosed:
            if not self._stopping.is_set():
                log.info("KV sender %s disconnected", self.sender_id)
        except Exception as e:
            if not self._stopping.is_set():
                log.warning("KV pair with sender %s torn down: %s", self.sender_id, e)
        finally:
            if channel is not None:
                channel.close()
            self._conn.close()

    def _handshake(self) -> PairChannel | None:
        opts, ctx = self._ctx.options, self._ctx
        deadline = time.monotonic() + opts.connect_timeout_s
        hello = self._conn.recv(opts.connect_timeout_s)
        if not isinstance(hello, Hello):
            raise WireError(f"expected a hello, got {hello!r}")
        self.sender_id = hello.sender_id
        backend, error = self._admit(self, hello)
        proof = "" if error else welcome_proof(ctx.options.auth_token, hello.gen)
        self._conn.send(Welcome(backend, ctx.device, ctx.store_port, error, proof))
        if error:
            return None
        self._thread.name = f"kv-recv-{hello.sender_id}"
        if backend == IPC:
            backend = self._open_pool(deadline)
        self.backend = backend
        if backend == IPC:
            return None
        store = dist.PrefixStore(pair_prefix(hello.sender_id, hello.gen), self._group_store)
        return PairChannel.open(
            store,
            RECEIVER_RANK,
            backend,
            ctx.caches[0].device,
            deadline,
            gloo_address=opts.host,
            gloo_interface=opts.gloo_interface,
        )

    def _open_pool(self, deadline: float) -> str:
        """Open the pool a sender on our GPU shares; returns the backend of the pair from now
        on (gloo, told to the sender, if the pool cannot be opened here)."""
        ctx = self._ctx
        share = self._conn.recv(max(deadline - time.monotonic(), 0.001))
        if not isinstance(share, Share):
            raise WireError(f"expected the sender's pool, got {share!r}")
        try:
            blocks = check_pool(list(share.pool), ctx.layout)
            caches = open_pool(list(share.pool), ctx.layout, ctx.caches[0].device)
            self._remote = RemotePool(make_copier(caches), blocks)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.warning("cannot open the pool of KV sender %s (%s): Gloo", self.sender_id, error)
            self._conn.send(Opened(GLOO, error))
            return GLOO
        self._conn.send(Opened(IPC))
        return IPC

    def _serve(self, channel: PairChannel | None) -> None:
        while not self._stopping.is_set():
            msg = self._conn.recv()
            if isinstance(msg, Control):
                return
            if not isinstance(msg, Header) or msg.seq != self._next_seq:
                raise WireError(f"expected header #{self._next_seq}, got {msg!r}")
            self._next_seq += 1
            if self._remote is not None:
                self._transfer_ipc(msg, self._remote)
            else:
                assert channel is not None
                self._transfer(msg, channel)

    def _transfer_ipc(self, header: Header, remote: RemotePool) -> None:
        """One transfer out of a shared pool; raises (ending the pair) if the sender broke the
        conversation or gave up."""
        ctx = self._ctx
        start = time.monotonic()
        num_layers = ctx.layout.num_layers
        if not header.src_blocks:
            raise WireError(f"header #{header.seq} of a shared-GPU pair names no source blocks")
        claim = ctx.registry.claim(header.transfer_id, ctx.options.unknown_grace_s)
        exp = claim if isinstance(claim, Expectation) else None
        problem = claim if isinstance(claim, str) else self._validate(header, claim)
        if not problem and any(not 0 <= b < remote.num_blocks for b in header.src_blocks):
            problem = f"transfer {header.transfer_id!r} names blocks outside the sender's pool"
        writer = None
        if exp is not None and not problem:
            n = len(header.src_blocks)
            with on_stream(ctx.stream):  # one upload for both lists
                ids = self._ids.upload([*header.src_blocks, *exp.handle.block_ids])
            writer = IpcWriter(ctx, remote, ids[:n], ids[n:])
            exp.flush = writer.flush
        done, ready = 0, header.ready
        deadline = time.monotonic() + ctx.options.io_timeout_s
        try:
            while True:
                if ready > done:
                    if exp is not None and writer is not None:
                        exp.issue_write(functools.partial(writer.copy, done, ready))
                    done = ready
                if done >= num_layers:
                    break
                msg = self._conn.recv(max(deadline - time.monotonic(), 0.001))
                if isinstance(msg, Control):
                    raise WireError("the sender gave up on the transfer")
                if not isinstance(msg, Ready) or msg.seq != header.seq:
                    raise WireError(f"expected more layers of #{header.seq}, got {msg!r}")
                if not done < msg.layers <= num_layers:
                    raise WireError(f"layers {msg.layers} after {done} of {num_layers}")
                ready = msg.layers
        except Exception as e:
            error = f"KV stream from sender {self.sender_id} broke: {e}"
            self._finish(exp, header, start, error)
            with contextlib.suppress(Exception):  # tell a live sender to rebuild
                self._conn.send(Ack(header.seq, False, error, broken=True))
            raise
        if writer is not None and header.trailer and ctx.options.verify_checksums:
            problem = writer.compare(header.transfer_id)
        result = self._finish(exp, header, start, problem, writer)
        self._conn.send(Ack(header.seq, result.ok, result.error))

    def _transfer(self, header: Header, channel: PairChannel) -> None:
        """Handle one transfer; raises (ending the pair) if the byte stream broke."""
        ctx = self._ctx
        start = time.monotonic()
        claim = ctx.registry.claim(header.transfer_id, ctx.options.unknown_grace_s)
        exp = claim if isinstance(claim, Expectation) else None
        problem = claim if isinstance(claim, str) else self._validate(header, claim)
        layers = layer_ranges(
            header.chunks, header.nbytes // header.layout.num_layers, header.layout.num_layers
        )
        if not problem and layers is None:
            problem = f"transfer {header.transfer_id!r}: chunks do not hold whole layers"
        verify = header.trailer and ctx.options.verify_checksums
        sums: list[torch.Tensor] = []
        try:
            target = exp if not problem else None
            _, writer = self._receive(
                header, channel, target, layers or [], sums if verify else None
            )
            trailer = self._trailer(header) if header.trailer else None
        except Exception as e:
            error = f"KV stream from sender {self.sender_id} broke: {e}"
            self._finish(exp, header, start, error)
            with contextlib.suppress(Exception):  # tell a live sender to rebuild
                self._conn.send(Ack(header.seq, False, error, broken=True))
            raise
        if verify and trailer is not None and not problem:
            problem = self._compare(header, sums, trailer)
        # a mismatch fails the transfer: resolving it waits for the writes already issued, and
        # the blocks go back to their owner, who never runs a request on them
        result = self._finish(exp, header, start, problem, writer)
        self._conn.send(Ack(header.seq, result.ok, result.error))

    def _trailer(self, header: Header) -> Trailer:
        msg = self._conn.recv(self._ctx.options.io_timeout_s)
        if not isinstance(msg, Trailer) or msg.seq != header.seq:
            raise WireError(f"expected the trailer of #{header.seq}, got {msg!r}")
        if len(msg.checksums) != len(header.chunks):
            raise WireError(f"{len(msg.checksums)} checksums for {len(header.chunks)} chunks")
        return msg

    @staticmethod
    def _compare(header: Header, sums: list[torch.Tensor], trailer: Trailer) -> str:
        got = [checksum_value(t) for t in sums]
        bad = [k for k, (a, b) in enumerate(zip(got, trailer.checksums, strict=True)) if a != b]
        if not bad:
            return ""
        return (
            f"KV checksum mismatch for transfer {header.transfer_id!r}: chunk {bad[0]} of "
            f"{len(header.chunks)} ({len(bad)} in all) arrived different from what was sent"
        )

    def _receive(
        self,
        header: Header,
        channel: PairChannel,
        exp: Expectation | None,
        layers: list[LayerRange],
        sums: list[torch.Tensor] | None = None,
    ) -> tuple[Landing, BlockWriter | None]:
        """Receive every chunk and write it into ``exp``'s blocks (if any) as it lands; with
        ``sums``, also append each chunk's checksum (on the device). Raises if the stream
        broke."""
        ctx = self._ctx
        if header.nbytes > ctx.options.max_transfer_bytes:
            raise WireError(
                f"header announces {header.nbytes} bytes, more than the "
                f"{ctx.options.max_transfer_bytes} allowed"
            )
        deadline = time.monotonic() + ctx.options.io_timeout_s
        n = len(header.chunks)
        with on_stream(ctx.stream):  # the writes read it on that stream
            landing = Landing(channel, header.chunks, self._staging)
        with on_stream(ctx.post_stream):  # first of all: the sender may be sending already
            works = {k: landing.post(k) for k in range(min(LOOKAHEAD, n))}
        writer = None
        if exp is not None:
            block_ids = list(exp.handle.block_ids)
            device = ctx.caches[0].device
            writer = BlockWriter.upload(ctx.copier, ctx.layout, block_ids, self._ids, device,
                                        ctx.stream)  # fmt: skip
            exp.flush = writer.flush
        for k in range(n):
            with on_stream(ctx.stream):  # orders the writes after the receive
                channel.wait(works.pop(k), deadline, alive=self._sender_quiet)
            if k + LOOKAHEAD < n:
                with on_stream(ctx.post_stream):
                    works[k + LOOKAHEAD] = landing.post(k + LOOKAHEAD)
            if sums is not None:
                with on_stream(ctx.stream):
                    sums.append(checksum_tensor(landing.chunks[k]))
            if writer is not None:
                self._issue(exp, writer, landing.chunks[k], layers[k])
        return landing, writer

    def _sender_quiet(self) -> bool:
        return self._conn.idle()

    @staticmethod
    def _issue(
        exp: Expectation | None, writer: BlockWriter, chunk: torch.Tensor, layers: LayerRange
    ) -> None:
        if exp is not None:
            exp.issue_write(lambda: writer.write(chunk, layers))

    def _validate(self, header: Header, exp: Expectation) -> str:
        expected = self._ctx.layout
        if header.layout != expected and (diff := header.layout.mismatch(expected)):
            tid = header.transfer_id
            return f"KV layout mismatch for transfer {tid!r} (sender != receiver): {diff}"
        reserved = len(exp.handle.block_ids)
        if header.num_blocks != reserved:
            return (
                f"transfer {header.transfer_id!r} carries {header.num_blocks} blocks but "
                f"{reserved} were reserved"
            )
        if header.nbytes != expected.block_bytes * header.num_blocks:
            return f"transfer {header.transfer_id!r}: {header.nbytes} bytes do not match its layout"
        return ""

    def _finish(
        self,
        exp: Expectation | None,
        header: Header,
        start: float,
        problem: str,
        writer: BlockWriter | IpcWriter | None = None,
    ) -> TransferResult:
        """Resolve the transfer: finish the writes and succeed, or fail; counts it either way."""
        ctx = self._ctx
        elapsed = time.monotonic() - start
        result = TransferResult(
            header.transfer_id, not problem, problem, header.nbytes, elapsed, self.sender_id
        )
        if exp is None:
            ctx.counters.add_failure()
            return result
        if problem or writer is None:
            result = ctx.registry.fail(exp, result)
        else:
            result = ctx.registry.complete(exp, writer.flush, result)
        if result.ok:
            ctx.counters.add_ok(result.bytes, result.seconds)
        else:
            ctx.counters.add_failure()
        return result
