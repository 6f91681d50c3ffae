"""The kernel benchmark: a clear refusal without a GPU; byte and FLOP counts that match the math."""

from __future__ import annotations

import argparse

import pytest
import torch

from kernels.bench import roofline
from kernels.bench.cases import prefill_flops


def test_without_a_gpu_it_says_so_and_fails(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out_file = tmp_path / "k.json"
    code = roofline.main(argparse.Namespace(json_out=str(out_file), check=False))
    assert code != 0
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out_file.exists()


def test_prefill_flops_count_only_causal_pairs() -> None:
    # 4 queries alone: 1 + 2 + 3 + 4 = 10 pairs; 2 queries after a 3-token prefix: 4 + 5 = 9
    per_pair = 4 * 128 * 32
    assert prefill_flops([4], [4]) == 10 * per_pair
    assert prefill_flops([5], [2]) == 9 * per_pair
