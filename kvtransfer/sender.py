"""The prefill side of KV transfer: ships blocks of its caches to receivers' blocks.

Contract:
- ``KvSender(kv_caches, sender_id, options)``: ``sender_id`` names this worker to receivers and
  must be stable across its restarts (a restarted worker replaces its old pairs) and unique
  among concurrent senders.
- ``send(endpoint, transfer_id, block_ids, timeout_s)`` gathers ``block_ids`` of every layer,
  ships them to the receiver at ``endpoint`` ("host:port") and returns :class:`TransferStats`
  once the receiver has acknowledged that they were validated and written into the blocks it
  registered for ``transfer_id``. Anything else raises :class:`TransferError` within
  ``timeout_s`` (connecting included): refused by the receiver (unknown or cancelled id, layout
  mismatch; the pair stays up), or a broken pair (receiver died, timeout; the pair is torn
  down and the next send rebuilds it under a new generation). No retry happens inside.
- Thread-safe. Transfers to one endpoint are serialized in call order (one lock per pair);
  transfers to different endpoints run concurrently.
- The KV must be computed before ``send``: on CUDA the gather runs on a dedicated stream that
  first waits for the calling thread's current stream. Or pass ``ready`` (a
  :class:`LayerReady`) to stream the KV out while it is being computed: each chunk of layers
  is shipped once the producer has recorded its last layer, the GPU waiting on the producer's
  event instead of the stream (``LayerReady.written(n)``: computed and synchronized, wait for
  nothing). If the producer fails, the send fails and the pair is rebuilt.
- ``close()`` tears every pair down and tells the receivers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from kvtransfer.blockcopy import make_copier
from kvtransfer.config import SenderOptions
from kvtransfer.device import DeviceInfo
from kvtransfer.layout import KvLayout, check_block_ids
from kvtransfer.ready import LayerReady
from kvtransfer.results import CounterBox, TransferCounters, TransferError, TransferStats
from kvtransfer.sender_pair import SenderContext, SenderPair, TransferRejected
from kvtransfer.wire import MAX_TRANSFER_ID_LEN, check_name

log = logging.getLogger(__name__)


class KvSender:
    def __init__(
        self, kv_caches: list[torch.Tensor], sender_id: str, options: SenderOptions | None = None
    ) -> None:
        self.options = options or SenderOptions()
        self.sender_id = check_name("sender_id", sender_id)
        self.layout = KvLayout.of(kv_caches)
        self._num_blocks = kv_caches[0].shape[1]
        device = kv_caches[0].device
        copier = make_copier(kv_caches)  # checks the caches once
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ctx = SenderContext(
            kv_caches,
            self.layout,
            self.sender_id,
            DeviceInfo.of(device),
            stream,
            self.options.checksum,
            self.options.gloo_interface,
            self.options.chunk_bytes,
            self.options.streaming_chunk_bytes,
            copier,
        )
        self._counters = CounterBox()
        self._lock = threading.Lock()
        self._pairs: dict[str, tuple[threading.Lock, SenderPair]] = {}
        self._closed = False
        self._after_header: Callable[[], None] | None = (
            None  # test hook: runs between header and data
        )

    def send(
        self,
        endpoint: str,
        transfer_id: str,
        block_ids: list[int],
        timeout_s: float | None = None,
        *,
        ready: LayerReady | None = None,
    ) -> TransferStats:
        timeout = self.options.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        if not transfer_id or len(transfer_id) > MAX_TRANSFER_ID_LEN:
            raise ValueError(f"transfer_id must have 1 to {MAX_TRANSFER_ID_LEN} characters")
        check_block_ids(block_ids, self._num_blocks)
        if ready is not None and ready.num_layers != self.layout.num_layers:
            raise ValueError(
                f"ready covers {ready.num_layers} layers, the caches {self.layout.num_layers}"
            )
        start = time.monotonic()
        lock, pair = self._pair(endpoint)
        if not lock.acquire(timeout=timeout):
            self._counters.add_failure()
            raise TransferError(
                f"KV transfer {transfer_id!r} to {endpoint} waited {timeout:.1f} s "
                "behind earlier transfers to the same receiver"
            )
        try:
            nbytes = self._send_locked(pair, transfer_id, block_ids, start + timeout, ready)
        finally:
            lock.release()
        seconds = time.monotonic() - start
        self._counters.add_ok(nbytes, seconds)
        return TransferStats(nbytes, seconds)

    def stats(self) -> TransferCounters:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for lock, pair in pairs:
            got = lock.acquire(timeout=self.options.timeout_s)
            try:
                pair.close()
            finally:
                if got:
                    lock.release()

    def __enter__(self) -> KvSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pair(self, endpoint: str) -> tuple[threading.Lock, SenderPair]:
        with self._lock:
            if self._closed:
                raise TransferError("the KV sender is closed")
            entry = self._pairs.get(endpoint)
            if entry is None:
                entry = self._pairs[endpoint] = (threading.Lock(), SenderPair(endpoint, self._ctx))
            return entry

    def _send_locked(
        self,
        pair: SenderPair,
        transfer_id: str,
        block_ids: list[int],
        deadline: float,
        ready: LayerReady | None,
    ) -> int:
        error = ""
        try:
            if not pair.connected:
                pair.connect(deadline)
            return pair.transfer(transfer_id, block_ids, deadline, ready, self._after_header)
        except TransferRejected as e:
            error = str(e)
        except TransferError as e:
            pair.close(farewell=True)
            error = str(e)
        except Exception as e:
            pair.close(farewell=True)
            error = (
                f"KV transfer {transfer_id!r} to {pair.endpoint} failed: {type(e).__name__}: {e}"
            )
        self._counters.add_failure()
        raise TransferError(error)
