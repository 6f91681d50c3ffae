"""Where one incoming transfer lands on the receiver, and how its chunks reach the blocks.

The bytes are received into one buffer on the wire device (GPU memory for NCCL, reusable host
staging for Gloo), one message per chunk. Each chunk that has arrived is written into the
registered blocks on the receiver's dedicated CUDA stream (after a host-to-device copy when
staged) while later chunks are still arriving. :meth:`Landing.flush` waits for every write
issued so far.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtransfer.blockcopy import scatter_blocks
from kvtransfer.chunks import LayerRange
from kvtransfer.layout import KvLayout
from kvtransfer.pair import PairChannel
from kvtransfer.staging import HostStaging, alloc_wire


class Landing:
    def __init__(self, channel: PairChannel, sizes: tuple[int, ...], staging: HostStaging) -> None:
        self._channel = channel
        self.buffer = alloc_wire(sum(sizes), channel.wire_device, channel.device, staging)
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        self.chunks = [self.buffer[o : o + n] for o, n in zip(offsets, sizes, strict=True)]

    def post(self) -> list[Any]:
        """Post one receive per chunk, in order (the sender posts its sends in the same order)."""
        return [self._channel.post_recv(chunk, tag=k) for k, chunk in enumerate(self.chunks)]


class BlockWriter:
    """Writes landed chunks of one transfer into ``block_ids`` of the receiver's caches."""

    def __init__(
        self,
        caches: list[torch.Tensor],
        layout: KvLayout,
        block_ids: list[int],
        stream: torch.cuda.Stream | None,
    ) -> None:
        self._caches = caches
        self._layout = layout
        self._stream = stream
        self._device = caches[0].device
        self._n = len(block_ids)
        self._ids = torch.tensor(block_ids, dtype=torch.int64).to(self._device)

    def write(self, chunk: torch.Tensor, layers: LayerRange) -> None:
        """Issue the writes of one chunk (``[bytes]`` uint8 holding ``layers``)."""
        first, last = layers
        shape = (last - first, *self._layout.buffer_shape(self._n)[1:])
        if self._stream is None:
            buf = chunk.view(self._layout.torch_dtype).view(shape)
            scatter_blocks(buf, self._caches[first:last], self._ids)
            return
        with torch.cuda.stream(self._stream):
            data = chunk.to(self._device, non_blocking=True)  # no-op when it landed on the GPU
            buf = data.view(self._layout.torch_dtype).view(shape)
            scatter_blocks(buf, self._caches[first:last], self._ids)

    def flush(self) -> None:
        """Return once every write issued so far is done."""
        if self._stream is not None:
            self._stream.synchronize()
