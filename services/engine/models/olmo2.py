"""OLMo 2, OLMo 3 and EXAONE 4 in plain PyTorch over a paged KV cache: the Llama layers with
the norms moved after each branch.

- No norm before attention or the MLP: each takes the residual stream itself, and its output
  is normed (``post_attention_layernorm``, ``post_feedforward_layernorm``) before it joins the
  stream. With this engine's fused residual (a layer hands on ``(x, residual)``, the stream
  being their sum), a layer first adds the two.
- q and k are RMSNormed over the whole projection, every head at once
  (``ArchConfig.qk_norm_whole``, in the shared attention).
- OLMo 3's sliding layers attend through their window (``ArchConfig.window``); where their
  rotary frequencies differ from the full layers' (which take the rope scaling), they rotate
  by their own table (``cos_sin_local``: default frequencies at ``local_rope_theta``).
- EXAONE 4 norms q and k per head (Qwen3's); with a window, its global layers take no rotary
  embedding (``ArchConfig.nope_layers``: the base model's table of cos 1, sin 0).
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.attention_metadata import AttentionMetadata
from services.engine.model_config import ArchConfig
from services.engine.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from services.engine.rope import cos_sin_cache


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        local = cfg.local_rope_theta and layer in cfg.sliding_layers
        self.rope_table = 1 if local or layer in cfg.nope_layers else 0  # in rope_tables()

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]; the stream is x + residual
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else residual + x
        attn = self.self_attn(stream, positions, cos_sin, kv_cache, meta)
        stream = stream + self.post_attention_layernorm(attn)[0]
        return self.post_feedforward_layernorm(self.mlp(stream))[0], stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.model.layers = nn.ModuleList(Olmo2DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.cos_sin_local: torch.Tensor | None = None  # OLMo 3's sliding layers' table

    def fill_rope(self, max_positions: int, device: torch.device) -> None:
        super().fill_rope(max_positions, device)  # the full layers' (their rope scaling)
        if self.cfg.local_rope_theta:
            local = cos_sin_cache(self.cfg.rotary_dim, max_positions, self.cfg.local_rope_theta)
            self.cos_sin_local = local.to(device)

    def trim_rope(self, positions: int) -> None:
        super().trim_rope(positions)
        if self.cos_sin_local is not None:
            self.cos_sin_local = self.cos_sin_local[:positions].clone()

    def rope_tables(self) -> tuple[torch.Tensor, ...]:
        if self.cos_sin_local is not None:  # (no family has both it and NoPE layers)
            return (self.cos_sin, self.cos_sin_local)
        return super().rope_tables()
