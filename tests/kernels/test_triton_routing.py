"""The MoE router in one launch (kernels.triton_routing) against the torch reference: softmax,
top-k and renormalization over expert counts that are no power of two, top-1 to all experts,
16-bit and float32 logits, ties, and rows whose logits are far apart."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import ref_moe_routing
from kernels.triton_routing import moe_routing


def _check(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    """The same experts in the same (descending) order, their weights within float32 rounding;
    where the reference's probabilities underflow to 0 (ties it breaks as it likes), only the
    weights: 0 on both sides."""
    weights, ids = moe_routing(logits, top_k, renormalize)
    ref_w, ref_ids = ref_moe_routing(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    positive = ref_w > 0
    torch.testing.assert_close(ids[positive], ref_ids[positive], rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    ("t", "e", "top_k"),
    [(1, 128, 8), (3, 60, 4), (5, 8, 2), (2, 64, 6), (4, 7, 7), (1, 2, 1), (9, 257, 1)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(t: int, e: int, top_k: int, renormalize: bool, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    """Distinct logits (a random permutation of a spread), so the top-k is unambiguous even in
    bfloat16."""
    perm = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)])
    logits = (perm.float() * 0.25 - 3.0).to(device=device, dtype=dtype)
    _check(logits, top_k, renormalize)


def test_far_apart_logits_and_a_strided_view(gen: torch.Generator, device: torch.device) -> None:
    """One expert far ahead (the others' exponentials underflow to 0: chosen by their logits
    here, at random among zeros by the reference), and logits read through a non-contiguous
    view of a wider buffer."""
    wide = torch.randn((3, 40), generator=gen).to(device)
    logits = wide[:, ::2]  # [3, 20], stride 2
    logits[0, 5] = 200.0
    _check(logits, 3, True)
    _check(logits, 3, False)
    _, ids = moe_routing(logits, 3, False)
    assert ids[0].tolist() == [5, *logits[0].topk(3).indices[1:].tolist()]


def test_ties_take_the_lowest_index(device: torch.device) -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], device=device)
    weights, ids = moe_routing(logits, 2, False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0, 0], weights[0, 1])


def test_no_tokens(device: torch.device) -> None:
    weights, ids = moe_routing(torch.empty((0, 16), device=device), 4, True)
    assert weights.shape == ids.shape == (0, 4)


def test_minus_infinity_logits_are_chosen_once(device: torch.device) -> None:
    """A -inf logit (an expert masked out) chosen because top_k reaches it: each expert once,
    weight 0, as the reference (was: the lowest index again, its weight counted twice)."""
    inf = float("inf")
    logits = torch.tensor([[0.5, -inf, 1.0, 0.2], [-inf, -inf, 2.0, -inf]], device=device)
    for renormalize in (True, False):
        weights, ids = moe_routing(logits, 4, renormalize)
        ref_w, ref_ids = ref_moe_routing(logits, 4, renormalize)
        assert [sorted(row) for row in ids.tolist()] == [[0, 1, 2, 3]] * 2
        assert ids[:, :3].tolist() == [[2, 0, 3], [2, 0, 1]]
        torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)
        assert ids[:, 0].tolist() == ref_ids[:, 0].tolist()
