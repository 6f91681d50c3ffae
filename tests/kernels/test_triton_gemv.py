"""Batch-1 matrix-vector products (Triton) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import ref_gemv
from kernels.triton_gemv import gemv, pick_config
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


@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 200), (3, 24, 512), (8, 5, 96), (2, 130, 1000)])
def test_pipelined_launches_match_the_reference(
    m: int, n: int, k: int, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:
    """The software-pipelined loop (STAGES > 1), as long rows take it: partial row blocks and
    chunks, fewer chunks than stages, groups of 1, 2 and 4 rows."""
    x, w = rand((m, k), torch.bfloat16, gen, device), rand((n, k), torch.bfloat16, gen, device)
    ref = ref_gemv(x, w)
    scale = max(1.0, k**0.5)
    for config in [(8, 64, 2, 3), (16, 256, 4, 4)]:
        assert_matches(gemv(x, w, config=config) / scale, ref / scale)


def test_long_rows_take_the_pipelined_launch() -> None:
    assert pick_config(6144, 4096) == (16, 256, 4, 4)  # more outputs than inputs: 16 a program
    assert pick_config(4096, 14336) == (8, 256, 4, 4)
    assert len(pick_config(1536, 576)) == 3  # a small model's rows: one chunk ahead


@pytest.mark.parametrize("shape", ["wide", "taller", "long", "square"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 2500), (3, 10, 4096)])
def test_the_h100_launches_match_the_reference(
    shape: str, m: int, n: int, k: int, gen: torch.Generator, device: torch.device,
    poison_empty: None,
) -> None:  # fmt: skip
    """Each of an H100's launches: K shorter than a chunk and a multiple of it, outputs not a
    multiple of the block, a group of 3 rows."""
    from kernels.triton_gemv import H100_LAUNCHES

    x, w = rand((m, k), torch.bfloat16, gen, device), rand((n, k), torch.bfloat16, gen, device)
    out = gemv(x, w, config=H100_LAUNCHES[shape])
    scale = max(1.0, k**0.5)
    assert_matches(out / scale, ref_gemv(x, w) / scale)
    assert torch.equal(gemv(x[:1], w, config=H100_LAUNCHES[shape]), out[:1])  # row-invariant


def test_an_h100_takes_its_own_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import triton_gemv

    monkeypatch.setattr(triton_gemv, "_is_h100", lambda index: index == 0)
    h100, other = torch.device("cuda", 0), torch.device("cuda", 1)
    launches = triton_gemv.H100_LAUNCHES
    assert pick_config(6144, 4096, h100) == launches["taller"]  # qkv
    assert pick_config(4096, 4096, h100) == launches["square"]  # o
    assert pick_config(28672, 4096, h100) == launches["wide"]  # gate_up
    assert pick_config(4096, 14336, h100) == launches["long"]  # down
    assert pick_config(128256, 4096, h100) == (16, 256, 4, 4)  # an LM head: pipelined
    assert pick_config(1536, 576, h100) == pick_config(1536, 576)  # short rows: as anywhere
    assert pick_config(6144, 4096, other) == pick_config(6144, 4096) == (16, 256, 4, 4)
    assert pick_config(6144, 4096, torch.device("cpu")) == (16, 256, 4, 4)
    for n, k in [(6144, 4096), (28672, 4096), (4096, 14336), (5120, 5120)]:
        bn = pick_config(n, k, h100)[0]
        assert n % bn == 0 and bn % 2 == 0  # gate_up's SiLU-and-mul takes an even BLOCK_N


def test_a_launch_is_checked(gen: torch.Generator, device: torch.device) -> None:
    x, w = rand((1, 64), torch.float32, gen, device), rand((8, 64), torch.float32, gen, device)
    for bad in [(8, 64, 2, 0), (8, 64, 2, 2, 1)]:
        with pytest.raises(ValueError, match="BLOCK_N, BLOCK_K, warps"):
            gemv(x, w, config=bad)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_row_computes_the_same_bits_in_any_batch(
    pipelined: bool, gen: torch.Generator, device: torch.device
) -> None:
    """A speculative verify step's rows must equal the batch-1 steps they stand for, bit for
    bit: every prefix of a batch, and every row alone, gives the same rows as the whole, one
    chunk ahead or pipelined (bf16; fp16 sums alike)."""
    # 131 output rows: a tail block of them; K 520: two 256-wide chunks and a tail one
    dtype = torch.bfloat16
    x, w = rand((8, 520), dtype, gen, device), rand((131, 520), dtype, gen, device)
    config = (16, 256, 4, 4) if pipelined else pick_config(131, 520)
    assert config[1] == 256
    whole = gemv(x, w, config=config)
    for m in (1, 2, 7):  # prefixes: one row, an even part of the group, all but one
        assert torch.equal(gemv(x[:m], w, config=config), whole[:m])
    for i in (3, 7):  # rows alone: one inside, the last
        assert torch.equal(gemv(x[i : i + 1], w, config=config), whole[i : i + 1])


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 48, 200, (8, 64, 2)),  # one chunk ahead, a partial chunk
        (3, 40, 512, (16, 256, 4, 3)),  # pipelined; 20 outputs: a partial block of them
        (8, 6, 96, (4, 32, 1)),  # two groups of 4 rows, 3 outputs in blocks of 2
        (2, 2, 1, None),  # one output
        (2, 12, 2500, (2, 4096, 4)),  # an H100's gate_up launch: one partial chunk a row
    ],
)
def test_silu_and_mul_is_the_two_kernels_bit_for_bit(
    m: int, n: int, k: int, config: tuple[int, ...] | None, gen: torch.Generator,
    device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """The gate_up GEMV with SiLU-and-mul in its epilogue gives what the GEMV then the
    SiLU-and-mul kernel give, bit for bit, and the reference within rounding."""
    from kernels.layers import ref_silu_and_mul
    from kernels.triton_layers import silu_and_mul

    x, w = rand((m, k), torch.bfloat16, gen, device), rand((n, k), torch.bfloat16, gen, device)
    fused = gemv(x, w, config=config, silu_and_mul=True)
    assert fused.shape == (m, n // 2)
    assert torch.equal(fused, silu_and_mul(gemv(x, w, config=config)))
    ref = ref_silu_and_mul(ref_gemv(x, w).float())
    torch.testing.assert_close(fused.float(), ref, rtol=3e-2, atol=3e-2 * max(1.0, k**0.5))
    for i in range(m):  # a row alone: its bits in any batch, as a verify step needs
        assert torch.equal(
            gemv(x[i : i + 1], w, config=config, silu_and_mul=True), fused[i : i + 1]
        )


def test_silu_and_mul_needs_gate_and_up_rows(gen: torch.Generator, device: torch.device) -> None:
    x = rand((1, 64), torch.float32, gen, device)
    with pytest.raises(ValueError, match="as many up rows"):
        gemv(x, rand((7, 64), torch.float32, gen, device), silu_and_mul=True)
    with pytest.raises(ValueError, match="BLOCK_N even"):
        gemv(x, rand((8, 64), torch.float32, gen, device), config=(3, 64, 1), silu_and_mul=True)


def test_strided_rows_of_x(gen: torch.Generator, device: torch.device) -> None:
    big = rand((4, 256), torch.float32, gen, device)
    x = big[::2, :128]  # row stride 512, unit inner stride
    w = rand((32, 128), torch.float32, gen, device)
    assert_matches(gemv(x, w), ref_gemv(x, w))


def test_errors(gen: torch.Generator, device: torch.device) -> None:
    w = rand((8, 16), torch.float32, gen, device)
    with pytest.raises(ValueError, match="expects 16"):
        gemv(rand((1, 15), torch.float32, gen, device), w)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(rand((9, 16), torch.float32, gen, device), w)
