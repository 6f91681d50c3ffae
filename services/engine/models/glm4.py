"""GLM-4 (GLM-4-0414) in plain PyTorch over a paged KV cache: the Llama layers with a norm after
attention (``post_self_attn_layernorm``) and one after the MLP (``post_mlp_layernorm``), four a
layer. The norms before attention and the MLP take the fused residual as Llama's do; the
norms after them, none (their output joins the stream).

What it shares with the first GLM (glm-4-9b-hf, the plain Llama model) is read into
``ArchConfig``: biased q/k/v, half of each head rotating with its dims paired (0, 1), (2, 3),
... (the loader reorders q and k rows into halves: ``ArchConfig.rotary_interleaved``), gate
and up stored as one ``gate_up_proj`` (our layout, loaded as it is).
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.attention_metadata import AttentionMetadata
from services.engine.model_config import ArchConfig
from services.engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm


class Glm4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]; the stream is x + residual
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(x, positions, cos_sin, kv_cache, meta))[0]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x))[0], residual


class Glm4ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.model.layers = nn.ModuleList(Glm4DecoderLayer(cfg, i) for i in range(cfg.num_layers))
