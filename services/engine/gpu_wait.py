"""Read a step's results on the host, waiting for the GPU with the GIL released.

Reading a CUDA tensor on the host (``.tolist()``, ``.item()``) blocks inside torch while holding
the GIL, so a worker's gRPC event loop, which shares the process, cannot stream tokens while the
GPU computes the next ones: the two serialize. Here every tensor is copied into pinned host
memory without blocking, then one wait on a CUDA event (torch releases the GIL in
``Event.synchronize``) covers them all, and the lists are built from host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Ticket:
    """A read under way (:meth:`GpuReader.start`): the host copy, or on the CPU the values."""

    view: torch.Tensor | None = None
    values: list | None = None


class GpuReader:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pinned: dict[torch.dtype, torch.Tensor] = {}
        self._while: Callable[[], None] | None = None
        # a launched step's tokens on their way to the host (start/finish): their own buffer
        # and event, apart from read()'s
        self._ahead_event = torch.cuda.Event() if device.type == "cuda" else None
        self._ahead: torch.Tensor | None = None
        # called once the values are on the host, before they are returned: raises if they
        # cannot be trusted (a tensor-parallel rank died and the step's collectives were
        # aborted: ``Ranks.raise_if_aborted``)
        self.check: Callable[[], None] | None = None

    @property
    def overlaps(self) -> bool:
        """Whether host work handed to :meth:`while_waiting` overlaps the step: on a GPU it runs
        while the device computes; on the CPU the forward has already run when the step reads
        its results, so work left for the next read runs a whole forward late."""
        return self._event is not None

    def while_waiting(self, work: Callable[[], None] | None) -> None:
        """Run ``work`` once, at the next :meth:`read`, after the copies are queued and before
        the host waits for the GPU: host work that overlaps the step's GPU time (None: forget
        the work left, unrun)."""
        self._while = work

    def run_pending(self) -> None:
        """Run the work :meth:`while_waiting` left, if no read ran it (a step that read nothing)."""
        work, self._while = self._while, None
        if work is not None:
            work()

    def read(self, *tensors: torch.Tensor) -> list[list]:
        """Each tensor's values as (nested) Python lists, once the GPU has produced them."""
        if self._event is None:
            self.run_pending()
            values = [t.tolist() for t in tensors]
            self._checked()
            return values
        need: dict[torch.dtype, int] = {}
        for t in tensors:
            need[t.dtype] = need.get(t.dtype, 0) + t.numel()
        for dtype, n in need.items():
            buf = self._pinned.get(dtype)
            if buf is None or buf.numel() < n:
                self._pinned[dtype] = torch.empty(max(n, 1024), dtype=dtype, pin_memory=True)
        at = dict.fromkeys(need, 0)
        views = []
        for t in tensors:
            view = self._pinned[t.dtype][at[t.dtype] : at[t.dtype] + t.numel()].view(t.shape)
            at[t.dtype] += t.numel()
            view.copy_(t, non_blocking=True)
            views.append(view)
        self._event.record(torch.cuda.current_stream(self.device))  # the copies' stream
        self.run_pending()
        self._synchronize(self._event)
        return [v.tolist() for v in views]

    def start(self, t: torch.Tensor) -> Ticket:
        """Queue a 1-D tensor's copy to the host behind the work already queued, without
        waiting: :meth:`finish` returns its values. One ticket at a time: the next ``start``
        reuses the buffer, so it comes after the last ticket's ``finish``."""
        if self._ahead_event is None:
            return Ticket(values=t.tolist())  # the CPU: the step has already run
        if self._ahead is None or self._ahead.numel() < t.numel() or self._ahead.dtype != t.dtype:
            self._ahead = torch.empty(max(t.numel(), 1024), dtype=t.dtype, pin_memory=True)
        view = self._ahead[: t.numel()]
        view.copy_(t, non_blocking=True)
        self._ahead_event.record(torch.cuda.current_stream(self.device))
        return Ticket(view=view)

    def finish(self, ticket: Ticket) -> list:
        """A started read's values, after the pending host work (:meth:`while_waiting`) ran."""
        self.run_pending()
        if ticket.values is not None:
            self._checked()
            return ticket.values
        assert ticket.view is not None and self._ahead_event is not None
        self._synchronize(self._ahead_event)
        return ticket.view.tolist()

    def _synchronize(self, event: torch.cuda.Event) -> None:
        """Wait for ``event``, then the check; also when the wait fails (an aborted collective
        may raise a plain error: the check names the rank that died)."""
        try:
            event.synchronize()
        except BaseException:
            self._checked()
            raise
        self._checked()

    def _checked(self) -> None:
        if self.check is not None:
            self.check()
