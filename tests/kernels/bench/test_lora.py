"""The batched-LoRA benchmark: a clear refusal without a GPU, its napkin math, and its case
checked against the reference on a tiny shape."""

from __future__ import annotations

import pytest
import torch

from kernels.bench import lora


def test_without_a_gpu_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        lora.main([])


def test_bytes_count_touched_adapters_once_and_flops_both_gemms() -> None:
    case = lora.build(6, 32, 48, 16, 4, 2, torch.device("cpu"))
    assert case.lens.tolist() == [3, 3] and case.longest == 3
    per_adapter = (16 * 32 + 48 * 16) * 2  # A and B in bf16
    assert case.bytes() == 2 * per_adapter + (6 * 32 + 2 * 6 * 48) * 2
    assert case.flops() == 2 * 6 * 16 * (32 + 48)


def test_the_expand_reads_y_and_xa_once_and_writes_the_output() -> None:
    case = lora.build(6, 32, 48, 16, 4, 2, torch.device("cpu"))
    assert case.row_slots.tolist() == [0, 1, 0, 1, 0, 1]
    assert case.expand_bytes() == (2 * 48 * 16 + 6 * (2 * 48 + 16)) * 2


def test_the_benchmarked_case_matches_the_reference(device: torch.device) -> None:
    case = lora.build(21, 64, 48, 24, 4, 3, device, torch.float32)
    assert lora.check(case) < 1e-5
    assert lora.check_fused(case) < 1e-5


def test_the_three_projections_agree(device: torch.device) -> None:
    """The timed callables compute what they claim: the LoRA ones the same output, apart from
    the base GEMM's by the adapters' update."""
    case = lora.build(9, 32, 40, 16, 3, 3, device, torch.float32)
    base = torch.randn(40, 32, generator=torch.Generator().manual_seed(3)).to(device)
    got = {name: fn() for name, fn in lora.projections(case, base).items()}
    torch.testing.assert_close(got["fused_proj"], got["proj"])
    assert not torch.allclose(got["proj"], got["gemm"])
