"""kernels/cpu_blocks.py: a float32 weight that is exactly block-quantized (as a GGUF's Q4_1 and
Q8_0 layers are once converted) is found, packed losslessly and multiplied by the C kernel to
the dense product within float32 rounding; anything else stays dense."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_blocks
from services.engine.models.llama import Linear


def q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight as llama.cpp's Q4_1 quantizer leaves it once dequantized: per 32 values a
    float16 scale (span / 15) and offset (the minimum), codes 0-15, value q * d + m."""
    x = torch.randn(n * k // 32, 32, generator=gen) * 0.05
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    d32 = (hi - lo) / 15
    q = torch.round((x - lo) / torch.where(d32 > 0, d32, 1.0)).clamp(0, 15)
    d, m = d32.half().float(), lo.half().float()
    return (q * d + m).reshape(n, k)


def q8_0(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """llama.cpp's Q8_0: per 32 values a float16 scale (largest magnitude / 127), codes
    -127..127, value q * d."""
    x = torch.randn(n * k // 32, 32, generator=gen)
    d32 = x.abs().amax(1, keepdim=True) / 127
    q = torch.round(x / d32).clamp(-127, 127)
    return (q * d32.half().float()).reshape(n, k)


MAKERS = {cpu_blocks.Q4: q4_1, cpu_blocks.Q8: q8_0}


@pytest.mark.parametrize("fmt", [cpu_blocks.Q4, cpu_blocks.Q8])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 64), (80, 576), (272, 1536)])
def test_found_and_rebuilt_bit_for_bit(fmt: int, n: int, k: int) -> None:
    w = MAKERS[fmt](n, k, torch.Generator().manual_seed(n + k))
    bw = cpu_blocks.find_blocks(w)
    assert bw is not None and bw.fmt == fmt
    assert (bw.out_features, bw.in_features) == (n, k)
    assert torch.equal(cpu_blocks.ref_dequantize(bw), w)
    per_value = 0.75 if fmt == cpu_blocks.Q4 else 1.125  # codes, then float32 scale (+ offset)
    assert bw.nbytes == n * k * per_value


def test_constant_and_zero_blocks() -> None:
    w = q4_1(16, 128, torch.Generator().manual_seed(1))
    w[3, 32:64] = 0.25  # one value throughout a block: scale 0
    w[5, :32] = 0.0
    bw = cpu_blocks.find_blocks(w)
    assert bw is not None and torch.equal(cpu_blocks.ref_dequantize(bw), w)


def test_anything_else_stays_dense() -> None:
    gen = torch.Generator().manual_seed(2)
    assert cpu_blocks.find_blocks(torch.randn(64, 64, generator=gen)) is None  # float weights
    w = q4_1(64, 64, gen)
    off = w.clone()
    off[40, 17] = torch.nextafter(off[40, 17], torch.tensor(1.0))  # one value one ulp off
    assert cpu_blocks.find_blocks(off) is None
    nan = w.clone()
    nan[63, 63] = float("nan")
    assert cpu_blocks.find_blocks(nan) is None
    assert cpu_blocks.find_blocks(q4_1(24, 64, gen)) is None  # rows not a multiple of 16
    assert cpu_blocks.find_blocks(w[:, :48].contiguous()) is None  # inputs not of 32
    assert cpu_blocks.find_blocks(w.half()) is None
    assert cpu_blocks.find_blocks(w.reshape(-1)) is None


needs_kernel = pytest.mark.skipif(
    cpu_blocks.library() is None,
    reason="the block kernel needs a C compiler and AVX-512 or AVX2",
)


@needs_kernel
@pytest.mark.parametrize("fmt", [cpu_blocks.Q4, cpu_blocks.Q8])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 96), (80, 576), (272, 64)])
def test_kernel_matches_the_dense_product(fmt: int, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + n + fmt)
    w = MAKERS[fmt](n, k, gen)
    bw = cpu_blocks.find_blocks(w)
    assert bw is not None
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        out = cpu_blocks.linear(x, bw, b)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        # float32 sums in another order: a few ulps of a sum of k products
        scale = (x.abs() @ w.abs().t()).clamp(min=1.0)
        ref = torch.nn.functional.linear(x, w, b)
        assert bool(((out - ref).abs() <= 1e-6 * scale * k**0.5).all())


