"""Gemma 3 (text), Gemma 2 and the first Gemma in plain PyTorch over a paged KV cache: the Llama
layers with Gemma's differences (``services.engine.model_config.GemmaConfig``; the first Gemma
keeps Llama's two norms a layer).

- RMSNorms apply their weight as ``1 + weight``, multiplied in fp32 before the one rounding
  (``ops.gemma_rms_norm``); Gemma 3 norms q and k per head like Qwen3's, Gemma 2 soft-caps
  the attention scores (in the attention kernels) and the final logits instead.
- Four norms a layer: after attention, and before and after the MLP. With this engine's fused
  residual (a layer hands on ``(x, residual)``, the stream being their sum), the post-norms
  take no residual and the pre-norms add it, as in the Llama layer.
- A GELU (tanh) MLP, token embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model
  dtype, as transformers does), the softmax scale ``query_pre_attn_scalar ** -0.5``.
- Sliding layers (5 of every 6 by default) attend through their window with their own rotary
  table (``cos_sin_local``: default frequencies at the local base; ``rope_table`` 1); the global
  layers use ``cos_sin`` (the global base, with its rope scaling).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from services.engine.attention_metadata import AttentionMetadata
from services.engine.model_config import ArchConfig
from services.engine.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from services.engine.rope import cos_sin_cache


class GemmaRMSNorm(RMSNorm):
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.gemma_rms_norm(x, self.weight, self.eps, residual)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        assert cfg.gemma is not None
        self.self_attn = Attention(cfg, layer)
        if cfg.qk_norm:  # Gemma 3
            self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.scale = cfg.gemma.query_scale
        self.self_attn.softcap = cfg.gemma.attn_softcap
        self.mlp = MLP(cfg)
        self.mlp.act_fn = ops.gelu_tanh_and_mul
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)  # the first Gemma's pre-MLP one
        self.sandwich = cfg.gemma.sandwich_norms
        if self.sandwich:  # Gemma 2 and 3
            self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.rope_table = 1 if layer in cfg.sliding_layers else 0  # the local table (rope_tables)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta)
        if not self.sandwich:  # the first Gemma: Llama's two norms
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x = self.post_attention_layernorm(x)[0]
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x))[0], residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    cos_sin_local: torch.Tensor  # the sliding layers' rotary table (a buffer)

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        assert cfg.gemma is not None
        self.model.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_scale = cfg.gemma.embed_scale
        self.final_softcap = cfg.gemma.final_softcap
        self.local_rope_theta = cfg.gemma.local_rope_theta
        table = torch.empty(max_positions, cfg.head_dim, dtype=torch.float32)
        self.register_buffer("cos_sin_local", table, persistent=False)

    def fill_rope(self, max_positions: int, device: torch.device) -> None:
        super().fill_rope(max_positions, device)  # the global layers' (their rope scaling)
        local = cos_sin_cache(self.cfg.head_dim, max_positions, self.local_rope_theta)
        self.cos_sin_local = local.to(device)  # default frequencies at the local base

    def trim_rope(self, positions: int) -> None:
        super().trim_rope(positions)
        self.cos_sin_local = self.cos_sin_local[:positions].clone()

    def rope_tables(self) -> tuple[torch.Tensor, ...]:
        return (self.cos_sin, self.cos_sin_local)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, V] fp32
        logits = self.lm_head(hidden)
        if self.final_softcap:  # Gemma 2: in the model's dtype, as transformers caps them
            cap = self.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        x = self.model.embed_tokens(input_ids)
        # as transformers: the scale rounded to the model dtype first (a host value: no sync)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype).item()
