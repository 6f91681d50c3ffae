"""The Llama layers with an MLP of two projections around an activation, not a gated one, in
plain PyTorch over a paged KV cache: StarCoder2's (biased ``c_fc`` and ``c_proj`` around a GELU
(tanh), with LayerNorms that carry a bias; biased q/k/v/o, every layer through the window
where one is configured) and Arcee's (``up_proj`` and ``down_proj``, loaded as ``c_fc`` and
``c_proj``, around ReLU squared)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.engine.model_config import ArchConfig
from services.engine.models.layer_norm import LayerNorm
from services.engine.models.llama import DecoderLayer, Linear, LlamaForCausalLM


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(nn.functional.relu(x))


class UngatedMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.c_proj(self.act(self.c_fc(x)))  # through [T, I]


class Starcoder2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        size, eps = cfg.hidden_size, cfg.rms_norm_eps  # norm_epsilon, read into it
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.input_layernorm = LayerNorm(size, eps, bias=True)  # type: ignore[assignment]
            layer.post_attention_layernorm = LayerNorm(size, eps, bias=True)  # type: ignore[assignment]
            layer.mlp = UngatedMLP(cfg, gelu_tanh)  # type: ignore[assignment]
        self.model.norm = LayerNorm(size, eps, bias=True)  # type: ignore[assignment]


class ArceeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        for layer in self.model.layers:
            layer.mlp = UngatedMLP(cfg, relu_squared)  # type: ignore[assignment]
