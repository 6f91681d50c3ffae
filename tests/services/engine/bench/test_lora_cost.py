"""The LoRA-cost bench on the CPU on a tiny model (its GPU run is what docs/benchmarks.md reports):
the adapters it writes are ones the engine serves, and they change the output."""

from __future__ import annotations

import json
from pathlib import Path

from protos.sampling_params import SamplingParams
from services.config import LoRAConfig, ModelConfig
from services.engine.bench import lora_cost
from services.engine.llm import LLM
from services.engine.loader import read_arch
from tests.services.engine.conftest import tiny_checkpoint

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96}  # fmt: skip


def test_a_tiny_run_reports_both_throughputs(tmp_path: Path) -> None:
    model = str(tiny_checkpoint(tmp_path / "tiny", "llama", **TINY))
    out = tmp_path / "lora.json"
    argv = ["--model", model, "--load-format", "auto", "--dtype", "float32", "--device", "cpu",
            "--adapters", "2", "--rank", "4", "--batch", "4", "--input-len", "8",
            "--output-len", "3", "--json-out", str(out)]  # fmt: skip
    assert lora_cost.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["base_tok_s"] > 0 and doc["lora_tok_s"] > 0 and doc["adapters"] == 2
    # both throughputs are rounded to 0.1 tok/s and the cost to 1e-4: allow what that moves
    base, lora = doc["base_tok_s"], doc["lora_tok_s"]
    rounding = 0.05 / base + 0.05 * (lora + 0.05) / base / (base - 0.05) + 1e-4
    assert abs(doc["cost"] - (1 - lora / base)) <= rounding
    # the CPU captures no graphs: every step of the measured batch ran eagerly, with adapters
    assert doc["lora_graphs"] is False and doc["lora_forwards"]["graph"] == 0
    assert doc["lora_forwards"]["eager_lora"] == doc["lora_forwards"]["eager"] > 0
    assert doc["base_forwards"]["eager_lora"] == 0
    assert doc["lora_fused"] == {"fused": 8, "projections": 8}, "2 layers x 4 plain projections"


def test_the_written_adapter_is_served_and_changes_the_output(tmp_path: Path) -> None:
    model = str(tiny_checkpoint(tmp_path / "tiny", "llama", **TINY))
    _, arch = read_arch(ModelConfig(model=model))
    adapter = lora_cost.write_adapter(tmp_path / "a", arch, rank=4, seed=0)
    lora = LoRAConfig(modules=(("a", str(adapter)),), max_loras=1, max_lora_rank=4)
    prompt = list(range(100, 116))
    with LLM(model, dtype="float32", lora_config=lora) as llm:
        base, tuned = (llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                           ignore_eos=True, lora_name=name))
                       for name in ("", "a"))  # fmt: skip
    assert base[0].outputs[0].token_ids != tuned[0].outputs[0].token_ids
