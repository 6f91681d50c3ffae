"""The receiving end of one pair: a thread that takes transfers from one sender, in order.

Per transfer: pop the header from the pair's store queue -> claim the expectation -> receive
exactly ``nbytes`` into a staging buffer (always, even for unknown, cancelled or mismatched
transfers, so the stream stays in step) -> validate -> scatter into the registered blocks ->
resolve the handle -> acknowledge to the sender through the store. A broken stream (peer death,
timeout, protocol error) fails the transfer in flight and ends the thread; the sender rebuilds
the pair under a new generation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.blockcopy import scatter_blocks
from kvtransfer.config import ReceiverOptions
from kvtransfer.expectations import Expectation, ExpectationRegistry
from kvtransfer.layout import KvLayout
from kvtransfer.pair import RECEIVER_RANK, PairChannel
from kvtransfer.results import CounterBox, TransferResult
from kvtransfer.staging import HostStaging, alloc_wire
from kvtransfer.stores import clone, put
from kvtransfer.wire import (
    HEADER_QUEUE,
    Ack,
    Control,
    Header,
    Hello,
    WireError,
    ack_key,
    checksum,
    decode,
    encode,
    pair_prefix,
)

log = logging.getLogger(__name__)
_IDLE_POP = timedelta(days=7)  # header pops block until a header, a stop or the store closes


@dataclass
class ReceiverContext:
    """What every pair of one receiver shares."""

    caches: list[torch.Tensor]
    layout: KvLayout
    registry: ExpectationRegistry
    counters: CounterBox
    options: ReceiverOptions
    stream: torch.cuda.Stream | None  # dedicated CUDA stream for the writes


class ReceiverPair:
    def __init__(self, hello: Hello, backend: str, store: dist.TCPStore, ctx: ReceiverContext):
        self.sender_id = hello.sender_id
        self.backend = backend
        self._prefix = pair_prefix(hello.sender_id, hello.gen)
        # own connections (made here, so the pair never holds the server object): one for the
        # group's rendezvous, one for the blocking header queue and the acknowledgements
        self._group_store = clone(store, timedelta(seconds=ctx.options.connect_timeout_s))
        self._control = clone(store, _IDLE_POP)
        self._ctx = ctx
        self._staging = HostStaging()
        self._next_seq = 1
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-recv-{hello.sender_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, store: dist.Store) -> None:
        """Ask the thread to end after the transfer in flight; ``store`` (a connection the
        thread is not blocked on) carries the message that wakes an idle header wait."""
        self._stopping.set()
        with contextlib.suppress(Exception):  # a store going away fails the pop by itself
            queue = dist.PrefixStore(self._prefix, store)
            queue.queue_push(HEADER_QUEUE, encode(Control("stop")))

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        opts = self._ctx.options
        try:
            channel = PairChannel.open(
                dist.PrefixStore(self._prefix, self._group_store), RECEIVER_RANK, self.backend,
                self._ctx.caches[0].device, time.monotonic() + opts.connect_timeout_s,
                gloo_address=opts.host, gloo_interface=opts.gloo_interface,
            )  # fmt: skip
        except Exception as e:
            if not self._stopping.is_set():
                log.warning("KV pair with sender %s could not be built: %s", self.sender_id, e)
            return
        try:
            self._serve(channel, dist.PrefixStore(self._prefix, self._control))
        except Exception as e:
            if not self._stopping.is_set():
                log.warning("KV pair with sender %s torn down: %s", self.sender_id, e)
        finally:
            channel.close()

    def _serve(self, channel: PairChannel, control: dist.Store) -> None:
        while not self._stopping.is_set():
            msg = decode(control.queue_pop(HEADER_QUEUE))
            if isinstance(msg, Control):
                return
            if not isinstance(msg, Header) or msg.seq != self._next_seq:
                raise WireError(f"expected header #{self._next_seq}, got {msg!r}")
            self._next_seq += 1
            self._transfer(msg, channel, control)

    def _transfer(self, header: Header, channel: PairChannel, control: dist.Store) -> None:
        """Handle one transfer; raises (ending the pair) if the byte stream broke."""
        ctx = self._ctx
        start = time.monotonic()
        claim = ctx.registry.claim(header.transfer_id, ctx.options.unknown_grace_s)
        exp = claim if isinstance(claim, Expectation) else None
        problem = claim if isinstance(claim, str) else self._validate(header, claim)
        try:
            if header.nbytes > ctx.options.max_transfer_bytes:
                raise WireError(f"header announces {header.nbytes} bytes, more than the "
                                f"{ctx.options.max_transfer_bytes} allowed")  # fmt: skip
            data = alloc_wire(header.nbytes, channel.wire_device, channel.device, self._staging)
            channel.recv(data, time.monotonic() + ctx.options.io_timeout_s)
        except Exception as e:
            self._finish(exp, header, start, f"KV stream from sender {self.sender_id} broke: {e}")
            raise
        verify = header.checksum is not None and ctx.options.verify_checksums
        if not problem and verify and checksum(data) != header.checksum:
            problem = f"checksum mismatch for transfer {header.transfer_id!r}"
        result = self._finish(exp, header, start, problem, data)
        put(control, ack_key(header.seq), encode(Ack(header.seq, result.ok, result.error)))

    def _validate(self, header: Header, exp: Expectation) -> str:
        expected = self._ctx.layout
        if diff := header.layout.mismatch(expected):
            return f"KV layout mismatch for transfer {header.transfer_id!r} (sender != receiver): {diff}"  # fmt: skip
        reserved = len(exp.handle.block_ids)
        if header.num_blocks != reserved:
            return (f"transfer {header.transfer_id!r} carries {header.num_blocks} blocks but "
                    f"{reserved} were reserved")  # fmt: skip
        if header.nbytes != expected.block_bytes * header.num_blocks:
            return f"transfer {header.transfer_id!r}: {header.nbytes} bytes do not match its layout"  # fmt: skip
        return ""

    def _finish(
        self,
        exp: Expectation | None,
        header: Header,
        start: float,
        problem: str,
        data: torch.Tensor | None = None,
    ) -> TransferResult:
        """Resolve the transfer: write and succeed, or fail; counts it either way."""
        ctx = self._ctx
        elapsed = time.monotonic() - start
        result = TransferResult(header.transfer_id, not problem, problem, header.nbytes,
                                elapsed, self.sender_id)  # fmt: skip
        if exp is None:
            ctx.counters.add_failure()
            return result
        if problem or data is None:
            result = ctx.registry.fail(exp, result)
        else:
            block_ids = list(exp.handle.block_ids)
            result = ctx.registry.complete(exp, lambda: self._write(data, block_ids), result)
        if result.ok:
            ctx.counters.add_ok(result.bytes, result.seconds)
        else:
            ctx.counters.add_failure()
        return result

    def _write(self, data: torch.Tensor, block_ids: list[int]) -> None:
        """Scatter the received bytes into ``block_ids``; returns once the writes are done."""
        ctx = self._ctx
        device = ctx.caches[0].device
        shape = ctx.layout.buffer_shape(len(block_ids))
        if ctx.stream is None:
            buf = data.view(ctx.layout.torch_dtype).view(shape)
            scatter_blocks(buf, ctx.caches, torch.tensor(block_ids, dtype=torch.int64))
            return
        with torch.cuda.stream(ctx.stream):
            gpu = data.to(device, non_blocking=True)
            buf = gpu.view(ctx.layout.torch_dtype).view(shape)
            ids = torch.tensor(block_ids, dtype=torch.int64).to(device, non_blocking=True)
            scatter_blocks(buf, ctx.caches, ids)
        ctx.stream.synchronize()
