"""The decode side of KV transfer: a rendezvous store, and one receiving pair per sender.

Contract:
- ``KvReceiver(kv_caches, options)`` listens at ``endpoint`` ("host:port"; port 0 picks a free
  one) for senders' control connections, and runs a TCPStore (another port, told to senders
  in the handshake) over which each sender and this receiver build their own 2-rank group.
  It never calls ``init_process_group``.
- ``expect(transfer_id, block_ids[, deadline_s])`` registers a transfer *before* it is sent
  (after reserving ``block_ids``) and returns a :class:`TransferHandle`. The handle resolves ok
  only once every byte arrived, the layout and block count matched (and every chunk's checksum,
  when the sender sends them) and the blocks were written (CUDA writes synchronized on a dedicated stream). It
  resolves with an error on cancel, deadline, layout mismatch or a broken sender. With
  ``grant=True`` on a GPU, ``handle.grant`` hands the blocks to a sender on the same GPU ahead
  (``kvtransfer.grants``): it copies into them without asking first, fenced on the GPU so that
  a cancel still wins or waits for the copy.
- ``cancel(transfer_id)`` is idempotent; once it returns, the receiver never writes those
  blocks again, so the caller may free them.
- Only registered blocks are ever written, so the engine may keep using the others meanwhile.
- A sender reconnecting under the same sender id (a restarted prefill worker) replaces its old
  pair; the transfer in flight on the old pair, if any, fails.
- ``shards``: as for ``KvSender``, caches that hold part of each block (whole blocks on the
  wire, scattered over the parts by its copier; no CUDA IPC).
- ``close()`` fails everything pending, stops all threads (bounded by the I/O timeout when a
  sender stalls mid-transfer over Gloo) and closes the listener and the store.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvtransfer.auth import HelloChecker
from kvtransfer.blockcopy import KvShards, make_copier
from kvtransfer.config import ReceiverOptions
from kvtransfer.control import ControlConn, listen
from kvtransfer.device import DeviceInfo, choose_backend
from kvtransfer.expectations import ExpectationRegistry, TransferHandle
from kvtransfer.grants import GrantTable
from kvtransfer.layout import KvLayout, check_block_ids
from kvtransfer.receiver_pair import ReceiverContext, ReceiverPair
from kvtransfer.results import CounterBox, TransferCounters
from kvtransfer.stores import serve_store
from kvtransfer.wire import PROTOCOL_VERSION, Hello

log = logging.getLogger(__name__)
MAX_GRANTS = 65536  # fence slots: transfers granted ahead at once


class KvReceiver:
    def __init__(
        self, kv_caches: list[torch.Tensor], options: ReceiverOptions | None = None,
        shards: KvShards | None = None,
    ) -> None:  # fmt: skip
        self.options = opts = options or ReceiverOptions()
        self.layout = shards.layout if shards is not None else KvLayout.of(kv_caches)
        # checks the caches once, before anything starts
        copier = shards.copier if shards is not None else make_copier(kv_caches)
        self._num_blocks = kv_caches[0].shape[1]
        device = kv_caches[0].device
        self._counters = CounterBox()
        self._registry = ExpectationRegistry(self._counters)
        self._hellos = HelloChecker(opts.auth_token)
        self._store: dist.TCPStore | None
        self._store, store_port = serve_store(opts.host, opts.store_port, opts.connect_timeout_s)
        self._listener = listen(opts.host, opts.port)
        self.port: int = self._listener.getsockname()[1]
        cuda = device.type == "cuda"
        # blocks granted ahead to senders on this GPU (only where the pool can be shared)
        self._grants = GrantTable(device, min(self._num_blocks, MAX_GRANTS)) if cuda and shards is None else None  # fmt: skip
        stream = torch.cuda.Stream(device) if cuda else None
        post_stream = torch.cuda.Stream(device) if cuda else None
        self._ctx = ReceiverContext(
            kv_caches,
            self.layout,
            DeviceInfo.of(device, shared=shards is None),
            self._registry,
            self._counters,
            opts,
            stream,
            store_port,
            copier,
            post_stream,
            self._grants,
        )
        self._lock = threading.Lock()
        self._pairs: dict[str, ReceiverPair] = {}  # admitted, by sender id
        self._all: list[ReceiverPair] = []  # every pair thread started and maybe still running
        self._closed = False
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="kv-accept", daemon=True
        )
        self._accept_thread.start()

    @property
    def endpoint(self) -> str:
        """``host:port`` for senders (what a decode worker advertises as its kv_endpoint)."""
        host = self.options.advertise_host or self.options.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        deadline_s: float | None = None,
        *,
        grant: bool = False,
    ) -> TransferHandle:
        """Register a transfer of ``len(block_ids)`` blocks into ``block_ids`` (see module doc).
        Without ``deadline_s`` it is expected until cancelled: the owner of the blocks keeps
        the one clock (the decode worker's reservation does).

        ``grant``: also grant the blocks ahead (``handle.grant``, None where this receiver
        cannot: its pool is not on a GPU it may share, or every fence slot is taken); a sender
        on the same GPU given it (``KvSender.submit(grant=...)``) copies without asking first.
        Costs one small synchronous GPU write here."""
        check_block_ids(block_ids, self._num_blocks)
        table = self._grants
        given = table.grant(block_ids) if grant and table is not None else None
        if given is None or table is None:
            return self._registry.expect(transfer_id, block_ids, deadline_s)
        timeout = self.options.io_timeout_s
        try:
            handle = self._registry.expect(transfer_id, block_ids, deadline_s, given,
                                           lambda: table.settle(given, timeout))  # fmt: skip
        except BaseException:
            table.release(given)  # never handed out: no copy can hold its token
            raise
        # resolving waits for the settle (or the landed copy): the slot is free after it
        handle.add_done_callback(lambda _result: table.release(given))
        return handle

    def cancel(
        self,
        transfer_id: str,
        reason: str = "cancelled by the receiver",
        on_free: Callable[[], None] | None = None,
    ) -> bool:
        """Stop expecting ``transfer_id``; True if it was still pending or in flight. A sender
        still sending it is told ``reason``. Without ``on_free`` it returns once the block
        writes already issued for it have finished (briefly, except while a sender on the same
        GPU still copies into them: up to the rest of the forward computing them). With it, it
        never waits: ``on_free()`` runs once the blocks are the caller's again (at once in the
        usual case, else on another thread)."""
        return self._registry.cancel(transfer_id, reason, on_free)

    def pending(self) -> int:
        return self._registry.pending_count()

    def senders(self) -> list[str]:
        """Ids of senders with a live pair."""
        with self._lock:
            return sorted(sid for sid, pair in self._pairs.items() if pair.alive)

    def backends(self) -> dict[str, str]:
        """The transport of each live pair, by sender id: cuda_ipc, nccl or gloo."""
        with self._lock:
            return {sid: pair.backend for sid, pair in self._pairs.items() if pair.alive}

    def stats(self) -> TransferCounters:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = list(self._all)
        self._registry.close()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        self._listener.close()
        self._accept_thread.join(timeout=5)
        for pair in pairs:
            pair.stop()
        stragglers = [p for p in pairs if not p.join(timeout=2)]
        with self._lock:
            self._pairs.clear()
            self._all.clear()
            self._store = None  # closing the server fails store waits of pairs still being built
        for pair in stragglers:
            if not pair.join(timeout=self.options.io_timeout_s + 1):
                log.warning("KV pair with %s did not stop", pair.sender_id)

    def __enter__(self) -> KvReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._all = [p for p in self._all if p.alive]
                store = self._store
                full = len(self._all) >= self.options.max_pairs + 8  # room for reconnects
                if not (self._closed or store is None or full):
                    pair = ReceiverPair(ControlConn(sock), store, self._ctx, self._admit)
                    self._all.append(pair)
                    pair.start()
                    continue
            log.warning("refusing a KV sender connection: receiver closed or full")
            sock.close()

    def _admit(self, pair: ReceiverPair, hello: Hello) -> tuple[str, str]:
        """Register ``pair`` for its sender (retiring an older one) or say why not."""
        backend = choose_backend(hello.device, self._ctx.device)
        with self._lock:
            live = sum(p.alive for sid, p in self._pairs.items() if sid != hello.sender_id)
            if hello.protocol != PROTOCOL_VERSION:
                return (
                    "",
                    f"protocol {hello.protocol} unsupported (receiver speaks {PROTOCOL_VERSION})",
                )
            if live >= self.options.max_pairs:
                return "", f"receiver already serves {live} senders (max_pairs)"
            refused = self._hellos.refusal(hello.sender_id, hello.gen, hello.issued, hello.proof)
            if refused:
                log.warning("refusing KV sender %s: %s", hello.sender_id, refused)
                return "", refused
            old = self._pairs.get(hello.sender_id)
            self._pairs[hello.sender_id] = pair
        if old is not None and old is not pair:
            log.info("KV sender %s reconnected; retiring its old pair", hello.sender_id)
            old.stop()
        return backend, ""
