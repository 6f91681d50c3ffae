"""The KV-transfer checksum's torch reference: a position-sensitive sum of a byte buffer's words.

The bytes are read as little-endian int32 words (sign-extended to int64), plus a tail of 0-3
bytes that do not make a word. The value, all in wrapping int64 arithmetic::

    sum_j word[j] * (j % P % 65521 + 1) * (j // P + 1)  +  sum_t tail[t] * (t + 1_000_003)

where P is ``piece_words`` (4M words: the reference's temporaries are one piece of int64). Every
step is a ring operation modulo 2**64 (integer multiply and add wrap the same way on any device,
in any order), so :mod:`kernels.triton_checksum`'s tree reduction gives the same bits and a CPU
sender and a GPU receiver agree.
"""

from __future__ import annotations

import torch

PIECE_WORDS = 1 << 22  # int32 words per piece: bounds the reference's int64 temporaries
WEIGHT_MOD = 65521  # the word weights repeat with this period inside a piece
TAIL_WEIGHT = 1_000_003  # the first tail byte's weight

_weights: dict[tuple[torch.device, int], torch.Tensor] = {}


def _piece_weights(device: torch.device, piece_words: int) -> torch.Tensor:  # [P] int64
    weights = _weights.get((device, piece_words))
    if weights is None:
        weights = torch.arange(piece_words, device=device) % WEIGHT_MOD + 1
        _weights[(device, piece_words)] = weights
    return weights


def _words(data: torch.Tensor, start: int, stop: int) -> torch.Tensor:  # [stop - start] int64
    """Words [start, stop) of ``data``; a slice not 4-byte aligned is copied to read them."""
    raw = data[start * 4 : stop * 4]
    if raw.data_ptr() % 4:
        raw = raw.clone()
    return raw.view(torch.int32).to(torch.int64)


def ref_checksum(data: torch.Tensor, piece_words: int = PIECE_WORDS) -> torch.Tensor:
    """The checksum of a 1-D uint8 tensor as a 0-d int64 tensor on its device (computed on the
    current stream, nothing waits for it)."""
    if data.dim() != 1 or data.dtype != torch.uint8:
        raise ValueError(f"data must be a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    if piece_words < 1:
        raise ValueError(f"piece_words must be >= 1, got {piece_words}")
    dev = data.device
    weights = _piece_weights(dev, piece_words)
    num_words = data.numel() // 4
    tail = data[num_words * 4 :].to(torch.int64)  # [0-3]
    total = (tail * (torch.arange(tail.numel(), device=dev) + TAIL_WEIGHT)).sum()
    for i, start in enumerate(range(0, num_words, piece_words)):
        piece = _words(data, start, min(start + piece_words, num_words))  # [<= P]
        total = total + (piece * weights[: piece.numel()]).sum() * (i + 1)
    return total
