"""The LoRA manager on a tiny model: wrapped projections add exactly each row's adapter
update, slots are reused least-recently-used first, and adapters outnumber slots."""

from __future__ import annotations

from pathlib import Path

import torch

from services.config import LoRAConfig
from services.engine.lora.manager import LoRAManager
from services.engine.model_config import ArchConfig
from services.engine.models.llama import LlamaForCausalLM
from tests.services.engine.lora.test_adapter import PREFIX

ARCH = ArchConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6,
                  rope_theta=10000.0)  # fmt: skip


def adapter(path: Path, seed: int) -> Path:
    """Rank 2 on layer 1's k_proj (shard 1 of qkv_proj, 8 rows) and up_proj (shard 1)."""
    from tests.services.engine.lora.test_adapter import write

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for module, kind, n in (("k_proj", "self_attn", 8), ("up_proj", "mlp", 24)):
        weights[f"{PREFIX}.1.{kind}.{module}.lora_A.weight"] = torch.randn(2, 16, generator=gen)
        weights[f"{PREFIX}.1.{kind}.{module}.lora_B.weight"] = torch.randn(n, 2, generator=gen)
    return write(path, r=2, config={"lora_alpha": 2, "target_modules": ["k_proj", "up_proj"]},
                 weights=weights)  # fmt: skip


def manager(tmp_path: Path, slots: int) -> LoRAManager:
    model = LlamaForCausalLM(ARCH, 16)
    paths = {name: str(adapter(tmp_path / name, seed)) for seed, name in enumerate("abc")}
    config = LoRAConfig(modules=tuple(paths.items()), max_loras=slots, max_lora_rank=4)
    return LoRAManager(model, config, torch.float32, torch.device("cpu"))


def test_each_row_gets_its_own_adapters_update_on_the_shard_it_targets(tmp_path: Path) -> None:
    m = manager(tmp_path, slots=2)
    qkv = m.layers[(1, "qkv_proj")]
    x = torch.randn(5, 16)
    m.batch.segments = None
    base = qkv(x)  # [5, 16 + 8 + 8]
    m.begin_step([("b", 2), ("", 1), ("a", 2)])
    out = qkv(x)
    assert torch.equal(out[2], base[2]), "the base model's row changed"
    for rows, name in ((slice(0, 2), "b"), (slice(3, 5), "a")):
        a, b = m.adapters[name].weights[(1, "k_proj")]
        delta = out[rows] - base[rows]
        torch.testing.assert_close(delta[:, 16:24], x[rows] @ a.T @ b.T)
        assert torch.equal(delta[:, :16], torch.zeros(2, 16)), "q rows changed"
        assert torch.equal(delta[:, 24:], torch.zeros(2, 8)), "v rows changed"
    assert m.layers[(0, "qkv_proj")].lora_a.abs().sum() == 0, "layer 0 has no adapter weights"


def test_slots_are_reused_least_recently_used_first(tmp_path: Path) -> None:
    m = manager(tmp_path, slots=2)
    m.begin_step([("a", 1)])
    m.begin_step([("b", 1)])
    m.begin_step([("a", 1)])  # b is now the least recently used
    m.begin_step([("c", 1)])
    assert sorted(n for n in m.slots if n) == ["a", "c"]
    m.begin_step([("c", 3), ("c", 2), ("", 1)])  # one adapter's neighbouring rows: one segment
    assert m.batch.segments is not None
    rows, starts, lens, _, longest = m.batch.segments
    assert rows.tolist() == [0, 1, 2, 3, 4] and starts.tolist() == [0] and lens.tolist() == [5]
    assert longest == 5
    m.remove("c")
    assert "c" not in m.slots and m.names() == ["a", "b"]
