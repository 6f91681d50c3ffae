"""The streaming-cost bench on a tiny batch: a real worker server in front of the fake engine
streams every token to the gateway's client, and the report says how fast its steps went."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.worker.bench import stream_cost

pytestmark = pytest.mark.timeout(120)


def test_a_tiny_run_streams_every_token_and_reports_a_positive_rate(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    argv = ["--requests", "4", "--max-tokens", "3", "--gpu-ms", "1", "--host-ms", "0.5",
            "--switch-interval-ms", "20", "--json-out", str(out)]  # fmt: skip
    assert stream_cost.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["streamed_tokens"] == 4 * 3 and doc["steps"] >= 3
    assert doc["steps_per_s"] > 0 and doc["ideal_steps_per_s"] == round(1000 / 1.5, 2)
    assert doc["worker_cpu_us_per_token"] > 0 and doc["loop_thread_cpu_us_per_token"] > 0
    assert doc["switch_interval_ms"] == 20


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--switch-interval-ms", "-1"]])
def test_bad_values_are_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        stream_cost.main(argv)
    assert exc.value.code == 2
