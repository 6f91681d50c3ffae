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


def test_a_known_gpu_takes_the_ceilings_measured_on_it_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def measured() -> float:
        raise AssertionError("a known GPU is not measured again")

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(roofline, "copy_bandwidth", measured)
    roofline.device_ceilings.cache_clear()
    try:
        c = roofline.device_ceilings()
    finally:
        roofline.device_ceilings.cache_clear()
    assert (c.copy_bytes_per_s, c.bf16_flops_per_s, c.measured_now) == (4.3e12, 788e12, False)
    h100 = roofline.KNOWN_CEILINGS["NVIDIA H100 80GB HBM3"]
    assert h100 == (3.0e12, 780e12)  # targets.md's ceilings: W1's and W2's published floors


def test_an_unknown_gpu_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda: 1500.0)  # GB/s
    monkeypatch.setattr(roofline, "matmul_flops", lambda: 3.0e14)
    roofline.device_ceilings.cache_clear()
    try:
        c = roofline.device_ceilings()
    finally:
        roofline.device_ceilings.cache_clear()
    assert (c.device, c.copy_bytes_per_s, c.bf16_flops_per_s) == ("Some GPU", 1.5e12, 3.0e14)
    assert c.measured_now
