"""Moving transfer buffers between the caches' device and the wire device.

Gloo only moves host memory, so a CUDA end of a Gloo pair (two processes on one GPU, or a
CUDA/CPU pair) stages through a reusable pinned host buffer. NCCL pairs and CPU pairs need none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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


class DeviceIds:
    """Block ids as an int64 tensor on the caches' device, without a blocking copy.

    On CUDA the ids are written into a reusable pinned host buffer and copied on the current
    stream with ``non_blocking``: the host never waits for the GPU (a plain ``.to(device)``
    would synchronize with everything queued on the stream). Not thread-safe: each pair end
    owns one and uses it for one transfer at a time.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._host: torch.Tensor | None = None
        self._view: np.ndarray | None = None  # the host buffer, filled from the list directly
        self._copied: torch.cuda.Event | None = None

    def upload(self, block_ids: Sequence[int]) -> torch.Tensor:  # [n] int64 on the device
        if self._device.type != "cuda":
            return torch.tensor(block_ids, dtype=torch.int64)
        n = len(block_ids)
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the buffer (done long ago)
        else:
            self._copied = torch.cuda.Event()
        if self._host is None or self._view is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 4096), dtype=torch.int64, pin_memory=True)
            self._view = self._host.numpy()
        self._view[:n] = block_ids  # numpy converts the list in C: torch.tensor(list) is slower
        out = self._host[:n].to(self._device, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self._device))
        return out
