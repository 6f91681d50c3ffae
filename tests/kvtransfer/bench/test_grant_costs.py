"""The grant-cost benchmark's command line (it measures on a GPU only)."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.bench import grant_costs


def test_it_refuses_too_few_iterations_and_says_it_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        grant_costs.main(["--iters", "1"])
    assert exc.value.code == 2 and "--iters must be at least 2" in capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("on a GPU it measures")
    with pytest.raises(SystemExit, match="needs a GPU"):
        grant_costs.main([])
