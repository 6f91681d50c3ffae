"""Reading a peft adapter directory: the scaling folded into B (alpha / r, rsLoRA alpha /
sqrt(r)), and every adapter that cannot be served exactly refused at load with the reason."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from protos.errors import ConfigError
from services.engine.lora.adapter import read_adapter

K, N = 12, 10  # every projection of the fake base model: 12 in, 10 out, layers 0 and 1
PREFIX = "base_model.model.model.layers"


def shape_of(layer: int, module: str) -> tuple[int, int] | None:
    return (K, N) if layer < 2 else None


def write(
    path: Path, r: int = 4, config: dict[str, Any] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj"],
           "bias": "none", "modules_to_save": None, "use_dora": False, **(config or {})}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    if weights is None:
        gen = torch.Generator().manual_seed(0)
        weights = {
            f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(r, K, generator=gen),
            f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(N, r, generator=gen),
        }
    save_file(weights, str(path / "adapter_model.safetensors"))
    return path


def test_the_scaling_is_folded_into_b(tmp_path: Path) -> None:
    for rslora, scaling in ((False, 8 / 4), (True, 8 / math.sqrt(4))):
        path = write(tmp_path / str(rslora), config={"use_rslora": rslora})
        adapter = read_adapter("a", str(path), 16, shape_of)
        a, b = adapter.weights[(0, "q_proj")]
        raw = {k.split(".lora_")[1][0]: v for k, v in _load(path).items()}
        assert torch.equal(a, raw["A"]) and torch.allclose(b, raw["B"] * scaling)
        assert adapter.rank == 4 and list(adapter.weights) == [(0, "q_proj")]


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


BAD = {  # what -> (write's keyword arguments, the refusal)
    "rank above the max": ({"r": 32}, "rank 32 exceeds --max-lora-rank 16"),
    "lm_head target": ({"config": {"target_modules": ["q_proj", "lm_head"]}},
                       "target module\\(s\\) lm_head are not supported"),
    "DoRA": ({"config": {"use_dora": True}}, "DoRA"),
    "modules_to_save": ({"config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
    "bias": ({"config": {"bias": "all"}}, "bias 'all'"),
    "lora_bias": ({"config": {"lora_bias": True}, "weights": {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, K),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(N, 4),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.bias": torch.zeros(N)}},
        "lora_bias \\(a trained bias beside lora_B\\) is not supported"),
    "rank pattern above the max": ({"config": {"rank_pattern": {"q_proj": 32}}, "weights": {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(32, K),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(N, 32)}},
        "layer 0 q_proj: rank 32 \\(rank_pattern\\) exceeds --max-lora-rank 16"),
    "rank pattern not an integer": ({"config": {"rank_pattern": {"q_proj": 2.5}}},
                                    "rank_pattern\\['q_proj'\\] must be a positive integer"),
    "alpha pattern not a number": ({"config": {"alpha_pattern": {"q_proj": "x"}}},
                                   "alpha_pattern\\['q_proj'\\] must be a number"),
    "a pattern that is no regex": ({"config": {"rank_pattern": {"q_proj(": 2}}},
                                   "rank_pattern key 'q_proj\\(' is not a valid pattern"),
    "not LoRA": ({"config": {"peft_type": "IA3"}}, "peft_type 'IA3' is not LORA"),
    "embedding weights": ({"weights": {"base_model.model.model.embed_tokens.lora_embedding_A":
                                       torch.zeros(4, 7)}}, "not a LoRA weight of a served"),
    "another model's shapes": ({"weights": {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, K + 1),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(N, 4)}},
        "do not fit the base model"),
    "a layer the model lacks": ({"weights": {
        f"{PREFIX}.7.mlp.down_proj.lora_A.weight": torch.zeros(4, K),
        f"{PREFIX}.7.mlp.down_proj.lora_B.weight": torch.zeros(N, 4)}}, "layer 7 down_proj"),
    "integer weights": ({"weights": {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.ones(4, K, dtype=torch.int8),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.ones(N, 4, dtype=torch.int8)}},
        "layer 0 q_proj: lora_A is torch.int8, not a floating-point dtype"),
    "half a pair": ({"weights": {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, K)}},
                    "lora_A and lora_B must both be present"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_what_cannot_be_served_is_refused_with_the_reason(case: str, tmp_path: Path) -> None:
    kwargs, message = BAD[case]
    path = write(tmp_path / "ad", **kwargs)
    with pytest.raises(ConfigError, match=f"LoRA adapter 'ad': .*{message}"):
        read_adapter("ad", str(path), 16, shape_of)


def test_a_directory_that_is_no_adapter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a peft adapter directory"):
        read_adapter("x", str(tmp_path), 16, shape_of)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no adapter_model"):
        read_adapter("x", str(tmp_path), 16, shape_of)


def test_targets_named_by_their_full_module_paths_are_served(tmp_path: Path) -> None:
    """peft's "all-linear" saves target_modules as full paths
    ("model.layers.0.self_attn.q_proj"); vLLM matches their last name, and so must we."""
    targets = [f"model.layers.{i}.{m}" for i in (0, 1)
               for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]  # fmt: skip
    path = write(tmp_path / "ad", config={"target_modules": targets})
    assert list(read_adapter("ad", str(path), 16, shape_of).weights) == [(0, "q_proj")]
    path = write(tmp_path / "bad", config={"target_modules": [*targets, "model.embed_tokens"]})
    with pytest.raises(ConfigError, match=r"target module\(s\) model.embed_tokens are not"):
        read_adapter("bad", str(path), 16, shape_of)


def test_rank_and_alpha_patterns_set_each_modules_rank_and_scaling(tmp_path: Path) -> None:
    """peft's rank_pattern / alpha_pattern: a module's value is the first key matching the end
    of its name (after a dot); the others keep r and lora_alpha. Scaling alpha / r per module."""
    gen = torch.Generator().manual_seed(1)
    ranks = {(0, "self_attn.q_proj"): 4, (0, "self_attn.v_proj"): 2, (1, "self_attn.v_proj"): 3,
             (1, "mlp.down_proj"): 4}  # fmt: skip
    weights = {}
    for (layer, module), r in ranks.items():
        weights[f"{PREFIX}.{layer}.{module}.lora_A.weight"] = torch.randn(r, K, generator=gen)
        weights[f"{PREFIX}.{layer}.{module}.lora_B.weight"] = torch.randn(N, r, generator=gen)
    config = {"r": 4, "lora_alpha": 8, "rank_pattern": {"1.self_attn.v_proj": 3, "v_proj": 2},
              "alpha_pattern": {"down_proj": 2, "layers.0.self_attn.q_proj": 12}}  # fmt: skip
    for rslora in (False, True):
        path = write(tmp_path / str(rslora), config={**config, "use_rslora": rslora},
                     weights=weights)  # fmt: skip
        adapter = read_adapter("p", str(path), 16, shape_of)
        alphas = {(0, "q_proj"): 12, (0, "v_proj"): 8, (1, "v_proj"): 8, (1, "down_proj"): 2}
        for (layer, module), r in ranks.items():
            short = (layer, module.split(".")[1])
            a, b = adapter.weights[short]
            scaling = alphas[short] / (math.sqrt(r) if rslora else r)
            assert a.shape[0] == r, short
            assert torch.allclose(b, weights[f"{PREFIX}.{layer}.{module}.lora_B.weight"] * scaling)
        assert adapter.rank == 4
