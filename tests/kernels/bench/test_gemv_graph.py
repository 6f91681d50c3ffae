"""The in-graph GEMV benchmark's FP8 sweep on the CPU under the interpreter (its own path: the
timing stands in)."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_quant
from kernels.bench import gemv_graph


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_the_fp8_sweep_checks_and_times_each_launch_for_its_rows(
    rows: int, graph_calls: list[object], monkeypatch: pytest.MonkeyPatch, capsys,
    device: torch.device,
) -> None:  # fmt: skip
    """Every launch is checked against the default's output before it is timed; from 2 rows
    the GEMM's launches join (at 2 the GEMV's limit lowered only while they run)."""
    served = triton_quant.GEMV_ROWS
    monkeypatch.setattr(gemv_graph, "FP8_CONFIGS", [(4, 64, 2, 1), (8, 128, 4, 2)])
    monkeypatch.setattr(gemv_graph, "FP8_GEMM_CONFIGS", [(16, 32, 64, 2, 0), (16, 64, 64, 4, 1)])
    row = gemv_graph.time_fp8_shape("tiny", 40, 128, 1000.0, rows=rows, device=str(device))
    assert served == triton_quant.GEMV_ROWS  # put back
    gemv = ["(4, 64, 2, 1)", "(8, 128, 4, 2)"] if rows <= triton_quant.GEMV_ROWS else []
    gemm = ["(16, 32, 64, 2, 0)", "(16, 64, 64, 4, 1)", str((*triton_quant.GEMM_CONFIG, 0))]
    assert list(row["all_us"]) == ["default", *gemv, *(gemm if rows > 1 else [])]
    assert row["rows"] == rows and row["floor_us"] == pytest.approx(40 * 128 / 1000.0 / 1e3)
    assert len(graph_calls) == len(row["all_us"]) and f"x{rows}" in capsys.readouterr().out


def test_rows_need_the_fp8_sweep() -> None:
    with pytest.raises(SystemExit) as exc:
        gemv_graph.main(["--rows", "2"])
    assert exc.value.code == 2
