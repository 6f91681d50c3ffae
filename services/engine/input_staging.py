"""A step's integer inputs on their way to the GPU: pinned host buffers reused every step.

The runner writes token ids, positions, slots, context lengths and block tables straight into
numpy views of two pinned buffers (one int64, one int32), then one non-blocking copy per buffer
moves the used prefix to its device twin. No tensor is allocated or pinned per step, and the host
never waits for the GPU except before overwriting a buffer whose previous upload is still queued.
On the CPU the "device" buffers are the host buffers themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

# dtypes whose long host lists numpy converts in C (torch.tensor(list) converts item by item
# in Python's object protocol: ~3x slower per element)
_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def list_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without a stream sync: through pinned memory and a
    non-blocking copy (a plain ``torch.tensor(..., device=...)`` copies from pageable memory and
    waits for the device, which a step queued ahead of its reads must not do)."""
    as_numpy = _NUMPY_DTYPES.get(dtype)
    if as_numpy is not None and len(values) > 64:
        t = torch.from_numpy(np.asarray(values, dtype=as_numpy))
    else:
        t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class InputStaging:
    def __init__(self, n64: int, n32: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._done = torch.cuda.Event() if self.cuda else None
        self._pending = False
        self._alloc(max(n64, 1), max(n32, 1))
        self._sizes: tuple[list[int], list[int]] = ([], [])

    @classmethod
    def for_limits(
        cls, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device
    ) -> InputStaging:
        """Room for any step under the scheduler's limits (it grows if a step needs more)."""
        return cls(3 * max_tokens + max_seqs, 3 * max_seqs + 2 + max_seqs * max_blocks, device)

    def _alloc(self, n64: int, n32: int) -> None:
        self.host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=self.cuda)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=self.cuda)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        if self.cuda:
            self.dev64 = torch.zeros(n64, dtype=torch.int64, device=self.device)
            self.dev32 = torch.zeros(n32, dtype=torch.int32, device=self.device)
        else:
            self.dev64, self.dev32 = self.host64, self.host32

    def begin(
        self, sizes64: list[int], sizes32: list[int]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Host views to fill, laid out back to back in the order given."""
        if self._pending and self._done is not None:
            self._done.synchronize()  # the last upload has left these buffers
            self._pending = False
        n64, n32 = sum(sizes64), sum(sizes32)
        if n64 > self.np64.shape[0] or n32 > self.np32.shape[0]:
            self._alloc(max(n64, self.np64.shape[0]), max(n32, self.np32.shape[0]))
        self._sizes = (sizes64, sizes32)
        return _split(self.np64, sizes64), _split(self.np32, sizes32)

    def upload(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copy what ``begin`` laid out to the device; device views in the same order."""
        sizes64, sizes32 = self._sizes
        n64, n32 = sum(sizes64), sum(sizes32)
        if self.cuda:
            self.dev64[:n64].copy_(self.host64[:n64], non_blocking=True)
            self.dev32[:n32].copy_(self.host32[:n32], non_blocking=True)
            assert self._done is not None
            self._done.record()
            self._pending = True
        return _split(self.dev64, sizes64), _split(self.dev32, sizes32)


def _split(buf, sizes: list[int]) -> list:  # type: ignore[no-untyped-def]
    out, at = [], 0
    for n in sizes:
        out.append(buf[at : at + n])
        at += n
    return out


# ---- a step's layout, built with whole-array numpy ops: one Python pass per field over the
# requests (np.fromiter), never a numpy call per request (~1 us each, hundreds a step)


def fill_tables(tables: np.ndarray, block_ids: Sequence[list[int]]) -> None:
    """Row i of ``tables`` [B, W] gets ``block_ids[i]``, zeros after it (and in the rows
    past ``len(block_ids)``)."""
    tables.fill(0)
    B = len(block_ids)
    if B <= 16:  # a few rows: one assignment each beats the masked fill's fixed cost
        for i, ids in enumerate(block_ids):
            tables[i, : len(ids)] = ids
        return
    lens = np.fromiter(map(len, block_ids), np.int64, B)  # [B]
    flat = np.fromiter(chain.from_iterable(block_ids), np.int64, int(lens.sum()))
    tables[:B][np.arange(tables.shape[1]) < lens[:, None]] = flat  # row-major: row by row


def token_spans(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Request ``i`` computes positions ``starts[i] ..`` for ``lens[i]`` tokens, laid out one
    request after another: each token's request (row) and position, [sum(lens)] each."""
    total = int(lens.sum())
    row = np.repeat(np.arange(len(lens)), lens)  # [T]
    first = np.cumsum(lens) - lens  # [B] where each request's tokens begin
    return row, starts[row] + (np.arange(total) - first[row])


def slot_mapping(
    tables: np.ndarray, row: np.ndarray, pos: np.ndarray, block_size: int
) -> np.ndarray:
    """The cache slot of each token: its block (from its request's table row) and offset."""
    return tables[row, pos // block_size].astype(np.int64) * block_size + pos % block_size
