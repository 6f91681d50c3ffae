"""Moving transfer buffers between the caches' device and the wire device.

Gloo only moves host memory, so a CUDA end of a Gloo pair (two processes on one GPU, or a
CUDA/CPU pair) stages through a reusable pinned host buffer. NCCL pairs and CPU pairs need none.
"""

from __future__ import annotations

import torch


class HostStaging:
    """A growing host buffer, pinned when CUDA is present, reused across one pair's transfers.

    Not thread-safe: each pair end owns one and uses it for one transfer at a time.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:  # [nbytes] uint8, host
        if self._buf is None or self._buf.numel() < nbytes:
            pin = torch.cuda.is_available()
            self._buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=pin)
        return self._buf[:nbytes]


def as_bytes(t: torch.Tensor) -> torch.Tensor:  # [nbytes] uint8, same storage
    """A flat uint8 view of a contiguous tensor (what travels on the wire)."""
    return t.contiguous().view(-1).view(torch.uint8)


def to_wire(data: torch.Tensor, wire: torch.device, host: torch.Tensor | None) -> torch.Tensor:
    """``data`` (flat uint8) as a tensor on ``wire``: itself, or copied into ``host`` (a slice
    of a staging buffer, same size) and waited for."""
    if data.device == wire:
        return data
    if host is None:
        raise ValueError(f"data on {data.device} needs a host staging slot to reach {wire}")
    host.copy_(data, non_blocking=True)
    if data.is_cuda:
        torch.cuda.current_stream(data.device).synchronize()
    return host


def alloc_wire(
    nbytes: int, wire: torch.device, device: torch.device, staging: HostStaging
) -> torch.Tensor:
    """A receive buffer of ``nbytes`` on ``wire`` (staged host memory when ``device`` differs)."""
    if wire.type == "cpu" and device.type == "cuda":
        return staging.get(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=wire)
