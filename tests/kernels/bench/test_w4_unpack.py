"""The int4 GEMV baseline of ``kernels.bench.w4_unpack`` computes what the serving GEMV computes
(under the interpreter on the CPU; the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench.w4_unpack import convert_gemv
from kernels.quant import ref_w4a16_linear
from kernels.triton_quant import w4a16_linear
from tests.kernels.paged import assert_matches, rand
from tests.kernels.test_triton_quant import int4_weight


@pytest.mark.parametrize(
    ("m", "n", "k", "g"), [(1, 64, 256, 128), (2, 40, 512, 128), (1, 24, 64, 32)]
)
def test_the_converting_baseline_equals_the_reference_and_the_served_gemv(
    m: int, n: int, k: int, g: int, gen: torch.Generator, device: torch.device
) -> None:
    qweight, scales, zeros = int4_weight(k, n, g, torch.bfloat16, gen, device)
    x = rand((m, k), torch.bfloat16, gen, device)
    ref = ref_w4a16_linear(x, qweight, scales, zeros, g)
    baseline = convert_gemv(x, qweight, scales, zeros, g)
    assert baseline.shape == (m, n) and baseline.dtype == torch.bfloat16
    assert_matches(baseline / k**0.5, ref / k**0.5)
    assert_matches(baseline / k**0.5, w4a16_linear(x, qweight, scales, zeros, g) / k**0.5)