@needs_kernel
def test_a_row_does_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    bw = cpu_blocks.find_blocks(q4_1(208, 576, gen))
    assert bw is not None
    x = torch.randn(29, 576, generator=gen)
    whole = cpu_blocks.linear(x, bw)
    for r in (0, 5, 6, 28):
        assert torch.equal(cpu_blocks.linear(x[r : r + 1], bw), whole[r : r + 1])
    assert torch.equal(cpu_blocks.linear(x[3:17], bw), whole[3:17])


@pytest.mark.skipif(
    cpu_blocks.library() is None or cpu_blocks.library().tq_block_isa() != 512,  # type: ignore[union-attr]
    reason="compares the AVX2 build with the AVX-512 one: needs a CPU with AVX-512",
)
@pytest.mark.parametrize("fmt", [cpu_blocks.Q4, cpu_blocks.Q8])
def test_the_avx2_build_gives_the_avx512_builds_bits(fmt: int) -> None:
    """Both builds round each product and each sum of an output in the same order, so a
    machine with AVX2 only serves the very numbers an AVX-512 one does."""
    avx2 = cpu_blocks.build(("-mno-avx512f",))
    assert avx2 is not None and avx2.tq_block_isa() == 256
    avx512 = cpu_blocks.library()
    assert avx512 is not None
    gen = torch.Generator().manual_seed(40 + fmt)
    for rows, n, k in [(1, 208, 576), (7, 48, 96), (16, 272, 64), (33, 80, 1536)]:
        bw = cpu_blocks.find_blocks(MAKERS[fmt](n, k, gen))
        assert bw is not None
        x = torch.randn(rows, k, generator=gen)
        assert torch.equal(cpu_blocks.run(avx2, x, bw), cpu_blocks.run(avx512, x, bw))


@needs_kernel
def test_strided_and_batched_inputs() -> None:
    gen = torch.Generator().manual_seed(6)
    w = q8_0(32, 64, gen)
    bw = cpu_blocks.find_blocks(w)
    assert bw is not None
    for x in (torch.randn(5, 128, generator=gen)[:, ::2], torch.randn(64, 5).t(),
              torch.randn(2, 3, 64, generator=gen)):  # fmt: skip
        torch.testing.assert_close(cpu_blocks.linear(x, bw), x @ w.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        cpu_blocks.linear(torch.randn(2, 64).double(), bw)
    with pytest.raises(ValueError, match="64"):
        cpu_blocks.linear(torch.randn(2, 32), bw)


class _Model(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = Linear(32, 48, bias=True)
        self.dense = Linear(48, 32, bias=False)
        self.head = Linear(32, 64, bias=False)
        self.keep = Linear(32, 32, bias=False)
        self.keep.keep_dense_weight = True
        with torch.no_grad():
            self.embed.weight.copy_(q8_0(64, 32, gen))
            self.up.weight.copy_(q4_1(48, 32, gen))
            self.dense.weight.copy_(torch.randn(32, 48, generator=gen))
            self.keep.weight.copy_(q4_1(32, 32, gen))
        self.head.weight = self.embed.weight  # tied, as the embedded model's lm_head


@needs_kernel
def test_pack_blocks_swaps_only_exact_plain_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Model(torch.Generator().manual_seed(7))
    x = torch.randn(3, 32)
    before = [model.head(x), model.dense(model.up(x)), model.keep(x)]
    assert cpu_blocks.pack_blocks(model, (Linear,)) == 2
    assert isinstance(model.up, cpu_blocks.BlockLinear) and model.up.fmt == cpu_blocks.Q4
    assert isinstance(model.head, cpu_blocks.BlockLinear) and model.head.fmt == cpu_blocks.Q8
    assert type(model.dense) is Linear and type(model.keep) is Linear  # float; read densely
    assert model.embed.weight.shape == (64, 32)  # the tied embedding keeps its table
    after = [model.head(x), model.dense(model.up(x)), model.keep(x)]
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(cpu_blocks.ENV, "0")
    assert cpu_blocks.pack_blocks(_Model(torch.Generator().manual_seed(7)), (Linear,)) == 0
