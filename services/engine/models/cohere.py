"""Cohere (Command-R) in plain PyTorch over a paged KV cache: attention and the MLP side by side,
both from one bias-free LayerNorm of the stream, their outputs added to it together; logits
times ``logit_scale``. Its rotary pairs dims (0, 1), (2, 3), ...: the loader reorders q and k
rows into halves (``ArchConfig.rotary_interleaved``), and, with ``use_qk_norm``, the per-head
q/k LayerNorm weights alike."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.attention_metadata import AttentionMetadata
from services.engine.model_config import ArchConfig
from services.engine.models.layer_norm import HeadLayerNorm, LayerNorm
from services.engine.models.llama import MLP, Attention, LlamaForCausalLM


class CohereDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        if cfg.qk_norm:  # each head normed with its own weight
            eps = cfg.rms_norm_eps  # layer_norm_eps, read into it
            self.self_attn.q_norm = HeadLayerNorm(cfg.num_heads, cfg.head_dim, eps)  # type: ignore[assignment]
            self.self_attn.k_norm = HeadLayerNorm(cfg.num_kv_heads, cfg.head_dim, eps)  # type: ignore[assignment]
        self.mlp = MLP(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=False)
        self.rope_table = 0  # the model's one rotary table

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]; the stream is x + residual
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn(h, positions, cos_sin, kv_cache, meta)
        # (stream + attn) + mlp, summed in transformers' order by the next norm
        return self.mlp(h), residual + attn


class CohereForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.model.layers = nn.ModuleList(CohereDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=False)  # type: ignore[assignment]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, V] fp32
        # in the model's dtype, as transformers scales them
        return (self.lm_head(hidden) * self.cfg.logit_scale).float()
