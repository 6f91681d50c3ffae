"""Where one incoming transfer lands on the receiver, and how its chunks reach the blocks.

The bytes are received into one buffer on the wire device (GPU memory for NCCL, reusable host
staging for Gloo), one message per chunk. Each chunk that has arrived is written into the
registered blocks on the receiver's dedicated CUDA stream (after a host-to-device copy when
staged) while later chunks are still arriving. :meth:`BlockWriter.flush` waits for every write
issued so far. Nothing here blocks the host on the GPU except ``flush``: the block ids go up
through a pinned buffer, and on CUDA the receiver allocates, receives and writes on its own
stream, so the decode engine's work queued on the default stream never delays a transfer.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtransfer.blockcopy import Copier
from kvtransfer.chunks import LayerRange
from kvtransfer.device import on_stream
from kvtransfer.layout import KvLayout
from kvtransfer.pair import PairChannel
from kvtransfer.staging import DeviceIds, HostStaging, alloc_wire


class Landing:
    def __init__(self, channel: PairChannel, sizes: tuple[int, ...], staging: HostStaging) -> None:
        self._channel = channel
        self.buffer = alloc_wire(sum(sizes), channel.wire_device, channel.device, staging)
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        self.chunks = [self.buffer[o : o + n] for o, n in zip(offsets, sizes, strict=True)]

    def post(self, k: int) -> Any:
        """Post the receive of chunk ``k`` (in order: the sender posts its sends in that order)."""
        return self._channel.post_recv(self.chunks[k], tag=k)


class BlockWriter:
    """Writes landed chunks of one transfer into ``block_ids`` of the receiver's caches."""

    def __init__(
        self,
        copier: Copier,
        layout: KvLayout,
        ids: torch.Tensor,  # [n] int64 on the caches' device (uploaded on ``stream``)
        device: torch.device,
        stream: torch.cuda.Stream | None,
    ) -> None:
        self._copier = copier
        self._layout = layout
        self._stream = stream
        self._device = device
        self._ids = ids

    @classmethod
    def upload(
        cls,
        copier: Copier,
        layout: KvLayout,
        block_ids: list[int],
        uploads: DeviceIds,
        device: torch.device,
        stream: torch.cuda.Stream | None,
    ) -> BlockWriter:
        with on_stream(stream):
            return cls(copier, layout, uploads.upload(block_ids), device, stream)

    def write(self, chunk: torch.Tensor, layers: LayerRange) -> None:
        """Issue the writes of one chunk (``[bytes]`` uint8 holding ``layers``)."""
        first, last = layers
        shape = (last - first, *self._layout.buffer_shape(self._ids.numel())[1:])
        with on_stream(self._stream):
            data = chunk.to(self._device, non_blocking=True)  # no-op when it landed on the GPU
            buf = data.view(self._layout.torch_dtype).view(shape)
            self._copier.scatter(buf, self._ids, first, last)

    def flush(self) -> None:
        """Return once every write issued so far is done."""
        if self._stream is not None:
            self._stream.synchronize()
