"""FP8 (e4m3) weight linear layers: from an fp8 checkpoint (128x128 block scales, or per-channel
or per-tensor ones) or quantized from a float layer at load time (per-channel).

Scales are kept one row per output row (blocks repeated down their rows), so stacked shards of
any size land in place and the kernels find ``W[n, k]``'s scale at ``scale[n, k // block_k]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import ops
from kernels.quant import expand_block_scales, quantize_fp8_rows
from services.engine.quantization.base import QuantLinear


class Fp8Linear(QuantLinear):
    weight: torch.Tensor  # buffers (register_buffer), which nn.Module types as Tensor | Module
    scale: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, shard_sizes: list[int], bias: bool,
        dtype: torch.dtype, weight_block: tuple[int, int] | None,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, shard_sizes, bias, dtype)
        self.weight_block = weight_block
        # per-channel: one scale column, its block the whole row
        self.block_k = weight_block[1] if weight_block else in_features
        scale_cols = -(-in_features // self.block_k)
        self.scale_piece = "weight_scale_inv" if weight_block else "weight_scale"
        self.PIECES = ("weight", self.scale_piece)
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn)
        )
        self.register_buffer("scale", torch.empty(out_features, scale_cols, dtype=torch.float32))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None) -> Fp8Linear:
        """Quantize a loaded float layer, one scale per output row (``--quantization fp8``).
        ``group``: the tensor-parallel group of a row-parallel layer, whose ranks each hold
        part of every row; the rows' magnitudes are then agreed over it, so that each rank
        gets the scales one rank would have (and N ranks the model of one)."""
        n, k = linear.weight.shape
        with torch.device(linear.weight.device):
            layer = cls(k, n, [n], linear.bias is not None, linear.weight.dtype, None)
        amax = None
        if group is not None:
            amax = group.all_reduce_max(linear.weight.data.float().abs().amax(dim=1, keepdim=True))
        weight, scale = quantize_fp8_rows(linear.weight.data, amax)
        layer.weight.copy_(weight)
        layer.scale.copy_(scale)
        if linear.bias is not None and layer.bias is not None:
            layer.bias.copy_(linear.bias.data)
        return layer

    def load_piece(self, piece: str, tensor: torch.Tensor, shard: int | None) -> bool:
        start, size = self.rows(shard)
        if piece == "weight":
            self.weight[start : start + size].copy_(tensor)
        elif piece == self.scale_piece and self.weight_block is not None:  # [ceil(n/bn), KB]
            self.scale[start : start + size].copy_(
                expand_block_scales(tensor, size, self.weight_block[0])
            )
        elif piece == self.scale_piece:  # per channel [n, 1] or [n], or per tensor [] or [1]
            self.scale[start : start + size].copy_(tensor.float().reshape(-1, 1).expand(size, 1))
        else:
            return False
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.fp8_linear(x, self.weight, self.scale, self.block_k, bias)
