"""FP8 (e4m3) weight linear layers: from an fp8 checkpoint (128x128 block scales, or per-channel
or per-tensor ones) or quantized from a float layer at load time (per-channel).

Scales are kept one row per output row (blocks repeated down their rows), so stacked shards of
any size land in place and the kernels find ``W[n, k]``'s scale at ``scale[n, k // block_k]``.

A W8A8 layer (per-channel scales, a batch above ``kernels.ops.FP8_GEMV_ROWS`` rows on an FP8 GPU)
quantizes its input per token. Where that input is an RMSNorm's or the SiLU-and-mul's output,
:class:`Fp8InputNorm` and :class:`Fp8SiluAndMul` (swapped in from outside the model by
``quantization.apply.fuse_fp8_inputs``) do it in the same kernel and hand the layer e4m3 values
with their scales attached (:func:`with_scales`): the input is written once, in one byte, and no
quantization kernel runs. Whether to is decided at every call from the layer that will take the
tensor, so a wrapper put around it later (LoRA, which reads the 16-bit input) turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kernels import ops
from kernels.quant import expand_block_scales, quantize_fp8_rows
from services.engine.models.llama import RMSNorm
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
        if x.dtype == torch.float8_e4m3fn:  # quantized by the layer before (module docstring)
            return ops.fp8_input_linear(x, scales_of(x), self.weight, self.scale, self.dtype, bias)
        return ops.fp8_linear(x, self.weight, self.scale, self.block_k, bias)

    def fused_act(
        self, act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor | None:
        """SiLU-and-mul of this gate_up layer's output in its GEMV's epilogue where the GEMV
        runs (``ops.linear_act``). The activation may be :class:`Fp8SiluAndMul`: at the GEMV's
        batch sizes (at most ``FP8_GEMV_ROWS`` rows) the down projection does not run W8A8,
        so that activation is the plain SiLU-and-mul there too."""
        plain = act is ops.silu_and_mul or isinstance(act, Fp8SiluAndMul)
        if not plain or self.group is not None or x.dtype != self.dtype:
            return None  # a row-parallel layer sums its ranks' products before any activation
        if x.dim() != 2 or x.shape[0] > ops.FP8_GEMV_ROWS:
            return None
        return ops.fp8_silu_and_mul_linear(x, self.weight, self.scale, self.block_k, self.bias)

    def takes_fp8(self, x: torch.Tensor) -> bool:
        """Whether this layer would quantize ``x`` per token itself (W8A8), so may be handed it
        quantized instead."""
        return x.dtype == self.dtype and ops.takes_w8a8(x, self.weight, self.scale)


def with_scales(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 activations ``q`` [T, K] carrying their per-token scales [T, 1] to the next layer."""
    q.fp8_scales = scales  # type: ignore[attr-defined]
    return q


def scales_of(q: torch.Tensor) -> torch.Tensor:
    scales = getattr(q, "fp8_scales", None)
    if scales is None:
        raise ValueError("an FP8 activation reached a linear layer without its per-token scales")
    return scales


def _taker(get: Callable[[], nn.Module | None], x: torch.Tensor) -> bool:
    layer = get()
    return isinstance(layer, Fp8Linear) and layer.takes_fp8(x)


class Fp8InputNorm(nn.Module):
    """An RMSNorm whose output only an FP8 layer reads (``layer()``: the decoder layer's
    ``qkv_proj`` or ``gate_up_proj``, looked up at each call): normalized and quantized per
    token in one kernel when that layer runs W8A8, the plain norm otherwise."""

    weight: torch.Tensor

    def __init__(self, norm: RMSNorm, layer: Callable[[], nn.Module | None]) -> None:
        super().__init__()
        self.weight = norm.weight  # the same parameter: the checkpoint's name is unchanged
        self.eps = norm.eps
        self._layer = layer  # a function, not a submodule: the model's tree stays a tree

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _taker(self._layer, x):
            q, scales, res = ops.rms_norm_fp8(x, self.weight, self.eps, residual)
            return with_scales(q, scales), res
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Fp8SiluAndMul(nn.Module):
    """The MLP's activation when its ``down_proj`` (``layer()``) is an FP8 layer: SiLU-and-mul
    and the per-token quantization in one kernel when that layer runs W8A8."""

    def __init__(self, layer: Callable[[], nn.Module | None]) -> None:
        super().__init__()
        self._layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        if x.dim() == 2 and _taker(self._layer, x[:, : x.shape[1] // 2]):
            return with_scales(*ops.silu_and_mul_fp8(x))
        return ops.silu_and_mul(x)
