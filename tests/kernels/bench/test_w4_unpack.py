"""The mantissa-trick int4 GEMV of ``kernels.bench.w4_unpack`` computes what the serving GEMV computes
(under the interpreter on the CPU; the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench.w4_unpack import trick_gemv
from kernels.quant import ref_w4a16_linear
from kernels.triton_quant import w4a16_linear
from tests.kernels.paged import assert_matches, rand
from tests.kernels.test_triton_quant import int4_weight


@pytest.mark.parametrize(
    ("m", "n", "k", "g"), [(1, 64, 256, 128), (2, 40, 512, 128), (1, 24, 64, 32)]
)
def test_the_mantissa_trick_gemv_equals_the_reference_and_the_served_gemv(
    m: int, n: int, k: int, g: int, gen: torch.Generator, device: torch.device
) -> None:
    qweight, scales, zeros = int4_weight(k, n, g, torch.bfloat16, gen, device)
    x = rand((m, k), torch.bfloat16, gen, device)
    ref = ref_w4a16_linear(x, qweight, scales, zeros, g)
    trick = trick_gemv(x, qweight, scales, zeros, g)
    assert trick.shape == (m, n) and trick.dtype == torch.bfloat16
    assert_matches(trick / k**0.5, ref / k**0.5)
    assert_matches(trick / k**0.5, w4a16_linear(x, qweight, scales, zeros, g) / k**0.5)


def test_a_shape_is_timed_checked_and_reported(
    monkeypatch: pytest.MonkeyPatch, capsys, device: torch.device
) -> None:
    """The benchmark's own path on the CPU under the interpreter, with a call counted as 1 us:
    both kernels and every launch pass the reference check and land in the row."""
    from kernels.bench import gemv_graph, w4_unpack

    calls: list[object] = []

    def one_us(fn):  # runs the launches once, as the graph capture would
        calls.append(fn())
        return 1.0

    monkeypatch.setattr(gemv_graph, "REPS", 2)
    monkeypatch.setattr(gemv_graph, "graph_us", one_us)
    launches = [((16, 128, 2, 0), False), ((32, 128, 4, 1), True)]
    monkeypatch.setattr(w4_unpack, "LAUNCHES", launches)
    row = w4_unpack.time_shape("tiny", 48, 256, 1000.0, device=str(device))
    assert row["bytes"] == 256 * 48 // 2 + 2 * 2 * 48 * 2
    assert (row["convert_us"], row["trick_us"]) == (1.0, 1.0)
    assert set(row["launches_us"]) == {"(16, 128, 2, 0)", "(32, 128, 4, 1) prefetch"}
    assert len(calls) == 4 and "tiny" in capsys.readouterr().out
