"""When each layer's KV is written: what lets a send stream the KV out while prefill still runs.

A forward pass writes layer i's KV, then computes on. Its producer calls ``record(i)`` right
after enqueuing that write (layers in order, 0 first; recording layer i says layers 0..i are
written). On CUDA that records an event on the producer's stream, so ``KvSender.send(...,
ready=)`` makes its own stream wait on the event (the GPU waits, not the host) and ships a chunk
of layers as soon as its last layer is written, while later layers are still being computed.
The host of the sending thread only waits for the ``record`` calls, which run ahead of the GPU.

``fail(reason)`` (the forward failed) makes a send waiting for a layer raise at once instead
of at its deadline. Thread-safe; the sends of several requests computed by the same forward
may share one (waiting consumes nothing).
"""

from __future__ import annotations

import threading
import time

import torch


class LayerReadyError(RuntimeError):
    """The producer failed, or a layer was not recorded before the deadline."""


class LayerReady:
    def __init__(self, num_layers: int, device: torch.device | str = "cpu") -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        self.num_layers = num_layers
        self.device = torch.device(device)
        self._cond = threading.Condition()
        self._events: list[tuple[int, torch.cuda.Event | None]] = []  # (layer, event), in order
        self._upto = -1  # layers 0.._upto are recorded
        self._failed = ""

    @classmethod
    def written(cls, num_layers: int) -> LayerReady:
        """Every layer already written and synchronized with the host: nothing to wait for."""
        ready = cls(num_layers)
        ready.record(num_layers - 1)
        return ready

    def record(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Layers 0..``layer`` are written (on CUDA: once the work queued so far on ``stream``,
        default the current one, is done)."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        with self._cond:
            if not self._upto < layer < self.num_layers:
                raise ValueError(
                    f"layer {layer} recorded after layer {self._upto} (of {self.num_layers})"
                )
            self._events.append((layer, event))
            self._upto = layer
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """The producer will record no more layers: waiting sends raise ``reason``."""
        with self._cond:
            self._failed = reason or "the producer failed"
            self._cond.notify_all()

    def wait(self, layer: int, deadline: float) -> torch.cuda.Event | None:
        """Block until ``layer`` is recorded (not computed); returns the event that says when it
        is computed (None: it already is). Raises LayerReadyError on fail() or the deadline
        (``time.monotonic()`` seconds)."""
        with self._cond:
            if not self._recorded(layer, deadline):
                raise LayerReadyError(f"layer {layer} was not written before the deadline")
            return next(event for recorded, event in self._events if recorded >= layer)

    def latest(self, layer: int, deadline: float) -> tuple[int, torch.cuda.Event | None] | None:
        """Like :meth:`wait`, but returns the last layer recorded so far (>= ``layer``) with the
        event that says when it (so every layer before it) is computed, and None (no raise) if
        the deadline passes first."""
        with self._cond:
            return self._events[-1] if self._recorded(layer, deadline) else None

    def _recorded(self, layer: int, deadline: float) -> bool:
        """Under the lock: wait until ``layer`` is recorded (True) or the deadline passes
        (False); raises LayerReadyError on fail()."""
        while self._upto < layer:
            if self._failed:
                raise LayerReadyError(f"layer {layer} will not be written: {self._failed}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._cond.wait(remaining)
        return True

    def ranges(self, first: int, last: int) -> list[tuple[int, int, torch.cuda.Event | None]]:
        """Layers [first, last) (all recorded) as ranges that became computed together, in
        order: (start, end, the event that says so). A producer recording every layer gives one
        range per layer, so a consumer can follow the forward layer by layer on the GPU."""
        out: list[tuple[int, int, torch.cuda.Event | None]] = []
        start = first
        with self._cond:
            if last - 1 > self._upto:
                raise ValueError(f"layers up to {last - 1} are not recorded yet")
            for recorded, event in self._events:
                if recorded >= start:
                    end = min(recorded + 1, last)
                    out.append((start, end, event))
                    start = end
                    if start >= last:
                        break
        return out
