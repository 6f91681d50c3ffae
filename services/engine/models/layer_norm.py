"""LayerNorm with this engine's fused-residual interface (``norm(x, residual)`` returns the
normed sum and the sum, as ``RMSNorm``): StarCoder2's (with a bias) and Cohere's (without),
and Cohere's q/k norm of each head with its own weight. Computed in fp32 and rounded once to
x's dtype, as torch's ``nn.LayerNorm`` and transformers' ``CohereLayerNorm`` do."""

from __future__ import annotations

import torch
from torch import nn


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        residual: torch.Tensor | None = None,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:  # the sum rounded to x's dtype, as transformers adds it
            x = (x.float() + residual.float()).to(x.dtype)
        bias = None if self.bias is None else self.bias.float()
        y = nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), bias, self.eps)
        return y.to(x.dtype), x


class HeadLayerNorm(nn.Module):
    """A bias-free LayerNorm over each head's dims with the head's own weight ([H, D]: Cohere's
    ``use_qk_norm``); takes the heads' rows [T H, D] as the attention hands them."""

    def __init__(self, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T H, D]
        heads = x.float().view(-1, *self.weight.shape)  # [T, H, D]
        y = nn.functional.layer_norm(heads, heads.shape[-1:], None, None, self.eps)
        return (y * self.weight.float()).to(x.dtype).view(x.shape), x
