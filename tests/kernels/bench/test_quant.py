"""The quantized-layer benchmark: a clear refusal without a GPU, byte counts that match the
formats, and every launch it sweeps valid (checked against the reference on the CPU here)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench import quant


def test_without_a_gpu_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        quant.main([])


def test_bytes_are_the_formats_sizes(device: torch.device) -> None:
    case = quant.build(1, 256, 512, device)
    io = 512 * 2 + 256 * 2  # x read, out written (bf16)
    assert case.bytes("bf16") == io + 256 * 512 * 2
    assert case.bytes("int4") == io + 256 * 512 // 2 + 2 * (512 // 128) * 256 * 2
    assert case.bytes("fp8") == io + 256 * 512 + 256 * (512 // 128) * 4
    assert case.bytes("fp8-row") == io + 256 * 512 + 256 * 4


@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp8-row"])
@pytest.mark.parametrize("m", [1, 17])
def test_every_swept_launch_matches_the_reference(fmt: str, m: int, device: torch.device) -> None:
    case = quant.build(m, 256, 256, device)
    for cfg in quant._configs(fmt, m):
        assert quant.check(fmt, case, cfg) < 1e-2
