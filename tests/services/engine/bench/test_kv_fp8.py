"""The FP8 KV-cache bench on the CPU, one prompt (its GPU run is what docs/benchmarks.md reports)."""

from __future__ import annotations

import json
from pathlib import Path

from services.engine.bench import kv_fp8


def test_one_prompt_on_the_cpu_compares_the_two_caches(tmp_path: Path) -> None:
    out = tmp_path / "kv_fp8.json"
    assert kv_fp8.main(["--device", "cpu", "--limit", "1", "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["prompts"] == 1 and doc["blocks"] == {} and doc["blocks_ratio"] is None
    ties = doc["quality"]["near_ties"]
    assert ties["of"] == 1 and ties["close"] + ties["equal_to_end"] >= 1
    assert doc["quality"]["vs_bf16_cache"]["of"] == 1
