"""Batched LoRA (Triton) against the reference: segments of many adapters, an adapter's rows
gathered from anywhere in the batch, base-model rows left untouched, one token, ranks 8 to 64
(and fused layers' stacked ranks), empty slots; and the fixed-size index buffers a CUDA graph
reads (padding rows, segments of length 0, ``max_seg_len`` the whole batch) giving the very
update of the step's own compact segments. The fused path's expand (the shrink done by the base
GEMM over an extended weight) against its reference and against shrink-then-expand."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_lora
from kernels.lora import ref_add_lora, ref_expand_lora
from kernels.triton_lora import add_lora, expand_lora
from tests.kernels.paged import assert_matches, rand

Index = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]


def segments(
    slot_of_row: list[int], device: torch.device, capacity: int = 0, groups: int = 0
) -> Index:
    """(rows, starts, lens, slots, max_seg_len) of a batch whose row i is under slot
    ``slot_of_row[i]`` (-1: the base model, in no segment), one segment per slot in slot order
    (as ``LoRAManager.plan`` lays a step out). ``capacity`` rows and ``groups`` segments: the
    fixed-size buffers of a CUDA graph, their unused tail zero (row 0, slot 0, which the
    kernel must never read) and ``max_seg_len`` the capacity."""
    rows: list[int] = []
    starts, lens, slots = [], [], []
    for slot in sorted({s for s in slot_of_row if s >= 0}):
        mine = [i for i, s in enumerate(slot_of_row) if s == slot]
        starts.append(len(rows))
        lens.append(len(mine))
        slots.append(slot)
        rows += mine
    longest = max(lens, default=0)
    if capacity:
        assert capacity >= len(slot_of_row) and groups >= len(lens)
        rows += [0] * (capacity - len(rows))
        pad = [0] * (groups - len(lens))
        starts, lens, slots, longest = starts + pad, lens + pad, slots + pad, capacity
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(rows), as_t(starts), as_t(lens), as_t(slots), longest


def runs(*layout: tuple[int, int]) -> list[int]:
    """Per-row slots of runs (tokens, slot)."""
    return [slot for length, slot in layout for _ in range(length)]


EVERY_SLOT = [-1 if i % 7 == 0 else i * 5 % 8 for i in range(29)]  # slots 0-7 and base rows
CASES = {  # name -> (slot of each row, slots, rank, K, N)
    "one token": (runs((1, 0)), 1, 8, 64, 48),
    "many adapters": (runs((5, 2), (1, 0), (17, 1), (3, 2)), 4, 16, 96, 80),
    "base rows between": (runs((4, -1), (9, 1), (2, -1), (1, 0), (6, -1)), 2, 8, 64, 64),
    "base only": (runs((7, -1)), 2, 8, 32, 32),
    "rank 64, slot unused": (runs((20, 0), (33, 2)), 3, 64, 128, 40),
    "stacked qkv ranks": (runs((3, 1), (2, 0)), 2, 3 * 16, 64, 96),
    "interleaved (round robin)": ([i % 3 for i in range(37)], 3, 16, 80, 48),
    "one adapter, every row": (runs((24, 1)), 2, 16, 64, 64),
    "every slot its own adapter": (EVERY_SLOT, 8, 8, 48, 40),
    # a prefill chunk's segments (>= LONG_SEGMENT rows: row blocks of 64, expand columns of
    # 128), lengths off the block, N off the column block
    "long segments": (runs((300, 0), (40, -1), (259, 1)), 2, 16, 64, 200),
}


def weights(
    num_slots: int, rank: int, k: int, n: int, dtype: torch.dtype, gen: torch.Generator,
    device: torch.device, used_rank: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Stacked A [S, R, K] and B [S, N, R]; ``used_rank``: the adapters' rank below the slots'
    (the columns past it zero, as ``LoRALinear.set_slot`` leaves them)."""
    a = rand((num_slots, rank, k), dtype, gen, device) * k**-0.5
    b = rand((num_slots, n, rank), dtype, gen, device) * rank**-0.5
    if used_rank is not None:
        a[:, used_rank:] = 0
        b[:, :, used_rank:] = 0
    return a, b


