"""kernels/cpu_linear.py: oneDNN's float32 linear over a weight laid out once equals sgemm's
product within float32 rounding, and pack_linears lays out only plain float32 CPU linears."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_linear, ops
from services.engine.models.llama import Linear

if not cpu_linear.enabled():
    pytest.skip("this torch build has no oneDNN", allow_module_level=True)


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 16, 33, 130])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (96, 64), (257, 129), (1000, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_dense_product(rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    packed = cpu_linear.pack(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    assert torch.equal(packed.to_dense(), w)  # the layout loses nothing
    out = ops.linear(x, packed, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # float32 sums in another order: a few ulps of a sum of k products of unit-size terms
    tol = 4e-6 * k**0.5
    torch.testing.assert_close(out, cpu_linear.ref_linear(x, packed, b), rtol=1e-5, atol=tol)


def test_strided_and_batched_inputs() -> None:
    w = torch.randn(48, 32)
    packed = cpu_linear.pack(w)
    wide = torch.randn(5, 64)
    for x in (wide[:, ::2], torch.randn(32, 5).t(), torch.randn(2, 3, 32)):
        torch.testing.assert_close(ops.linear(x, packed), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_lay_out() -> None:
    for w in (torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4), torch.randn(2, 4, 4)):
        with pytest.raises(ValueError, match="2-D float32 CPU tensor"):
            cpu_linear.pack(w)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = Linear(8, 12)
        self.plain = nn.Linear(8, 8)  # its forward is F.linear: not ours to change
        self.bf16 = Linear(8, 4).to(torch.bfloat16)
        self.read = Linear(8, 6)
        self.read.keep_dense_weight = True  # its weight is read as a tensor too
        self.head = Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_pack_linears_lays_out_our_float32_linears_only(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Tiny()
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    tokens = torch.tensor([1, 4, 9])
    hidden = torch.randn(3, 8)
    before = (model.proj(hidden), model.head(hidden + model.embed(tokens)))
    assert cpu_linear.pack_linears(model, (Linear,)) == 2  # proj and head
    assert model.proj.weight.is_mkldnn and model.head.weight.is_mkldnn
    assert not model.plain.weight.is_mkldnn and not model.bf16.weight.is_mkldnn
    assert not model.read.weight.is_mkldnn
    # the tied head has a laid-out copy; the embedding still looks rows up
    assert not model.embed.weight.is_mkldnn and torch.equal(
        model.embed.weight, dense["embed.weight"]
    )
    assert torch.equal(model.proj.weight.to_dense(), dense["proj.weight"])
    assert torch.equal(model.proj.bias, dense["proj.bias"])
    after = (model.proj(hidden), model.head(hidden + model.embed(tokens)))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert cpu_linear.pack_linears(model, (Linear,)) == 0  # once is enough

    monkeypatch.setenv(cpu_linear.ENV, "0")
    assert not cpu_linear.enabled()
    assert cpu_linear.pack_linears(_Tiny(), (Linear,)) == 0
