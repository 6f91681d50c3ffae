"""The host-work bench runs a few stubbed decode steps of a real engine and reports their time."""

from __future__ import annotations

import re

import pytest

from services.engine.bench.host_step import main


@pytest.mark.parametrize("sampled", [[], ["--sampled"]])
def test_prints_a_positive_time_per_step(sampled: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["--batch", "3", "--steps", "2", "--vocab", "64", *sampled]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.search(r"batch 3 (greedy|sampled): ([0-9.]+) ms/step", line)
    assert found is not None, line
    assert found.group(1) == ("sampled" if sampled else "greedy")
    assert float(found.group(2)) > 0