def check(out: torch.Tensor, ref: torch.Tensor, y0: torch.Tensor, slot_of_row: list[int]) -> None:
    assert_matches(out, ref)
    base = torch.tensor([s < 0 for s in slot_of_row], device=out.device)
    assert torch.equal(out[base], y0[base]), "a base-model (or padding) row changed"
    if not base.all():
        assert not torch.allclose(out[~base], y0[~base]), "no adapter row changed"


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(
    case: str, dtype: torch.dtype, split: int | None, gen: torch.Generator,
    device: torch.device, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if split is not None:  # K in slices added up in place (what the GPU picks for few rows)
        monkeypatch.setattr(triton_lora, "_split_k", lambda *_: split)
    slot_of_row, num_slots, rank, k, n = CASES[case]
    index = segments(slot_of_row, device)
    rows = len(slot_of_row)
    x = rand((rows, k), dtype, gen, device)
    a, b = weights(num_slots, rank, k, n, dtype, gen, device)
    y0 = rand((rows, n), dtype, gen, device)
    out = add_lora(y0.clone(), x, a, b, *index)
    ref = ref_add_lora(y0.clone(), x, a, b, *index)
    check(out, ref, y0, slot_of_row)


GRAPH_CASES = {  # name -> (slot of each real row, capacity, slots, adapter rank, slots' rank)
    "padding rows": ([1, -1, 0, 1, 3, -1, 2], 16, 4, 16, 16),
    "all base rows": ([-1] * 5, 8, 4, 16, 16),
    "one adapter for all rows": ([2] * 8, 8, 4, 16, 16),
    "max_loras distinct adapters": ([i % 4 for i in range(13)], 16, 4, 16, 16),
    "rank below the max rank": ([0, 1, 1, -1, 0], 8, 2, 5, 16),
    "one row": ([0], 1, 1, 8, 8),
}


@pytest.mark.parametrize("split", [None, 4])
@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_fixed_size_buffers_give_the_steps_own_update(
    case: str, split: int | None, gen: torch.Generator, device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A graph of ``capacity`` rows: the step's rows and padding rows past them, every slot a
    segment (zero-length where unused), the grid's rows the whole batch; the real rows get what
    the compact segments give them (and the reference), padding and base rows nothing."""
    if split is not None:
        monkeypatch.setattr(triton_lora, "_split_k", lambda *_: split)
    slot_of_row, capacity, num_slots, used, rank = GRAPH_CASES[case]
    padded = slot_of_row + [-1] * (capacity - len(slot_of_row))
    k, n, dtype = 64, 48, torch.bfloat16
    x = rand((capacity, k), dtype, gen, device)
    a, b = weights(num_slots, rank, k, n, dtype, gen, device, used_rank=used)
    y0 = rand((capacity, n), dtype, gen, device)
    fixed = segments(padded, device, capacity=capacity, groups=num_slots)
    out = add_lora(y0.clone(), x, a, b, *fixed)
    ref = ref_add_lora(y0.clone(), x, a, b, *fixed)
    check(out, ref, y0, padded)
    real = len(slot_of_row)
    compact = segments(slot_of_row, device)
    eager = add_lora(y0[:real].clone(), x[:real], a, b, *compact)
    assert_matches(out[:real], eager)


def test_reference_is_x_a_b_per_row(gen: torch.Generator) -> None:
    """The reference itself: each row gets its own slot's (x A^T) B^T, computed densely."""
    x = torch.randn(5, 8, generator=gen)
    a, b = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 6, 4, generator=gen)
    index = segments([1, 0, 0, -1, 1], torch.device("cpu"))
    out = ref_add_lora(torch.zeros(5, 6), x, a, b, *index)
    for row, slot in ((0, 1), (1, 0), (2, 0), (4, 1)):
        torch.testing.assert_close(out[row], (x[row] @ a[slot].T) @ b[slot].T)
    assert torch.equal(out[3], torch.zeros(6))


def test_errors(gen: torch.Generator, device: torch.device) -> None:
    x = rand((3, 16), torch.float32, gen, device)
    a, b = (
        rand((2, 8, 16), torch.float32, gen, device),
        rand((2, 12, 8), torch.float32, gen, device),
    )
    rows, starts, lens, slots, longest = segments([0, 0, 0], device)
    y = torch.zeros(3, 12, device=device)
    with pytest.raises(ValueError, match="expects 16"):
        add_lora(y, x[:, :15], a, b, rows, starts, lens, slots, longest)
    with pytest.raises(ValueError, match="lora_b must be"):
        add_lora(y, x, a, b[:, :, :4], rows, starts, lens, slots, longest)
    with pytest.raises(ValueError, match="load adapters in x's dtype"):
        add_lora(y, x, a.half(), b, rows, starts, lens, slots, longest)
    with pytest.raises(ValueError, match="max_seg_len 4 exceeds"):
        add_lora(y, x, a, b, rows, starts, lens, slots, 4)
    with pytest.raises(ValueError, match="seg_rows must have 1 dims"):
        add_lora(y, x, a, b, rows.view(1, 3), starts, lens, slots, longest)


EXPAND_CASES = {  # name -> (slot of each row, slots, rank per shard, shards, K, N)
    "no adapter rows": (runs((9, -1)), 2, 16, 1, 64, 48),
    "one row": ([1], 2, 8, 1, 32, 40),
    "base rows between": (runs((4, -1), (9, 1), (2, -1), (1, 0), (6, -1)), 3, 8, 2, 64, 72),
    "interleaved (round robin), a slot unused": ([i % 3 for i in range(37)], 4, 16, 3, 64, 96),
    "many rows, blocks off the edge": (runs((70, 0), (3, -1), (77, 1)), 2, 16, 1, 48, 200),
    "rank 64, three shards": (runs((5, 1), (11, 0)), 2, 64, 3, 64, 100),
    "every slot its own adapter": (EVERY_SLOT, 8, 8, 1, 48, 33),
}


def extended_gemm(
    x: torch.Tensor, w: torch.Tensor, a: torch.Tensor
) -> torch.Tensor:  # [T, N + S R]
    """What ``LoRALinear`` computes on the fused path: one GEMM over the base weight with every
    slot's A stacked below it (rounded to x's dtype, as the GPU's GEMM rounds)."""
    s, r, k = a.shape
    ext = torch.cat([w, a.reshape(s * r, k)]).float()
    return (x.float() @ ext.T).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(EXPAND_CASES))
