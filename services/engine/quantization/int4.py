"""4-bit weight-only linear layers (w4a16) loaded from AWQ, GPTQ or compressed-tensors
(pack-quantized) checkpoints.

Each shard is converted into the serving layout of ``kernels.quant`` as it arrives (qweight
packed along K, zeros unpacked), in the checkpoint's row order; an act-order GPTQ (or
compressed-tensors actorder "group") layer's rows are then sorted by group once, and x's
columns are permuted to match at every call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import ops
from kernels.quant import AWQ_ORDER, pack_rows, unpack_cols, unpack_rows
from services.config import ConfigError
from services.engine.quantization.base import QuantLinear
from services.engine.quantization.config import int4_pieces


def group_order(g_idx: torch.Tensor, k: int, groups: int) -> torch.Tensor:
    """An act-order projection's input features sorted by group (stable): [K] int64. ValueError
    unless ``g_idx`` gives each of the ``groups`` groups ``K / groups`` of the ``k`` features
    (what the kernels' whole groups need). The dense layer's rows and the MoE experts'
    columns (``quantization.experts.pack_expert``) are sorted by it."""
    if g_idx.shape != (k,) or groups < 1 or k % groups:
        raise ValueError(f"g_idx {tuple(g_idx.shape)} does not fit {k} inputs in {groups} groups")
    counts = torch.zeros(groups, dtype=torch.int64, device=g_idx.device)
    inside = (g_idx >= 0) & (g_idx < groups)
    counts.scatter_add_(0, g_idx.clamp(0, groups - 1), inside.long())
    if not bool(inside.all()) or bool((counts != k // groups).any()):
        raise ValueError(f"g_idx does not give every one of {groups} groups {k // groups} inputs")
    return torch.argsort(g_idx, stable=True)


class Int4Linear(QuantLinear):
    qweight: torch.Tensor  # buffers (register_buffer), which nn.Module types as Tensor | Module
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None

    def __init__(
        self, in_features: int, out_features: int, shard_sizes: list[int], bias: bool,
        dtype: torch.dtype, method: str, group_size: int, desc_act: bool = False,
        zero_points: bool = True, channel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, shard_sizes, bias, dtype)
        k, n, g = in_features, out_features, group_size
        if k % g or any(size % 8 for size in shard_sizes):
            raise ConfigError(
                f"{method} group_size {g} does not divide a layer's {k} input features (or an "
                f"output shard of {shard_sizes} is not a multiple of 8)"
            )
        self.method, self.group_size = method, group_size
        # compressed-tensors: no zero points when symmetric (8); per-channel scales ([n, 1])
        # repeated over this layer's groups of group_size
        self.zero_points, self.channel = zero_points, channel
        # act-order needs each shard's g_idx; without it a GPTQ g_idx is optional (trivial)
        self.PIECES = int4_pieces(method, zero_points, desc_act)
        self.register_buffer("qweight", torch.empty(k // 8, n, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(k // g, n, dtype=dtype))
        self.register_buffer("zeros", torch.empty(k // g, n, dtype=dtype))
        self.register_buffer("perm", None)  # [K] int64: act-order input order, see finish_loading
        self.g_idx: list[torch.Tensor | None] = [None] * len(shard_sizes)

    def load_piece(self, piece: str, tensor: torch.Tensor, shard: int | None) -> bool:
        start, size = self.rows(shard)
        cols = slice(start, start + size)
        awq = self.method == "awq"
        tensor = tensor.to(self.qweight.device)  # repacked where the layer lives (the GPU)
        if self.method == "compressed-tensors":
            return self._load_compressed(piece, tensor, shard, cols)
        if piece == "qweight":  # AWQ [K, n/8] by columns; GPTQ [K/8, n], already our layout
            packed = pack_rows(unpack_cols(tensor, AWQ_ORDER)) if awq else tensor
            self.qweight[:, cols].copy_(packed)
        elif piece == "qzeros":  # [K/G, n/8]; GPTQ (v1) stores each zero point minus one
            zeros = unpack_cols(tensor, AWQ_ORDER) if awq else unpack_cols(tensor) + 1
            self.zeros[:, cols].copy_(zeros)
        elif piece == "scales":
            self.scales[:, cols].copy_(tensor)
        elif piece == "g_idx" and not awq:
            self.g_idx[shard or 0] = tensor.to(torch.int64).cpu()
        else:
            return False
        return True

    def _load_compressed(
        self, piece: str, tensor: torch.Tensor, shard: int | None, cols: slice
    ) -> bool:
        """compressed-tensors pack-quantized: ``weight_packed`` [n, K/8] holds eight K values
        a word in order (nibble j of word c: column 8c + j), each the signed value plus 8, so
        its transpose is our qweight and the zero point of a symmetric layer 8;
        ``weight_scale`` [n, K/G] (per channel: [n, 1]); ``weight_zero_point`` [n/8, K/G]
        packed eight output rows a word in order, plus 8; ``weight_shape`` the unpacked
        [n, K], which the packed words' shape already gives."""
        groups = self.in_features // self.group_size
        if piece == "weight_packed":
            self.qweight[:, cols].copy_(tensor.T)
        elif piece == "weight_scale":
            scale = tensor.T  # [K/G, n]
            self.scales[:, cols].copy_(scale.expand(groups, -1) if self.channel else scale)
        elif piece == "weight_zero_point":  # a symmetric layer's (all 8), if written: unused
            if self.zero_points:
                zeros = unpack_cols(tensor.T.contiguous())  # [K/G, n]
                self.zeros[:, cols].copy_(zeros.expand(groups, -1) if self.channel else zeros)
        elif piece == "weight_g_idx":
            self.g_idx[shard or 0] = tensor.to(torch.int64).cpu()
        elif piece != "weight_shape":
            return False
        return True

    def finish_loading(self, name: str) -> None:
        super().finish_loading(name)
        if not self.zero_points:
            self.zeros.fill_(8)  # symmetric: the packed values are the signed ones plus 8
        given = [g for g in self.g_idx if g is not None]
        if not given:
            return
        if len(given) != len(self.g_idx) or any(not torch.equal(g, given[0]) for g in given):
            raise ConfigError(f"{name}: the stacked shards' g_idx differ (or some lack one)")
        g_idx = given[0]
        if torch.equal(g_idx, torch.arange(self.in_features) // self.group_size):
            return  # groups already contiguous: nothing to permute
        try:
            perm = group_order(g_idx, self.in_features, self.in_features // self.group_size)
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from None
        q = unpack_rows(self.qweight)  # [K, N]
        self.qweight.copy_(pack_rows(q[perm.to(q.device)]))
        self.perm = perm.to(self.qweight.device)

    def fill_dummy(self, gen: torch.Generator) -> None:
        """Random weights of realistic scale for ``--load-format dummy``: W in about +-0.02."""
        bits = torch.randint(-(2**31), 2**31 - 1, tuple(self.qweight.shape), generator=gen)
        self.qweight.copy_(bits.to(torch.int32))
        self.zeros.fill_(8)
        self.scales.fill_(0.0025)
        if self.bias is not None:
            self.bias.zero_()
        self.received = {
            (p, s) for p in ("bias", *self.PIECES) for s in range(len(self.shard_sizes))
        }

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x[:, self.perm]
        return ops.w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, bias)

    def fused_act(
        self, act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor | None:
        """SiLU-and-mul of this gate_up layer's output in its GEMV's epilogue where the GEMV
        runs (``ops.linear_act``); None elsewhere (a row-parallel layer sums its ranks'
        products before any activation)."""
        if act is not ops.silu_and_mul or self.group is not None or x.dim() != 2:
            return None
        if x.shape[0] != 1:  # the fused GEMV's rows (ops.w4_silu_and_mul_linear): no permute
            return None
        if self.perm is not None:
            x = x[:, self.perm]
        return ops.w4_silu_and_mul_linear(
            x, self.qweight, self.scales, self.zeros, self.group_size, self.bias
        )
