"""The fused-MoE benchmark: a clear refusal without a GPU, the napkin math of its bytes and
FLOPs, and every launch it sweeps valid (checked against the reference on the CPU here)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench import moe


def test_without_a_gpu_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        moe.main([])


def test_bytes_are_the_chosen_experts_and_flops_six_per_weight_and_pair() -> None:
    case = moe.build(1, 64, 32, 16, 4, torch.device("cpu"))
    per_expert = 3 * 64 * 32 * 2  # gate, up, down in bf16
    assert case.bytes() == 4 * per_expert + 2 * 64 * 2  # one token: top_k experts read
    assert case.flops() == 6 * 4 * 64 * 32


def test_every_swept_launch_matches_the_reference(device: torch.device) -> None:
    case = moe.build(20, 64, 48, 8, 2, device, torch.float32)
    for cfg in moe.CONFIGS:
        assert moe.check(case, cfg) < 1e-5
