"""What one rate's result says: CPU per token, SLO attainment, saturation, token timing."""

from __future__ import annotations

import os

import pytest

from deploy.bench.plan import Workload
from deploy.bench.rate import cpu_per_token, meets_p90_slo, slo_attainment, token_timing_warning
from deploy.procfs import cpu_seconds
from tests.deploy.conftest import disagg_args


def test_cpu_per_token_and_the_saturation_checks() -> None:
    used = cpu_per_token({"gateway": 1.0, "gone": 2.0}, {"gateway": 1.5, "gone": None}, 100)
    assert used == {"cpu_s": {"gateway": 0.5}, "cpu_s_per_output_token": {"gateway": 0.005}}
    assert cpu_seconds(os.getpid()) is not None
    row = {"completed": 10, "request_throughput": 2.0, "goodput": 0.1, "p90_ttft_ms": 900.0,
           "p90_tpot_ms": 41.0, "median_ttft_ms": 100.0, "median_itl_ms": 20.0}  # fmt: skip
    args = disagg_args()
    assert slo_attainment(row) == pytest.approx(0.05)
    assert not meets_p90_slo(row, args)
    assert meets_p90_slo({**row, "p90_tpot_ms": 40.0}, args)
    assert token_timing_warning(row, Workload(16, 4)) is None
    assert "no text per token" in str(
        token_timing_warning({**row, "median_ttft_ms": 0.0}, Workload(16, 4))
    )
