"""A peft LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``),
read and checked against the served model: what cannot be served exactly is refused, with a
message that says what, never silently dropped.

Served: plain LoRA (``r``, ``lora_alpha``, ``use_rslora``, and per-module ``rank_pattern`` /
``alpha_pattern`` as peft applies them) on the decoder's q/k/v/o and gate/up/down projections.
Refused: a rank above ``--max-lora-rank``, other target modules (embeddings, lm_head, MoE
experts), DoRA, ``modules_to_save``, trained biases, and weights whose shapes do not fit the
base model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protos.errors import ConfigError
from services.config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter_dir
from services.engine.lora.layers import PEFT_MODULES

_PREFIX = "base_model.model."  # peft's weight names: this, the module's name, .lora_A.weight
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights on the CPU: (layer, peft module) -> (A [r, in], B [out, r]) with
    the scaling (alpha / r, or alpha / sqrt(r) under rsLoRA) folded into B."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _refuse(name: str, why: str) -> ConfigError:
    return ConfigError(f"LoRA adapter {name!r}: {why}")


def _read_config(name: str, root: Path) -> dict[str, Any]:
    check_adapter_dir(name, root)
    try:
        cfg = json.loads((root / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(name, f"cannot read {ADAPTER_CONFIG}: {e}") from None
    if not isinstance(cfg, dict):
        raise _refuse(name, f"{ADAPTER_CONFIG} is not a JSON object")
    return cfg


@dataclass(frozen=True)
class _Ranks:
    """An adapter's rank and alpha, with peft's per-module overrides (``rank_pattern``,
    ``alpha_pattern``: a module's pattern is the first key that matches the end of its name,
    after a dot)."""

    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def of(self, module: str) -> tuple[int, float]:
        """(rank, scaling) of the module named ``module`` (``model.layers.0.self_attn.q_proj``)."""
        r = _by_pattern(self.rank_pattern, module, self.r)
        alpha = _by_pattern(self.alpha_pattern, module, self.alpha)
        return r, alpha / math.sqrt(r) if self.rslora else alpha / r


def _by_pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _patterns(name: str, cfg: dict[str, Any], key: str, rank: bool) -> dict[str, Any]:
    """``rank_pattern`` (positive integers) or ``alpha_pattern`` (numbers), checked."""
    patterns = cfg.get(key) or {}
    if not isinstance(patterns, dict):
        raise _refuse(name, f"{key} must be a JSON object (module pattern -> value)")
    for pattern, value in patterns.items():
        ok = isinstance(value, int) and value >= 1 if rank else isinstance(value, int | float)
        if not ok or isinstance(value, bool):
            raise _refuse(name, f"{key}[{pattern!r}] must be a "
                          f"{'positive integer' if rank else 'number'}, got {value!r}")  # fmt: skip
        try:
            re.compile(pattern)
        except re.error as e:
            raise _refuse(name, f"{key} key {pattern!r} is not a valid pattern: {e}") from None
    return patterns


def _check_config(name: str, cfg: dict[str, Any], max_rank: int) -> _Ranks:
    """The ranks and alphas of a LoRA adapter we can serve; ConfigError otherwise."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise _refuse(name, "DoRA adapters (use_dora) are not supported")
    if cfg.get("modules_to_save"):
        raise _refuse(name, f"modules_to_save {cfg['modules_to_save']} is not supported: only "
                      "LoRA weights are served, not fully trained modules")  # fmt: skip
    if cfg.get("lora_bias"):
        raise _refuse(name, "lora_bias (a trained bias beside lora_B) is not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, f"bias {cfg['bias']!r} is not supported (only bias 'none')")
    if cfg.get("fan_in_fan_out"):
        raise _refuse(name, "fan_in_fan_out (Conv1D models) is not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        # peft writes "all-linear" (and a model's own module list) out as full module paths,
        # "model.layers.0.self_attn.q_proj": the projection is the path's last name
        bad = sorted({t for t in targets if str(t).rsplit(".", 1)[-1] not in PEFT_MODULES})
        if bad:
            raise _refuse(name, f"target module(s) {', '.join(bad)} are not supported (LoRA "
                          f"serves {', '.join(PEFT_MODULES)}; not embeddings or lm_head)")  # fmt: skip
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise _refuse(name, f"r must be a positive integer and lora_alpha a number, got {r!r}, "
                      f"{alpha!r}")  # fmt: skip
    if r > max_rank:
        raise _refuse(name, f"rank {r} exceeds --max-lora-rank {max_rank} (raise --max-lora-rank "
                      f"to at least {r})")  # fmt: skip
    return _Ranks(r, alpha, bool(cfg.get("use_rslora")), _patterns(name, cfg, "rank_pattern", True),
                  _patterns(name, cfg, "alpha_pattern", False))  # fmt: skip


def read_adapter(
    name: str, path: str, max_rank: int,
    shape_of: Callable[[int, str], tuple[int, int] | None],
) -> LoRAAdapter:  # fmt: skip
    """Read and check an adapter; ``shape_of(layer, peft module)``: the (in, out) features the
    base model has there, None where it has no such projection."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    ranks = _check_config(name, _read_config(name, root), max_rank)
    try:
        tensors = load_file(str(root / ADAPTER_WEIGHTS))
    except (OSError, SafetensorError) as e:  # a torn or foreign file: the adapter's fault
        raise _refuse(name, f"cannot read {ADAPTER_WEIGHTS}: {e}") from None
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}  # the module's name in the model, as peft's
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in PEFT_MODULES:
            raise _refuse(name, f"weight {key} is not a LoRA weight of a served projection "
                          f"({', '.join(PEFT_MODULES)}; not embeddings or lm_head)")  # fmt: skip
        pieces.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
        modules[int(m.group(1)), m.group(2)] = key[len(_PREFIX) : key.index(".lora_")]
    if not pieces:
        raise _refuse(name, f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(pieces.items()):
        where = f"layer {layer} {module}"
        shape = shape_of(layer, module)
        if shape is None:
            raise _refuse(name, f"{where}: the base model has no such projection")
        if set(ab) != {"A", "B"}:
            raise _refuse(name, f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        r, scaling = ranks.of(modules[layer, module])
        if r > max_rank:
            raise _refuse(name, f"{where}: rank {r} (rank_pattern) exceeds --max-lora-rank "
                          f"{max_rank} (raise --max-lora-rank to at least {r})")  # fmt: skip
        for which, t in (("lora_A", a), ("lora_B", b)):
            if not t.is_floating_point():  # quantized or integer weights: no plain LoRA
                raise _refuse(name, f"{where}: {which} is {t.dtype}, not a floating-point dtype "
                              "(float32, float16 or bfloat16 LoRA weights are served)")  # fmt: skip
        (k, n) = shape
        if tuple(a.shape) != (r, k) or tuple(b.shape) != (n, r):
            raise _refuse(name, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                          f"not fit the base model (expected {(r, k)} and {(n, r)}): an adapter "
                          "of another model?")  # fmt: skip
        weights[(layer, module)] = (a.float(), b.float() * scaling)
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name, str(root), rank, weights)
