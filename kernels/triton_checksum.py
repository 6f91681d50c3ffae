"""The KV-transfer checksum in Triton: the bytes read once, the same int64 bits as the reference.

Same value as :func:`kernels.checksum.ref_checksum` (see its module for the formula). Each
program sums ``BLOCK`` words of one piece: ``word * weight`` is exact in int64 (|word| < 2**31,
weight <= 65521), a block of them sums to under 2**60, and only the block's sum times the piece
factor wraps, as it does in the reference (a ring modulo 2**64: any order, the same bits).
Program 0 adds the 0-3 tail bytes. The per-program sums land in a small int64 buffer that one
``torch.sum`` reduces, on the current stream: no host sync, the result stays on the device.

A slice that does not start on a 4-byte boundary (a chunk at an odd byte offset of a transfer
buffer) is read byte by byte and its words assembled in registers; aligned data is read as int32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checksum import PIECE_WORDS, TAIL_WEIGHT, WEIGHT_MOD
from kernels.triton_common import check_devices, check_tensor

DEFAULT_CONFIG = (4096, 8)  # (BLOCK words per program, num_warps)
MAX_PIECE_WORDS = 1 << 30  # word offsets inside a piece stay int32
MAX_BLOCK = 1 << 15  # a block's weights wrap around WEIGHT_MOD (65521) at most once


@triton.jit
def _checksum_kernel(
    words_ptr, bytes_ptr, partial_ptr, num_words, tail_start, tail, piece_words, blocks_per_piece,
    BYTES: tl.constexpr, BLOCK: tl.constexpr, MOD: tl.constexpr, TAIL_W: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    piece = pid // blocks_per_piece
    start = (pid % blocks_per_piece) * BLOCK  # the block's first word, counted in its piece
    in_piece = start + tl.arange(0, BLOCK)  # [BLOCK] int32
    idx = piece.to(tl.int64) * piece_words + in_piece  # [BLOCK] word index in the data
    mask = (in_piece < piece_words) & (idx < num_words)
    if BYTES:  # unaligned: little-endian words from their bytes (disjoint bits: | is exact)
        at = bytes_ptr + idx * 4
        word = tl.load(at, mask=mask, other=0).to(tl.int32)
        word |= tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8
        word |= tl.load(at + 2, mask=mask, other=0).to(tl.int32) << 16
        word |= tl.load(at + 3, mask=mask, other=0).to(tl.int32) << 24
    else:
        word = tl.load(words_ptr + idx, mask=mask, other=0)
    # in_piece % MOD + 1 without a division a word (BLOCK <= MOD: it wraps at most once)
    weight = start % MOD + tl.arange(0, BLOCK)
    weight = tl.where(weight >= MOD, weight - MOD, weight) + 1
    total = tl.sum(word.to(tl.int64) * weight.to(tl.int64), axis=0) * (piece.to(tl.int64) + 1)
    t = tl.arange(0, 4)
    own_tail = tl.where(pid == 0, tail, 0)  # program 0 adds the tail bytes
    tail_bytes = tl.load(bytes_ptr + tail_start + t, mask=t < own_tail, other=0).to(tl.int64)
    total += tl.sum(tail_bytes * (t + TAIL_W).to(tl.int64), axis=0)
    tl.store(partial_ptr + pid, total)


def checksum(
    data: torch.Tensor,  # [N] uint8, contiguous, any byte offset
    piece_words: int = PIECE_WORDS,
    config: tuple[int, int] | None = None,  # (BLOCK, num_warps); DEFAULT_CONFIG if None
) -> torch.Tensor:  # [] int64
    """Triton version of :func:`kernels.checksum.ref_checksum`."""
    check_tensor("data", data, ndim=1, dtypes=(torch.uint8,))
    check_devices(data=data)
    if not 1 <= piece_words <= MAX_PIECE_WORDS:
        raise ValueError(f"piece_words must be in [1, {MAX_PIECE_WORDS}], got {piece_words}")
    block, num_warps = config or DEFAULT_CONFIG
    if not 1 <= block <= MAX_BLOCK or block & (block - 1):
        raise ValueError(f"BLOCK must be a power of two up to {MAX_BLOCK}, got {block}")
    if data.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=data.device)
    num_words, tail = divmod(data.numel(), 4)
    by_bytes = data.data_ptr() % 4 != 0
    words = data if by_bytes else data[: num_words * 4].view(torch.int32)  # [num_words]
    blocks_per_piece = max(1, triton.cdiv(min(piece_words, num_words), block))
    grid = max(1, triton.cdiv(num_words, piece_words) * blocks_per_piece)
    partials = torch.empty(grid, dtype=torch.int64, device=data.device)
    _checksum_kernel[(grid,)](
        words, data, partials, num_words, num_words * 4, tail, piece_words, blocks_per_piece,
        BYTES=by_bytes, BLOCK=block, MOD=WEIGHT_MOD, TAIL_W=TAIL_WEIGHT, num_warps=num_warps,
    )  # fmt: skip
    return partials.sum()
