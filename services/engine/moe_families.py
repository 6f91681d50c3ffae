"""The sparse-MLP config of the Mixture-of-Experts families added beside Qwen-MoE, Mixtral and
gpt-oss (OLMoE, Granite MoE, ERNIE 4.5 MoE), read as transformers 5 reads their config.json: the ``MoeConfig`` fields (as a
dict: ``model_config`` builds the dataclass), None for a model with no sparse layer; what the
family allows but this engine does not implement is refused (ConfigError)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.config import ConfigError

Fields = dict[str, Any]


def moe_fields(model_type: str, cfg: dict[str, Any]) -> Fields | None:
    """``MoeConfig``'s fields for one of ``MOE_FAMILY_TYPES``; None: every layer dense."""
    return _READERS[model_type](cfg)


def _olmoe(cfg: dict[str, Any]) -> Fields | None:
    """OLMoE: every layer sparse, a softmax over all experts, the top-k divided by their sum
    only with ``norm_topk_prob`` (off unless given), the weights rounded to the model's
    dtype; ``intermediate_size`` is one expert's width."""
    # num_local_experts: transformers reads it as num_experts
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 64)))
    top_k = int(cfg.get("num_experts_per_tok", 8))
    layers = tuple(range(int(cfg["num_hidden_layers"])))
    return _fields("olmoe", experts, top_k, int(cfg["intermediate_size"]), layers,
                   renormalize=bool(cfg.get("norm_topk_prob", False)))  # fmt: skip


def _granitemoe(cfg: dict[str, Any]) -> Fields | None:
    """Granite MoE: every layer sparse, the top-k of the router's logits through a softmax over
    those k (a softmax over all experts renormalized over the top k), rounded to the model's
    dtype; ``intermediate_size`` is one expert's width. ``granitemoeshared`` adds a shared
    SiLU-gated MLP of ``shared_intermediate_size`` (0: none) whose output is added, ungated."""
    model_type = str(cfg.get("model_type"))
    experts = int(cfg.get("num_local_experts", 8))
    top_k = int(cfg.get("num_experts_per_tok", 2))
    shared = int(cfg.get("shared_intermediate_size", 0)) if model_type == "granitemoeshared" else 0
    if shared < 0:
        raise ConfigError(f"{model_type}: shared_intermediate_size {shared} must be >= 0")
    layers = tuple(range(int(cfg["num_hidden_layers"])))
    return _fields(model_type, experts, top_k, int(cfg["intermediate_size"]), layers,
                   renormalize=True, shared_intermediate_size=shared, shared_gate=False)  # fmt: skip


def _ernie4_5_moe(cfg: dict[str, Any]) -> Fields | None:
    """ERNIE 4.5 MoE: the layers ``moe_layer_interval`` apart from ``moe_layer_start_index``
    to ``moe_layer_end_index`` (-1: the last) sparse, the others dense; ``moe_k`` of
    ``moe_num_experts`` chosen by softmax probability plus the learned correction bias, their
    (unbiased) probabilities divided by their sum; ``moe_num_shared_experts`` shared experts as
    one SiLU-gated MLP of that many experts' width, added ungated; the router in float32."""
    experts = int(cfg.get("moe_num_experts", cfg.get("num_experts", 64)))
    top_k = int(cfg.get("moe_k", cfg.get("num_experts_per_tok", 6)))
    size = int(cfg.get("moe_intermediate_size", 1536))
    shared = int(cfg.get("moe_num_shared_experts", 2))
    num_layers = int(cfg["num_hidden_layers"])
    start, end = int(cfg.get("moe_layer_start_index", 1)), int(cfg.get("moe_layer_end_index", -1))
    end = num_layers - 1 if end == -1 else end
    interval = int(cfg.get("moe_layer_interval", 1))
    if interval < 1 or shared < 0:
        raise ConfigError(f"ernie4_5_moe: moe_layer_interval {interval} must be >= 1 and "
                          f"moe_num_shared_experts {shared} >= 0")  # fmt: skip
    layers = tuple(i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end)
    return _fields("ernie4_5_moe", experts, top_k, size, layers, renormalize=True,
                   shared_intermediate_size=size * shared, shared_gate=False,
                   correction_bias=True, router_fp32=True)  # fmt: skip


def _fields(
    model_type: str, experts: int, top_k: int, size: int, layers: tuple[int, ...], **more: Any
) -> Fields | None:
    if experts == 0 or not layers:
        return None
    if not 1 <= top_k <= experts:
        raise ConfigError(f"{model_type}: num_experts_per_tok {top_k} of {experts} experts")
    if size < 1:
        raise ConfigError(f"{model_type}: the experts' intermediate size {size} must be >= 1")
    return {"num_experts": experts, "top_k": top_k, "intermediate_size": size, "layers": layers,
            "weights_in_model_dtype": True, **more}  # fmt: skip


_READERS: dict[str, Callable[[dict[str, Any]], Fields | None]] = {
    "olmoe": _olmoe,
    "granitemoe": _granitemoe,
    "granitemoeshared": _granitemoe,
    "ernie4_5_moe": _ernie4_5_moe,
}
MOE_FAMILY_TYPES = tuple(_READERS)
