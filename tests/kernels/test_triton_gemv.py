"""Batch-1 matrix-vector products (Triton) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import ref_gemv
from kernels.layers import ref_silu_and_mul
from kernels.triton_gemv import gemv, pick_config
from kernels.triton_layers import silu_and_mul
from tests.kernels.paged import assert_matches, rand


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 64, 128), (1, 37, 200), (3, 24, 512), (8, 5, 96), (1, 1, 1), (2, 130, 1000)],
)
@pytest.mark.parametrize("config", [None, (16, 128, 4), (4, 64, 1)])
def test_matches_the_reference(
    dtype: torch.dtype, m: int, n: int, k: int, config: tuple[int, int, int] | None,
    gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """Rows not a multiple of the block, K not a multiple of the chunk, a single element."""
    x, w = rand((m, k), dtype, gen, device), rand((n, k), dtype, gen, device)
    out = gemv(x, w, config=config)
    ref = ref_gemv(x, w)
    assert out.shape == (m, n) and out.dtype == dtype
    scale = max(1.0, k**0.5)  # sums of k products: tolerance relative to their size
    assert_matches(out / scale, ref / scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_row_computes_the_same_bits_in_any_batch(
    dtype: torch.dtype, gen: torch.Generator, device: torch.device
) -> None:
    """A speculative verify step's rows must equal the batch-1 steps they stand for, bit for
    bit: every prefix of a batch, and every row alone, gives the same rows as the whole."""
    x, w = rand((8, 1000), dtype, gen, device), rand((300, 1000), dtype, gen, device)
    config = pick_config(300, 1000)
    whole = gemv(x, w, config=config)
    for m in range(1, 8):
        assert torch.equal(gemv(x[:m], w, config=config), whole[:m])
    for i in range(8):
        assert torch.equal(gemv(x[i : i + 1], w, config=config), whole[i : i + 1])


def test_strided_rows_of_x(gen: torch.Generator, device: torch.device) -> None:
    big = rand((4, 256), torch.float32, gen, device)
    x = big[::2, :128]  # row stride 512, unit inner stride
    w = rand((32, 128), torch.float32, gen, device)
    assert_matches(gemv(x, w), ref_gemv(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [(1, 64, 128, None), (1, 37, 200, None), (3, 24, 512, (16, 128, 4)), (8, 5, 96, (4, 64, 1)),
     (2, 130, 1000, None), (1, 16, 1, None)],
)  # fmt: skip
def test_silu_gives_the_bits_of_the_two_kernels(
    dtype: torch.dtype, m: int, n: int, k: int, config: tuple[int, int, int] | None,
    gen: torch.Generator, device: torch.device,
) -> None:  # fmt: skip
    """An MLP's down projection with its SiLU-and-mul folded in: the same bits as the SiLU
    kernel then the GEMV (K not a multiple of the chunk, a batch of 8, a single feature), and
    the reference within the GEMV's tolerance. Gate values span the sigmoid's tails."""
    gate_up = rand((m, 2 * k), dtype, gen, device) * 4
    w = rand((n, k), dtype, gen, device)
    fused = gemv(gate_up, w, config=config, silu=True)
    assert fused.shape == (m, n) and fused.dtype == dtype
    assert torch.equal(fused, gemv(silu_and_mul(gate_up), w, config=config))
    scale = max(1.0, k**0.5) * 16  # inputs of ~4x the usual size: products of ~16x
    assert_matches(fused / scale, ref_gemv(ref_silu_and_mul(gate_up), w) / scale)


def test_silu_takes_strided_rows(gen: torch.Generator, device: torch.device) -> None:
    big = rand((4, 512), torch.float32, gen, device)
    gate_up = big[::2, :256]  # row stride 1024: gate in [:128], up in [128:256]
    w = rand((32, 128), torch.float32, gen, device)
    assert torch.equal(gemv(gate_up, w, silu=True), gemv(silu_and_mul(gate_up), w))


def test_errors(gen: torch.Generator, device: torch.device) -> None:
    with pytest.raises(ValueError, match="odd width 15"):
        gemv(rand((1, 15), torch.float32, gen, device), rand((8, 7), torch.float32, gen, device), silu=True)  # fmt: skip
    with pytest.raises(ValueError, match="expects 16"):
        gemv(rand((1, 30), torch.float32, gen, device), rand((8, 16), torch.float32, gen, device), silu=True)  # fmt: skip
    w = rand((8, 16), torch.float32, gen, device)
    with pytest.raises(ValueError, match="expects 16"):
        gemv(rand((1, 15), torch.float32, gen, device), w)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(rand((9, 16), torch.float32, gen, device), w)
