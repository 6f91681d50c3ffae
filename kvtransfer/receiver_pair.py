"""The receiving end of one pair: a thread that serves one sender's control connection.

Handshake: read the :class:`Hello`, let the receiver admit it (which retires an older pair of
the same sender), answer with a :class:`Welcome`, build the group as rank 1. Then per
transfer: read the header -> claim the expectation -> validate the header -> receive exactly
its chunks (always, even for unknown, cancelled or mismatched transfers, so the stream stays in
step; every chunk's receive is posted at once, into the landing buffer that holds them all, so
the sender's sends never wait for us), writing each chunk into
the registered blocks as it lands -> wait for the writes -> resolve the handle -> acknowledge.
The sender sends nothing between its header and our ack: a message or a hang-up meanwhile
means it gave up on the transfer (a streamed KV whose prefill failed).

On one GPU (``cuda_ipc``) the handshake shares our pool with the sender instead of building a
group, and a transfer is: header -> claim and validate -> :class:`Go` with the registered blocks
(or a refusing ack) -> the sender copies into them on its own stream -> its :class:`Done`, sent
once its copies are queued (``pending``): we poll the event it shared at the handshake, which it
records after them, until they have run -> compare checksums -> resolve -> ack. A cancel meanwhile sends :class:`Stop` and waits for the
sender's (stopped) :class:`Done`: only then are the blocks the caller's again. A broken stream (peer
death, giving up, timeout, protocol error) fails the transfer in flight and ends the thread;
the sender rebuilds the pair under a new generation. A sender that hangs up while idle ends
the thread at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.auth import welcome_proof
from kvtransfer.blockcopy import Copier
from kvtransfer.chunks import LayerRange, layer_ranges
from kvtransfer.config import ReceiverOptions
from kvtransfer.control import ConnectionClosed, ControlConn
from kvtransfer.device import GLOO, IPC, DeviceInfo, on_stream
from kvtransfer.expectations import Expectation, ExpectationRegistry
from kvtransfer.grants import CLAIMED, GrantTable
from kvtransfer.landing import BlockWriter, Landing
from kvtransfer.layout import KvLayout
from kvtransfer.pair import COARSE_POLL_S, RECEIVER_RANK, PairChannel, precise_sleeps
from kvtransfer.pair import POLL_S as NCCL_POLL_S
from kvtransfer.results import CounterBox, TransferResult
from kvtransfer.shared_pool import export_fence, export_pool, open_event
from kvtransfer.staging import DeviceIds, HostStaging
from kvtransfer.stores import clone
from kvtransfer.wire import (
    Ack,
    Control,
    Done,
    Go,
    Header,
    Hello,
    Message,
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
# waiting for a cuda_ipc sender's copies: finely for the first 5 ms, then backing off
_POLL_S, _POLL_FINE_S, _POLL_MAX_S = 20e-6, 5e-3, 200e-6


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
    grants: GrantTable | None = None  # blocks granted ahead (one GPU; kvtransfer.grants)


# the receiver's decision on a hello: (backend, "") to admit, ("", reason) to refuse
Admit = Callable[["ReceiverPair", Hello], tuple[str, str]]


class PushedKv:
    """cuda_ipc: one transfer the sender is copying into our blocks. ``flush`` (what a cancel
    waits for under the expectation's write lock) tells the sender to stop and waits for its
    Done, so once it returns nothing writes the blocks any more."""

    def __init__(self, pair: ReceiverPair, seq: int) -> None:
        self._pair, self._seq = pair, seq
        self.ended = threading.Event()  # the sender's Done arrived, or the pair broke

    def flush(self) -> None:
        if self.ended.is_set():
            return
        with contextlib.suppress(OSError):  # a sender that is gone writes nothing
            self._pair._send(Stop(self._seq))
        if not self.ended.wait(self._pair._ctx.options.io_timeout_s):
            log.warning("KV sender %s did not confirm it stopped transfer #%d",
                        self._pair.sender_id, self._seq)  # fmt: skip


class _Landed:
    """The writes of a pushed transfer: they have run before it is resolved."""

    def flush(self) -> None:
        return None


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
        self._ipc = False  # cuda_ipc: the sender copies into our shared pool
        self._copied: torch.cuda.Event | None = None  # cuda_ipc: the sender's, after its copies
        self._send_lock = threading.Lock()  # the pair thread and a cancelling thread both send
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
            if channel is not None or self._ipc:
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
            backend = self._share_pool(deadline)
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

    def _share_pool(self, deadline: float) -> str:
        """Share our pool with a sender on our GPU; returns the backend of the pair from now on
        (gloo if the sender could not open it)."""
        grants = self._ctx.grants
        fence = export_fence(grants.fence) if grants is not None else None
        pool = tuple(export_pool(self._ctx.caches))
        self._send(Share(pool, fence, grants.pool if grants is not None else ""))
        opened = self._conn.recv(max(deadline - time.monotonic(), 0.001))
        if not isinstance(opened, Opened):
            raise WireError(f"expected the sender's answer to our pool, got {opened!r}")
        if opened.backend == GLOO:
            log.warning("KV sender %s cannot open our pool through CUDA IPC (%s): Gloo",
                        self.sender_id, opened.error)  # fmt: skip
        self._ipc = opened.backend == IPC
        if self._ipc:
            if not opened.event:
                raise WireError("a cuda_ipc sender must share the event its copies record")
            self._copied = open_event(self._ctx.caches[0].device, opened.event)
        return opened.backend

    def _send(self, msg: Message) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _serve(self, channel: PairChannel | None) -> None:
        while not self._stopping.is_set():
            msg = self._conn.recv()
            if isinstance(msg, Control):
                return
            if isinstance(msg, Pushed) and self._ipc and msg.seq == self._next_seq:
                self._next_seq += 1
                self._transfer_pushed(msg)
                continue
            if not isinstance(msg, Header) or msg.seq != self._next_seq:
                raise WireError(f"expected header #{self._next_seq}, got {msg!r}")
            self._next_seq += 1
            if self._ipc:
                self._transfer_ipc(msg)
            else:
                assert channel is not None
                self._transfer(msg, channel)

    def _transfer_ipc(self, header: Header) -> None:
        """One transfer the sender copies into our shared pool; raises (ending the pair) if it
        broke the conversation, gave up or went silent."""
        ctx = self._ctx
        start = time.monotonic()
        claim = ctx.registry.claim(header.transfer_id, ctx.options.unknown_grace_s)
        exp = claim if isinstance(claim, Expectation) else None
        problem = claim if isinstance(claim, str) else self._take_back(claim)
        problem = problem or (self._validate(header, exp) if exp is not None else "")
        if exp is None or problem:
            result = self._finish(exp, header, start, problem)
            self._send(Ack(header.seq, False, result.error))
            return
        pushed = PushedKv(self, header.seq)
        with self._send_lock:  # a Stop (exp.flush) can only follow our Go
            exp.flush = pushed.flush
            exp.busy = lambda: not pushed.ended.is_set()
            self._conn.send(Go(header.seq, exp.handle.block_ids))
        try:
            done = self._conn.recv(ctx.options.io_timeout_s)
            if isinstance(done, Control):
                raise WireError("the sender gave up on the transfer")
            if not isinstance(done, Done) or done.seq != header.seq:
                raise WireError(f"expected the end of #{header.seq}, got {done!r}")
            if done.pending:
                self._await_copies()
        except Exception as e:
            pushed.ended.set()  # the pair ends: a sender that broke it writes nothing more
            error = f"KV stream from sender {self.sender_id} broke: {e}"
            self._finish(exp, header, start, error)
            with contextlib.suppress(Exception):  # tell a live sender to rebuild
                self._send(Ack(header.seq, False, error, broken=True))
            raise
        pushed.ended.set()
        if done.stopped:
            problem = exp.cancel_reason or f"the sender stopped transfer {header.transfer_id!r}"
        elif header.trailer and ctx.options.verify_checksums:
            problem = self._compare_copy(header.transfer_id, exp, done.checksums)
        result = self._finish(exp, header, start, problem, pushed)
        self._send(Ack(header.seq, result.ok, result.error))

    def _take_back(self, exp: Expectation) -> str:
        """A transfer that comes with a header takes the blocks the usual way: a grant of them
        is revoked first (or refused, if a copy already claimed it: then it stays that copy's)."""
        grants, grant = self._ctx.grants, exp.grant
        if grants is None or grant is None or grants.revoke(grant) != CLAIMED:
            return ""
        return (
            f"transfer {exp.transfer_id!r} is already being copied into its blocks "
            "(its grant was used by another transfer)"
        )

    def _transfer_pushed(self, msg: Pushed) -> None:
        """A transfer the sender copied into blocks we granted ahead, without asking (see
        :mod:`kvtransfer.grants`): once its copies have run (the shared event, as for a pending
        Done), check that it used this transfer's grant and resolve it."""
        ctx, start = self._ctx, time.monotonic()
        try:
            self._await_copies()
        except Exception as e:
            error = f"KV stream from sender {self.sender_id} broke: {e}"
            with contextlib.suppress(Exception):
                self._send(Ack(msg.seq, False, error, broken=True))
            raise
        claim = ctx.registry.claim(msg.transfer_id, ctx.options.unknown_grace_s)
        exp = claim if isinstance(claim, Expectation) else None
        problem = claim if isinstance(claim, str) else self._check_pushed(msg, claim)
        if not problem and msg.checksums and ctx.options.verify_checksums:
            assert exp is not None
            problem = self._compare_copy(msg.transfer_id, exp, msg.checksums)
        # the copy has run: resolving settles the grant (landed, or revoked if it never was)
        result = self._finish(exp, msg, start, problem, _Landed() if exp is not None else None)
        self._send(Ack(msg.seq, result.ok, result.error))

    def _check_pushed(self, msg: Pushed, exp: Expectation) -> str:
        grant = exp.grant
        if grant is None or (msg.slot, msg.token) != (grant.slot, grant.token):
            return (
                f"transfer {msg.transfer_id!r} was pushed under a grant this receiver did not "
                "give it"
            )
        # no fence read here (a GPU round trip on the hot path): a grant is revoked only by a
        # cancel, which withdraws the transfer first, or by a header claiming it, which marks
        # it received; either way this claim would have failed. So the copy claimed it and ran.
        return self._validate_blocks(msg.transfer_id, msg.layout, msg.num_blocks, exp)

    def _await_copies(self) -> None:
        """Poll the sender's event until the copies it queued before its Done have run. It
        sends that Done once they are near their end, so the first milliseconds are polled
        finely (a sleeping thread would wake late), then less often; raises if the sender
        hangs up or the copies outlast the I/O timeout."""
        event = self._copied
        assert event is not None
        start = time.monotonic()
        deadline, pause, checked = start + self._ctx.options.io_timeout_s, _POLL_S, start
        while not event.query():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError("the sender's copies did not finish within the I/O timeout")
            if now - checked > _POLL_FINE_S:  # a hang-up now means the copies may never end
                checked = now
                if not self._conn.idle():
                    raise WireError("the sender sent or hung up before we acknowledged")
                pause = min(pause * 2, _POLL_MAX_S)
            time.sleep(pause)

    def _compare_copy(self, transfer_id: str, exp: Expectation, checksums: tuple[int, ...]) -> str:
        """The checksum of our blocks now against the sender's of the blocks it copied."""
        ctx = self._ctx
        with on_stream(ctx.stream):
            ids = self._ids.upload(list(exp.handle.block_ids))
            ours = ctx.copier.gather(ids).view(-1).view(torch.uint8)
            value = checksum_value(checksum_tensor(ours))
        if len(checksums) == 1 and checksums[0] == value:
            return ""
        return (
            f"KV checksum mismatch for transfer {transfer_id!r}: the blocks copied into "
            "this receiver's pool differ from the sender's"
        )

    def _transfer(self, header: Header, channel: PairChannel) -> None:
        """Handle one transfer; raises (ending the pair) if the byte stream broke."""
        ctx = self._ctx
        start = time.monotonic()
        claim = ctx.registry.claim(header.transfer_id, ctx.options.unknown_grace_s)
        exp = claim if isinstance(claim, Expectation) else None
        problem = claim if isinstance(claim, str) else self._take_back(claim)
        problem = problem or (self._validate(header, exp) if exp is not None else "")
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
        # first of all, every chunk's receive (the landing buffer holds them all): the sender
        # may be sending already, and a send whose receive is not posted yet waits for it. With
        # 3 posted ahead and each next one posted once the host saw a chunk land, 8 MiB chunks
        # crossed between two H200s at 22-78 GB/s (one 134 MB chunk: 86 GB/s; the link: 350)
        with on_stream(ctx.post_stream):
            works = {k: landing.post(k) for k in range(n)}
        writer = None
        if exp is not None:
            block_ids = list(exp.handle.block_ids)
            device = ctx.caches[0].device
            writer = BlockWriter.upload(ctx.copier, ctx.layout, block_ids, self._ids, device,
                                        ctx.stream)  # fmt: skip
            exp.flush = writer.flush
        for k in range(n):
            # only the last chunk's landing is waited on by anyone (the decode side, as soon as
            # it is written): the others are polled coarsely, off the engine thread's GIL
            pause = NCCL_POLL_S if k == n - 1 else COARSE_POLL_S
            with on_stream(ctx.stream):  # orders the writes after the receive
                channel.wait(works.pop(k), deadline, alive=self._sender_quiet, pause=pause)
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
        problem = self._validate_blocks(header.transfer_id, header.layout, header.num_blocks, exp)
        if problem:
            return problem
        expected = self._ctx.layout
        if header.nbytes != expected.block_bytes * header.num_blocks:
            return f"transfer {header.transfer_id!r}: {header.nbytes} bytes do not match its layout"
        return ""

    def _validate_blocks(
        self, tid: str, layout: KvLayout, num_blocks: int, exp: Expectation
    ) -> str:
        expected = self._ctx.layout
        if layout != expected and (diff := layout.mismatch(expected)):
            return f"KV layout mismatch for transfer {tid!r} (sender != receiver): {diff}"
        reserved = len(exp.handle.block_ids)
        if num_blocks != reserved:
            return f"transfer {tid!r} carries {num_blocks} blocks but {reserved} were reserved"
        return ""

    def _finish(
        self,
        exp: Expectation | None,
        header: Header | Pushed,
        start: float,
        problem: str,
        writer: BlockWriter | PushedKv | _Landed | None = None,
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
            ctx.counters.add_ok(result.bytes, result.seconds, isinstance(header, Pushed))
        else:
            ctx.counters.add_failure()
        return result
