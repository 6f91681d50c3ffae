"""Batched LoRA (Triton) against the reference: segments of many adapters, base-model rows
left untouched, one token, ranks 8 to 64 (and fused layers' stacked ranks), empty slots."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_lora
from kernels.lora import ref_add_lora
from kernels.triton_lora import add_lora
from tests.kernels.paged import assert_matches, rand


def segments(
    layout: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(starts, lens, slots, longest, rows) of runs (length, slot); slot -1 is a base-model run,
    which belongs to no segment."""
    starts, lens, slots, at = [], [], [], 0
    for length, slot in layout:
        if slot >= 0:
            starts.append(at)
            lens.append(length)
            slots.append(slot)
        at += length
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(starts), as_t(lens), as_t(slots), max(lens, default=0), at


CASES = {  # name -> (runs of (tokens, slot), slots, rank, K, N)
    "one token": ([(1, 0)], 1, 8, 64, 48),
    "many adapters": ([(5, 2), (1, 0), (17, 1), (3, 2)], 4, 16, 96, 80),
    "base rows between": ([(4, -1), (9, 1), (2, -1), (1, 0), (6, -1)], 2, 8, 64, 64),
    "base only": ([(7, -1)], 2, 8, 32, 32),
    "rank 64, slot unused": ([(20, 0), (33, 2)], 3, 64, 128, 40),
    "stacked qkv ranks": ([(3, 1), (2, 0)], 2, 3 * 16, 64, 96),
}


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(
    case: str, dtype: torch.dtype, split: int | None, gen: torch.Generator,
    device: torch.device, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if split is not None:  # K in slices added up in place (what the GPU picks for few rows)
        monkeypatch.setattr(triton_lora, "_split_k", lambda *_: split)
    runs, num_slots, rank, k, n = CASES[case]
    starts, lens, slots, longest, rows = segments(runs, device)
    x = rand((rows, k), dtype, gen, device)
    a = rand((num_slots, rank, k), dtype, gen, device) * k**-0.5
    b = rand((num_slots, n, rank), dtype, gen, device) * rank**-0.5
    y0 = rand((rows, n), dtype, gen, device)
    out = add_lora(y0.clone(), x, a, b, starts, lens, slots, longest)
    ref = ref_add_lora(y0.clone(), x, a, b, starts, lens, slots, longest)
    assert_matches(out, ref)
    base = torch.ones(rows, dtype=torch.bool)
    for start, length in zip(starts.tolist(), lens.tolist(), strict=True):
        base[start : start + length] = False
    assert torch.equal(out[base.to(device)], y0[base.to(device)]), "a base-model row changed"
    if not base.all():
        assert not torch.allclose(out[~base.to(device)], y0[~base.to(device)])


def test_reference_is_x_a_b_per_row(gen: torch.Generator) -> None:
    """The reference itself: each row gets its own slot's (x A^T) B^T, computed densely."""
    x = torch.randn(4, 8, generator=gen)
    a, b = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 6, 4, generator=gen)
    starts, lens, slots, longest, _ = segments([(1, 1), (2, 0), (1, -1)], torch.device("cpu"))
    out = ref_add_lora(torch.zeros(4, 6), x, a, b, starts, lens, slots, longest)
    for row, slot in ((0, 1), (1, 0), (2, 0)):
        torch.testing.assert_close(out[row], (x[row] @ a[slot].T) @ b[slot].T)
    assert torch.equal(out[3], torch.zeros(6))


def test_errors(gen: torch.Generator, device: torch.device) -> None:
    x = rand((3, 16), torch.float32, gen, device)
    a, b = (
        rand((2, 8, 16), torch.float32, gen, device),
        rand((2, 12, 8), torch.float32, gen, device),
    )
    starts, lens, slots, longest, _ = segments([(3, 0)], device)
    y = torch.zeros(3, 12, device=device)
    with pytest.raises(ValueError, match="expects 16"):
        add_lora(y, x[:, :15], a, b, starts, lens, slots, longest)
    with pytest.raises(ValueError, match="lora_b must be"):
        add_lora(y, x, a, b[:, :, :4], starts, lens, slots, longest)
    with pytest.raises(ValueError, match="load adapters in x's dtype"):
        add_lora(y, x, a.half(), b, starts, lens, slots, longest)
