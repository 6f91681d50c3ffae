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
    # 128 outputs (the widest swept tile 32): several column tiles of every launch, half the
    # programs of 256; K of two groups keeps chunks that span groups
    case = quant.build(m, 128, 256, device)
    for cfg in quant._configs(fmt, m):
        assert quant.check(fmt, case, cfg) < 1e-2


def test_the_int4_rows_bench_checks_and_times_every_path(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """Its own path (the CPU under the interpreter, the GPU compiled), each call timed as 1 ms."""
    from kernels.bench import roofline

    timed: list[object] = []
    monkeypatch.setattr(roofline, "median_ms", lambda fn: (timed.append(fn()), 1.0)[1])
    r = quant.bench_w4_rows("tiny", 256, 256, 20, 1000.0, device=str(device))
    labels = ["bf16", *quant.W4_GEMM_TILES, "dequant+matmul", "dequant"]
    assert [f"{label}_ms" for label in labels] == [key for key in r if key.endswith("_ms")]
    assert len(timed) == len(labels)
    moved = 256 * 256 // 2 + 2 * 2 * 256 * 2 + 256 * 256 * 2
    assert r["dequant_pct_of_copy"] == pytest.approx(100 * moved / 1e6 / 1000.0)
