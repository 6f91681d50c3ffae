"""The decode side of KV transfer: a rendezvous store, and one receiving pair per sender.

Contract:
- ``KvReceiver(kv_caches, options)`` listens at ``endpoint`` ("host:port"; port 0 picks a free
  one). It never calls ``init_process_group``: each sender gets its own 2-rank group.
- ``expect(transfer_id, block_ids, deadline_s)`` registers a transfer *before* it is sent
  (after reserving ``block_ids``) and returns a :class:`TransferHandle`. The handle resolves ok
  only once every byte arrived, the layout and block count matched (and the checksum, in debug
  mode) and the blocks were written (CUDA writes synchronized on a dedicated stream). It
  resolves with an error on cancel, deadline, layout mismatch or a broken sender.
- ``cancel(transfer_id)`` is idempotent; once it returns, the receiver never writes those
  blocks again, so the caller may free them.
- Only registered blocks are ever written, so the engine may keep using the others meanwhile.
- A sender reconnecting under the same sender id (a restarted prefill worker) replaces its old
  pair; the transfer in flight on the old pair, if any, fails.
- ``close()`` fails everything pending, stops all threads (bounded by the I/O timeout when a
  sender stalls mid-transfer) and closes the store.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.config import ReceiverOptions
from kvtransfer.device import DeviceInfo, choose_backend
from kvtransfer.expectations import ExpectationRegistry, TransferHandle
from kvtransfer.layout import KvLayout, check_block_ids
from kvtransfer.receiver_pair import ReceiverContext, ReceiverPair
from kvtransfer.results import CounterBox, TransferCounters
from kvtransfer.stores import clone, put, serve_store
from kvtransfer.wire import (
    HELLO_QUEUE,
    PROTOCOL_VERSION,
    Control,
    Hello,
    Welcome,
    WireError,
    decode,
    encode,
    welcome_key,
)

log = logging.getLogger(__name__)
_IDLE_POP = timedelta(days=7)


class KvReceiver:
    def __init__(self, kv_caches: list[torch.Tensor], options: ReceiverOptions | None = None):
        self.options = options or ReceiverOptions()
        self.layout = KvLayout.of(kv_caches)
        self._caches = kv_caches
        self._num_blocks = kv_caches[0].shape[1]
        device = kv_caches[0].device
        self._device = DeviceInfo.of(device)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._counters = CounterBox()
        self._registry = ExpectationRegistry(self._counters)
        self._ctx = ReceiverContext(kv_caches, self.layout, self._registry, self._counters,
                                    self.options, stream)  # fmt: skip
        store, self.port = serve_store(
            self.options.host, self.options.port, self.options.connect_timeout_s
        )
        self._store: dist.TCPStore | None = store
        self._lock = threading.Lock()
        self._pairs: dict[str, ReceiverPair] = {}
        self._retired: list[ReceiverPair] = []
        self._closed = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)  # fmt: skip
        self._accept_thread.start()

    @property
    def endpoint(self) -> str:
        """``host:port`` for senders (what a decode worker advertises as its kv_endpoint)."""
        host = self.options.advertise_host or self.options.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def expect(self, transfer_id: str, block_ids: list[int], deadline_s: float) -> TransferHandle:
        """Register a transfer of ``len(block_ids)`` blocks into ``block_ids`` (see module doc)."""
        check_block_ids(block_ids, self._num_blocks)
        return self._registry.expect(transfer_id, block_ids, deadline_s)

    def cancel(self, transfer_id: str) -> bool:
        """Stop expecting ``transfer_id``; True if it was still pending or in flight."""
        return self._registry.cancel(transfer_id)

    def pending(self) -> int:
        return self._registry.pending_count()

    def senders(self) -> list[str]:
        """Ids of senders with a live pair."""
        with self._lock:
            return sorted(sid for sid, pair in self._pairs.items() if pair.alive)

    def stats(self) -> TransferCounters:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed or self._store is None:
                return
            self._closed = True
            pairs = [*self._pairs.values(), *self._retired]
            store = self._store
        self._registry.close()
        with contextlib.suppress(Exception):
            store.queue_push(HELLO_QUEUE, encode(Control("stop")))
        for pair in pairs:
            pair.stop(store)
        self._accept_thread.join(timeout=5)
        stragglers = [p for p in pairs if not p.join(timeout=2)]
        with self._lock:
            self._pairs.clear()
            self._retired.clear()
            self._store = None  # closing the server fails store waits of pairs still being built
        del store
        for pair in stragglers:
            if not pair.join(timeout=self.options.io_timeout_s + 1):
                log.warning("KV pair with %s did not stop", pair.sender_id)

    def __enter__(self) -> KvReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        assert self._store is not None
        client = clone(self._store, _IDLE_POP)
        while True:
            try:
                msg = decode(client.queue_pop(HELLO_QUEUE))
            except WireError as e:
                log.warning("ignoring a malformed KV hello: %s", e)
                continue
            except Exception as e:
                if not self._closed:
                    log.warning("KV accept loop ended: %s", e)
                return
            if isinstance(msg, Control) or self._closed:
                return
            if isinstance(msg, Hello):
                self._admit(client, msg)

    def _admit(self, client: dist.Store, hello: Hello) -> None:
        backend, error = choose_backend(hello.device, self._device), ""
        with self._lock:
            self._retired = [p for p in self._retired if p.alive]
            live = sum(p.alive for p in self._pairs.values())
            if hello.protocol != PROTOCOL_VERSION:
                error = f"protocol {hello.protocol} unsupported (receiver speaks {PROTOCOL_VERSION})"  # fmt: skip
            elif live >= self.options.max_pairs and hello.sender_id not in self._pairs:
                error = f"receiver already serves {live} senders (max_pairs)"
        if error:
            log.warning("refusing KV sender %s: %s", hello.sender_id, error)
        welcome = Welcome("" if error else backend, self._device, error)
        try:
            put(client, welcome_key(hello.sender_id, hello.gen), encode(welcome))
        except Exception as e:
            log.warning("could not answer KV sender %s: %s", hello.sender_id, e)
            return
        store = self._store
        if error or store is None:
            return
        pair = ReceiverPair(hello, backend, store, self._ctx)
        with self._lock:
            old = self._pairs.pop(hello.sender_id, None)
            self._pairs[hello.sender_id] = pair
            if old is not None:
                self._retired.append(old)
        if old is not None:
            log.info("KV sender %s reconnected; replacing its old pair", hello.sender_id)
            old.stop(store)
        pair.start()
