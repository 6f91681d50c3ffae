"""Where each open Prefill call's KV goes, and the one transfer that takes it there.

Streamed (``--kv-streaming on``, the default): the engine hands :meth:`Handoffs.on_final_chunks`,
on its own thread, the blocks of the prefill-only requests whose last prompt chunk the next
forward computes (``services.engine.kv_handoff``). Each one with an open call here has its
transfer submitted at once, all of them sharing one ``LayerReady`` that the forward records layer
by layer, so the KV leaves while the last chunk and the first token are still being computed:
when the last layer is written, at most its chunk is left to move. Otherwise (off, or nothing
was submitted because the hook failed) the servicer ships the whole KV after the first token
(:meth:`Handoffs.submit_whole`), as before streaming existed; with the blocks granted by the
decode worker with its reservation (``KvTarget.kv_grant``, on one GPU), without asking for them.

Blocks go back to the engine only once no transfer reads them: :meth:`Handoffs.close` (the call
ended, or an ``Abort`` came) cancels a transfer still waiting for its turn, which then never
reads its blocks, and releases them after one already running has ended. No transfer starts
after ``close``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvtransfer import KvSender, LayerReady, TransferStats
from kvtransfer.grants import Grant
from services.engine.kv_handoff import FinalChunk

log = logging.getLogger(__name__)


@dataclass
class Handoff:
    """One open Prefill call with a KV target."""

    request_id: str
    endpoint: str  # the decode worker's KV receiver
    transfer_id: str  # its reservation id
    grant: Grant | None = None  # its blocks, granted with the reservation (whole sends use it)
    future: Future[TransferStats] | None = None  # the transfer, once submitted
    streamed: bool = False  # submitted before the forward that writes the last chunk
    closed: bool = False  # no transfer may start any more


class Handoffs:
    def __init__(self, sender: KvSender, device: torch.device, timeout_s: float) -> None:
        self.sender = sender
        self._num_layers = sender.layout.num_layers
        self._device = device
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # the engine thread submits, the event loop closes
        self._open: dict[str, Handoff] = {}

    def open(
        self, request_id: str, endpoint: str, transfer_id: str, grant: Grant | None = None
    ) -> Handoff | None:
        """Register a call's KV target; None if a call with this request id is open."""
        with self._lock:
            if request_id in self._open:
                return None
            handoff = Handoff(request_id, endpoint, transfer_id, grant)
            self._open[request_id] = handoff
            return handoff

    def on_final_chunks(self, finals: list[FinalChunk]) -> LayerReady | None:
        """On the engine thread, before the forward that computes these requests' last chunk:
        submit each open one's transfer, streamed as that forward records its layers."""
        ready: LayerReady | None = None
        with self._lock:
            for final in finals:
                handoff = self._open.get(final.request_id)
                if handoff is None or handoff.closed or handoff.future is not None:
                    continue
                ready = ready or LayerReady(self._num_layers, self._device)
                try:
                    handoff.future = self.sender.submit(handoff.endpoint, handoff.transfer_id,
                                                        final.block_ids, self._timeout_s,
                                                        ready=ready)  # fmt: skip
                except Exception:  # the servicer ships the whole KV after the first token
                    log.exception("streamed KV transfer of %s not submitted", final.request_id)
                    continue
                handoff.streamed = True
        return ready

    def submit_whole(self, handoff: Handoff, block_ids: list[int]) -> Future[TransferStats] | None:
        """Ship the KV computed so far (the first token is out); None once closed."""
        with self._lock:
            if handoff.closed:
                return None
            grant = handoff.grant
            if grant is not None and len(grant.blocks) != len(block_ids):
                grant = None  # not this KV's blocks: asked for as usual (the receiver says why)
            handoff.future = self.sender.submit(
                handoff.endpoint, handoff.transfer_id, block_ids, self._timeout_s, grant=grant
            )
            return handoff.future

    def close(self, request_id: str, release: Callable[[], object]) -> bool:
        """No transfer starts for this request any more; ``release`` (its blocks back to the
        engine) runs now, or once the transfer that still reads them has ended. False (and
        ``release`` not run): no call with this id is open."""
        with self._lock:
            handoff = self._open.get(request_id)
        if handoff is None:
            return False
        self._close(handoff, release)
        return True

    def finish(self, handoff: Handoff, release: Callable[[], object]) -> None:
        """The call is over: as ``close``, and the request id is free again."""
        self._close(handoff, release)
        with self._lock:
            if self._open.get(handoff.request_id) is handoff:
                del self._open[handoff.request_id]

    def _close(self, handoff: Handoff, release: Callable[[], object]) -> None:
        with self._lock:
            handoff.closed = True
            future = handoff.future
        if future is None:
            release()
            return
        future.cancel()  # one still waiting for its turn never reads its blocks
        future.add_done_callback(lambda _: release())  # at once, unless it is running
