"""The tensor-parallel parity bench on the CPU (Gloo): its GPU run is what docs/benchmarks.md
reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.engine.bench import parity_report, tp_parity
from services.engine.bench.parity_check import Continuation


def test_prompts_are_seeded_and_spread_from_four_tokens_to_the_longest() -> None:
    got = tp_parity.prompts(5, 1000, seed=3, longest=100)
    assert [len(p) for p in got] == [4, 28, 52, 76, 100]
    assert got == tp_parity.prompts(5, 1000, seed=3, longest=100)
    assert got != tp_parity.prompts(5, 1000, seed=4, longest=100)
    assert all(256 <= t < 1000 for p in got for t in p)


def test_first_step_diff_reads_the_tokens_both_sides_rank() -> None:
    a = [Continuation([1], [{1: -0.5, 2: -1.0, 3: -2.0}])]
    b = [Continuation([1], [{1: -0.25, 2: -1.5, 4: -0.1}])]
    assert tp_parity.first_step_diff(a, b) == 0.5  # token 2; 3 and 4 are on one side only


def test_two_ranks_equal_one_in_float32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 new tokens, not the bench's 32: the embedded model's decode steps (30 layers, each
    # all-reduced over Gloo) are most of the test's time, and equality does not need 32
    monkeypatch.setattr(parity_report, "NEW_TOKENS", 8)
    out = tmp_path / "tp.json"
    argv = ["--model", "embedded", "--load-format", "auto", "--dtype", "float32",
            "--device", "cpu", "--sizes", "2", "--prompts", "2", "--chat-prompts",
            "--json-out", str(out)]  # fmt: skip
    assert tp_parity.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["new_tokens"] == 8
    run = doc["runs"]["2"]
    assert run["vs_tp1"]["of"] == 2
    assert run["near_ties"]["close"] == 2  # equal to the end, or parting at a near-tie
    assert run["first_step_max_logprob_diff"] < 1e-3
