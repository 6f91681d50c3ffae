"""The polling-cost bench runs and reports a row per pause (its figures are a benchmark's)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtransfer.bench import poll_cost


def test_a_row_per_pause(tmp_path: Path) -> None:
    out = tmp_path / "poll.json"
    assert (
        poll_cost.main(["--steps", "20", "--pauses", "1e-3", "2e-3", "--json-out", str(out)]) == 0
    )
    doc = json.loads(out.read_text())
    assert doc["steps"] == 20 and doc["alone_step_us"] > 0
    assert [r["pause_us"] for r in doc["rows"]] == [1000.0, 2000.0]
    assert all(r["step_us"] > 0 and r["slowdown"] > 0 for r in doc["rows"])
