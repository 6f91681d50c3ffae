"""The architecture facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.config import ConfigError

SUPPORTED = {
    "llama": "Llama 2/3, SmolLM",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization_config: dict[str, Any] = field(default_factory=dict)  # HF's, as written

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED:
            known = ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
            raise ConfigError(f"model_type {model_type!r} is not supported; supported: {known}")
        heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            quantization_config=dict(cfg.get("quantization_config") or {}),
        )

    @classmethod
    def from_file(cls, path: Path) -> ArchConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
