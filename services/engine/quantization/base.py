"""What every quantized linear layer shares: where each stacked shard's outputs go, which
checkpoint tensors have arrived, and the optional bias."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.config import ConfigError


class QuantLinear(nn.Module):
    """A linear layer whose weight arrives as checkpoint tensors in a quantized format.

    The loader hands each tensor to :meth:`load` with its name's last piece (``qweight``,
    ``scales``, ...) and the stacked shard it belongs to (q/k/v of ``qkv_proj``, gate/up of
    ``gate_up_proj``; None for an unstacked layer); :meth:`finish_loading` then checks that
    every piece of every shard came and converts to the serving layout.
    """

    bias: torch.Tensor | None
    PIECES: tuple[str, ...] = ()  # the checkpoint tensors each shard needs, besides the bias

    def __init__(
        self, in_features: int, out_features: int, shard_sizes: list[int], bias: bool,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.shard_sizes = shard_sizes  # output rows of each stacked shard, in order
        self.dtype = dtype
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=dtype))
        else:
            self.bias = None
        self.received: set[tuple[str, int]] = set()
        # a row-parallel layer of a tensor-parallel rank: its partial products are summed over
        # the ranks (the group's all_reduce) before the bias, which is added once
        self.group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.group is None:
            return self.matmul(x, self.bias)
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel rank's part of the product (no bias)."""
        return self.matmul(x, None)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' sum of their ``partial`` products, then the bias (added once)."""
        y = self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` in this layer's format."""
        raise NotImplementedError

    def rows(self, shard: int | None) -> tuple[int, int]:
        """(first output row, row count) of a shard in the fused layer."""
        index = shard or 0
        return sum(self.shard_sizes[:index]), self.shard_sizes[index]

    def load(self, piece: str, tensor: torch.Tensor, shard: int | None) -> None:
        if piece == "bias" and self.bias is not None:
            start, size = self.rows(shard)
            self.bias[start : start + size].copy_(tensor)
        elif piece == "bias" and not tensor.any():
            pass  # some exporters write zero biases for layers without one
        elif not self.load_piece(piece, tensor, shard):
            raise ConfigError(f"unexpected tensor {piece!r} for a {type(self).__name__}")
        self.received.add((piece, shard or 0))

    def load_piece(self, piece: str, tensor: torch.Tensor, shard: int | None) -> bool:
        """Store one quantized tensor; False if ``piece`` is not one of this format's."""
        raise NotImplementedError

    def finish_loading(self, name: str) -> None:
        """Raise ``ConfigError`` naming what the checkpoint lacks; subclasses then convert."""
        wanted = [*self.PIECES, *(("bias",) if self.bias is not None else ())]
        missing = [
            f"{name}.{piece}#{shard}"
            for shard in range(len(self.shard_sizes))
            for piece in wanted
            if (piece, shard) not in self.received
        ]
        if missing:
            raise ConfigError(f"quantized weights missing from the checkpoint: {missing[:5]}")