def test_expand_from_the_extended_output_matches_the_reference(
    case: str, dtype: torch.dtype, gen: torch.Generator, device: torch.device,
    poison_empty: None,
) -> None:  # fmt: skip
    slot_of_row, num_slots, rank, shards, k, n = EXPAND_CASES[case]
    rows = len(slot_of_row)
    x = rand((rows, k), dtype, gen, device)
    w = rand((n, k), dtype, gen, device) * k**-0.5
    a, b = weights(num_slots, rank * shards, k, n, dtype, gen, device)
    y_ext = extended_gemm(x, w, a)
    row_slots = torch.tensor(slot_of_row, dtype=torch.int32, device=device)
    out = expand_lora(y_ext, b, row_slots)
    assert out.shape == (rows, n) and out.is_contiguous()
    assert out.data_ptr() != y_ext.data_ptr(), "the output must be a tensor of its own"
    check(out, ref_expand_lora(y_ext, b, row_slots), y_ext[:, :n], slot_of_row)
    if dtype == torch.float32:  # the same update as the shrink-then-expand kernels give
        y0 = y_ext[:, :n].contiguous()
        ref = ref_add_lora(y0.clone(), x, a, b, *segments(slot_of_row, device))
        assert_matches(out, ref)


def test_expand_reads_only_each_rows_own_slot(gen: torch.Generator, device: torch.device) -> None:
    """Every other slot's columns of the extended output poisoned (NaN): a row must not touch
    them, nor the B of a slot none of its block uses."""
    slot_of_row = [1, -1, 1, 1, -1, 1]
    _, b = weights(3, 16, 32, 24, torch.float32, gen, device)
    y_ext = rand((6, 24 + 3 * 16), torch.float32, gen, device)
    y_ext[:, 24 : 24 + 16] = float("nan")  # slot 0's x A^T
    y_ext[:, 24 + 32 :] = float("nan")  # slot 2's
    b[0], b[2] = float("nan"), float("nan")
    row_slots = torch.tensor(slot_of_row, dtype=torch.int64, device=device)
    out = expand_lora(y_ext, b, row_slots)
    check(out, ref_expand_lora(y_ext, b, row_slots), y_ext[:, :24], slot_of_row)


def test_expand_errors(gen: torch.Generator, device: torch.device) -> None:
    b = rand((2, 12, 8), torch.float32, gen, device)
    y_ext = rand((3, 12 + 16), torch.float32, gen, device)
    slots = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="needs N"):
        expand_lora(y_ext[:, :27], b, slots)
    with pytest.raises(ValueError, match="row_slots has 2 entries"):
        expand_lora(y_ext, b, slots[:2])
    with pytest.raises(ValueError, match=r"lora_b is torch\.bfloat16"):
        expand_lora(y_ext, b.bfloat16(), slots)
    with pytest.raises(ValueError, match="row_slots has dtype"):
        expand_lora(y_ext, b, slots.float())
