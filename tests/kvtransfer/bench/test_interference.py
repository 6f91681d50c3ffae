"""The two-GPU interference bench on a machine without two GPUs, and its summary."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.bench.interference import _summary, main


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="runs the bench on two GPUs")
def test_without_two_gpus_it_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json-out", "unused.json"]) == 2
    assert capsys.readouterr().out.strip() == "needs 2 GPUs"


def test_summary_of_step_times() -> None:
    got = _summary([4.0] * 8 + [5.0, 9.0])
    assert got["p50_ms"] == 4.0 and got["p90_ms"] > 5.0 and got["mean_ms"] == pytest.approx(4.6)
