"""The earlier forms of the int4 GEMV in ``kernels.bench.w4_unpack`` compute what the serving
GEMV computes (under the interpreter on the CPU; the timing itself needs a GPU)."""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.bench.w4_unpack import convert_gemv, single_w4a16_linear, trick_gemv
from kernels.quant import ref_w4a16_linear
from kernels.triton_quant import w4a16_linear
from tests.kernels.paged import assert_matches, rand
from tests.kernels.test_triton_quant import int4_weight

FORMS = {
    "trick": trick_gemv,
    "convert": convert_gemv,
    # split K in three: the partial sums of the second kernel
    "convert-split": functools.partial(convert_gemv, config=(16, 64, 2, 3)),
    "single": single_w4a16_linear,
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(
    ("m", "n", "k", "g", "dtype"),
    [
        (1, 64, 256, 128, torch.bfloat16),
        (2, 40, 512, 128, torch.bfloat16),  # a partial tile of N, two rows
        (1, 24, 64, 32, torch.float32),
    ],
)
def test_each_form_equals_the_reference_and_the_served_gemv(
    form: str, m: int, n: int, k: int, g: int, dtype: torch.dtype, gen: torch.Generator,
    device: torch.device,
) -> None:  # fmt: skip
    qweight, scales, zeros = int4_weight(k, n, g, dtype, gen, device)
    x = rand((m, k), dtype, gen, device)
    ref = ref_w4a16_linear(x, qweight, scales, zeros, g)
    out = FORMS[form](x, qweight, scales, zeros, g)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_matches(out / k**0.5, ref / k**0.5)
    assert_matches(out / k**0.5, w4a16_linear(x, qweight, scales, zeros, g) / k**0.5)


@pytest.mark.parametrize("m", [1, 2, 5])
def test_the_planes_made_one_a_shift_equal_the_reference(
    m: int, gen: torch.Generator, device: torch.device
) -> None:
    """The GEMV as served before plane pairs (1-2 rows; 5 rows go to the served GEMM): K in
    four groups of 128, a partial tile of N."""
    k, n, g = 512, 136, 128
    qweight, scales, zeros = int4_weight(k, n, g, torch.bfloat16, gen, device)
    x = rand((m, k), torch.bfloat16, gen, device)
    out = single_w4a16_linear(x, qweight, scales, zeros, g)
    assert out.shape == (m, n)
    assert_matches(out / k**0.5, ref_w4a16_linear(x, qweight, scales, zeros, g) / k**0.5)


def test_a_shape_is_timed_checked_and_reported(
    graph_calls: list[object], monkeypatch: pytest.MonkeyPatch, capsys, device: torch.device
) -> None:
    """The benchmark's own path on the CPU under the interpreter, with a call counted as 1 us:
    every form at every launch passes the reference check and lands in the row."""
    from kernels.bench import w4_unpack

    calls = graph_calls
    monkeypatch.setattr(w4_unpack, "LAUNCHES", [(16, 128, 2, 0), (16, 256, 4, 1)])
    monkeypatch.setattr(w4_unpack, "UNPACKED_LAUNCHES", [(16, 32, 64, 2, 0)])
    monkeypatch.setattr(w4_unpack, "PLANES_LAUNCHES", [(16, 16, 128, 4, 1), (16, 64, 128, 4, 0)])
    row = w4_unpack.time_shape("tiny", 48, 256, 1000.0, device=str(device))
    assert row["bytes"] == 256 * 48 // 2 + 2 * 2 * 48 * 2
    assert set(row["launches_us"]["served"]) == {"default", "(16, 128, 2, 0)", "(16, 256, 4, 1)"}
    assert set(row["best"]) == {"convert", "trick", "served", "single"}
    assert len(calls) == 6
    row = w4_unpack.time_shape("tiny", 48, 256, 1000.0, device=str(device), rows=2)
    assert row["rows"] == 2
    assert set(row["best"]) == {
        "convert",
        "trick",
        "served",
        "single",
        "gemm",
        "unpacked",
        "planes",
    }
    assert len(calls) == 16 and "tiny" in capsys.readouterr().out
    row = w4_unpack.time_shape("tiny", 48, 256, 1000.0, device=str(device), rows=3)
    # past the GEMV's rows: the served GEMM, and its tiles of each form
    assert row["launches_us"] == {
        "served": {"default": 1.0},
        "unpacked": {"(16, 32, 64, 2, 0)": 1.0},
        "planes": {"(16, 16, 128, 4, 1)": 1.0, "(16, 64, 128, 4, 0)": 1.0},
    }
    assert len(calls) == 20
