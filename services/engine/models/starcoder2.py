"""StarCoder2 in plain PyTorch over a paged KV cache: the Llama layers (biased q/k/v/o, every
layer through the window where one is configured) with LayerNorms that carry a bias and an MLP
of two biased projections around a GELU (tanh), not a gated one."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.model_config import ArchConfig
from services.engine.models.layer_norm import LayerNorm
from services.engine.models.llama import DecoderLayer, Linear, LlamaForCausalLM


class GeluMLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        h = nn.functional.gelu(self.c_fc(x), approximate="tanh")  # [T, I]
        return self.c_proj(h)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        size, eps = cfg.hidden_size, cfg.rms_norm_eps  # norm_epsilon, read into it
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.input_layernorm = LayerNorm(size, eps, bias=True)  # type: ignore[assignment]
            layer.post_attention_layernorm = LayerNorm(size, eps, bias=True)  # type: ignore[assignment]
            layer.mlp = GeluMLP(cfg)  # type: ignore[assignment]
        self.model.norm = LayerNorm(size, eps, bias=True)  # type: ignore[assignment]
