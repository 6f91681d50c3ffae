"""The prefill side of KV transfer: ships blocks of its caches to receivers' blocks.

Contract:
- ``KvSender(kv_caches, sender_id, options)``: ``sender_id`` names this worker to receivers and
  must be stable across its restarts (a restarted worker replaces its old pairs) and unique
  among concurrent senders.
- ``submit(endpoint, transfer_id, block_ids, timeout_s)`` queues a transfer of ``block_ids`` of
  every layer to the receiver at ``endpoint`` ("host:port") and returns a
  ``concurrent.futures.Future``. It resolves to :class:`TransferStats` once the receiver has
  acknowledged that they were validated and written into the blocks it registered for
  ``transfer_id``. Anything else resolves it with :class:`TransferError` within ``timeout_s`` of
  the transfer's turn (connecting included): refused by the receiver (unknown or cancelled id,
  layout mismatch; the pair stays up), or a broken pair (receiver died, timeout; the pair is torn
  down and the next transfer rebuilds it under a new generation). No retry happens inside.
  ``send(...)`` is ``submit(...).result()``.
- Transfers to one endpoint run one at a time in submission order on that endpoint's thread
  (``kvtransfer.send_queue``); waiting for the turn does not count against ``timeout_s``. Until
  its turn a transfer can be cancelled (``future.cancel()``) and never reads its blocks; once it
  runs, its blocks are read until the future resolves. If the receiver cannot be reached, every
  transfer queued for it fails at once. Transfers to different endpoints run concurrently.
  Thread-safe.
- The KV must be computed before ``submit``: on CUDA the gather runs on a dedicated stream that
  first waits for an event recorded on the submitting thread's current stream. Or pass ``ready``
  (a :class:`LayerReady`) to stream the KV out while it is being computed: each chunk of layers
  is shipped once the producer has recorded its last layer, the GPU waiting on the producer's
  event instead of the stream (``LayerReady.written(n)``: computed and synchronized, wait for
  nothing). If the producer fails, the transfer fails and the pair is rebuilt.
- ``grant`` (a :class:`kvtransfer.grants.Grant`, from the receiver's ``expect(..., grant=True)``,
  carried here with the reservation): on a pair over CUDA IPC with that receiver's pool, a KV
  computed before ``submit`` is copied into the granted blocks at once, without asking for them
  first (the copy is fenced on the GPU: a grant the receiver took back writes nothing); elsewhere
  (another transport, a streamed KV, a grant of another pool) it is ignored and the blocks are
  asked for as usual.
- ``close()`` tears every pair down and tells the receivers.
- ``shards`` (a :class:`KvShards`): the caches hold part of each block (one tensor-parallel
  rank's KV heads); its copier gathers whole blocks and its layout is the whole model's, so the
  wire carries whole blocks and the pool is never shared over CUDA IPC.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvtransfer.blockcopy import KvShards, make_copier
from kvtransfer.config import SenderOptions
from kvtransfer.device import DeviceInfo
from kvtransfer.grants import Grant
from kvtransfer.layout import KvLayout, check_block_ids
from kvtransfer.ready import LayerReady
from kvtransfer.results import CounterBox, TransferCounters, TransferError, TransferStats
from kvtransfer.send_queue import PairQueue, QueueClosed, ReceiverUnreachable, SendJob
from kvtransfer.sender_pair import SenderContext, SenderPair, TransferRejected
from kvtransfer.wire import MAX_TRANSFER_ID_LEN, Header, check_name

log = logging.getLogger(__name__)


class KvSender:
    def __init__(
        self, kv_caches: list[torch.Tensor], sender_id: str, options: SenderOptions | None = None,
        shards: KvShards | None = None,
    ) -> None:  # fmt: skip
        self.options = options or SenderOptions()
        self.sender_id = check_name("sender_id", sender_id)
        self.layout = shards.layout if shards is not None else KvLayout.of(kv_caches)
        self._num_blocks = kv_caches[0].shape[1]
        device = kv_caches[0].device
        # checks the caches once
        copier = shards.copier if shards is not None else make_copier(kv_caches)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ctx = SenderContext(
            kv_caches,
            self.layout,
            self.sender_id,
            DeviceInfo.of(device, shared=shards is None),
            stream,
            self.options.checksum,
            self.options.gloo_interface,
            self.options.chunk_bytes,
            self.options.streaming_chunk_bytes,
            copier,
            self.options.auth_token,
        )
        self._counters = CounterBox()
        self._lock = threading.Lock()
        self._queues: dict[str, PairQueue] = {}
        self._closed = False
        self._after_header: Callable[[], None] | None = (
            None  # test hook: runs between header and data
        )
        # test hook: sees each chunk as gathered, after its checksum, before it goes out
        self._after_gather: Callable[[torch.Tensor], None] | None = None

    def submit(
        self,
        endpoint: str,
        transfer_id: str,
        block_ids: list[int],
        timeout_s: float | None = None,
        *,
        ready: LayerReady | None = None,
        grant: Grant | None = None,
    ) -> Future[TransferStats]:
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
        computed = None
        if ready is None and self._ctx.stream is not None:  # the KV comes from this thread's stream
            computed = torch.cuda.current_stream(self._ctx.stream.device).record_event()
        if grant is not None and len(grant.blocks) != len(block_ids):
            raise ValueError(f"the grant is for {len(grant.blocks)} blocks, not {len(block_ids)}")
        job = SendJob(transfer_id, list(block_ids), timeout, ready, computed, grant)
        while True:
            queue = self._queue(endpoint)
            try:
                if grant is not None and ready is None and computed is not None:
                    # granted on one GPU: launch the copy from here when the pair is idle
                    start = functools.partial(SenderPair.start_push, transfer_id=transfer_id,
                                              block_ids=job.block_ids, grant=grant,
                                              computed=computed)  # fmt: skip
                    if queue.run_inline(job, start):
                        return job.future
                queue.put(job)
                return job.future
            except QueueClosed:
                if self._closed:
                    raise
                # it retired (idle) between our lookup and the put: the next lookup replaces it

    def send(
        self,
        endpoint: str,
        transfer_id: str,
        block_ids: list[int],
        timeout_s: float | None = None,
        *,
        ready: LayerReady | None = None,
        grant: Grant | None = None,
    ) -> TransferStats:
        future = self.submit(endpoint, transfer_id, block_ids, timeout_s, ready=ready, grant=grant)
        return future.result()

    def stats(self) -> TransferCounters:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues = list(self._queues.values())
            self._queues.clear()
        for queue in queues:
            queue.close(self.options.timeout_s)

    def __enter__(self) -> KvSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _queue(self, endpoint: str) -> PairQueue:
        with self._lock:
            if self._closed:
                raise TransferError("the KV sender is closed")
            queue = self._queues.get(endpoint)
            if queue is None or queue.closed:
                pair = SenderPair(endpoint, self._ctx)
                queue = self._queues[endpoint] = PairQueue(
                    pair, self._run, self._counters.add_failure, self.options.idle_pair_s,
                    self._forget,
                )  # fmt: skip
            return queue

    def _forget(self, queue: PairQueue) -> None:
        """A queue retired when idle: drop it, unless a new one already took its place."""
        with self._lock:
            if self._queues.get(queue.pair.endpoint) is queue:
                del self._queues[queue.pair.endpoint]

    def _run(self, pair: SenderPair, job: SendJob) -> TransferStats:
        """One transfer in its turn, on the pair's thread: its deadline starts now."""
        start = time.monotonic()
        deadline = start + job.timeout_s
        failure: TransferError
        try:
            if not pair.connected:
                self._connect(pair, deadline)
            pair.after_gather = self._after_gather
            if isinstance(job.inline, BaseException):  # its start on the submitting thread
                raise job.inline
            if isinstance(job.inline, Header):  # started there: the ack is left
                nbytes = pair.finish_push(job.inline, deadline)
            else:
                nbytes = pair.transfer(
                    job.transfer_id, job.block_ids, deadline, job.ready, self._after_header,
                    job.computed, job.grant,
                )  # fmt: skip
            seconds = time.monotonic() - start
            self._counters.add_ok(nbytes, seconds)
            return TransferStats(nbytes, seconds)
        except (TransferRejected, ReceiverUnreachable) as e:  # the pair is fine, or already gone
            failure = e
        except TransferError as e:
            pair.close(farewell=True)
            failure = TransferError(str(e))
        except Exception as e:
            pair.close(farewell=True)
            failure = TransferError(
                f"KV transfer {job.transfer_id!r} to {pair.endpoint} failed: "
                f"{type(e).__name__}: {e}"
            )
        self._counters.add_failure()
        raise failure

    @staticmethod
    def _connect(pair: SenderPair, deadline: float) -> None:
        try:
            pair.connect(deadline)
        except Exception as e:
            pair.close(farewell=False)
            raise ReceiverUnreachable(
                f"cannot reach the KV receiver at {pair.endpoint}: {type(e).__name__}: {e}"
            ) from e
