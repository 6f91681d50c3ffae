"""The pinned input buffers a step's integers go through (CPU here: the buffers are the views)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.input_staging import (
    InputStaging,
    fill_tables,
    list_to_device,
    slot_mapping,
    token_spans,
)


def test_views_are_laid_out_back_to_back_and_come_back_in_order() -> None:
    st = InputStaging(16, 16, torch.device("cpu"))
    (a, b), (c,) = st.begin([3, 2], [4])
    a[:] = [1, 2, 3]
    b[:] = [4, 5]
    c[:] = np.arange(4)
    (da, db), (dc,) = st.upload()
    assert da.tolist() == [1, 2, 3] and db.tolist() == [4, 5] and dc.tolist() == [0, 1, 2, 3]
    assert da.dtype == torch.int64 and dc.dtype == torch.int32
    assert st.host64[:5].tolist() == [1, 2, 3, 4, 5]  # one contiguous region: one copy per dtype


def test_grows_when_a_step_needs_more_than_planned() -> None:
    st = InputStaging.for_limits(max_tokens=2, max_seqs=1, max_blocks=2, device=torch.device("cpu"))
    (ids,), (tables,) = st.begin([50], [40])
    ids[:] = np.arange(50)
    tables[:] = 7
    (d_ids,), (d_tables,) = st.upload()
    assert d_ids.tolist() == list(range(50)) and d_tables.tolist() == [7] * 40


def test_empty_parts() -> None:
    st = InputStaging(4, 4, torch.device("cpu"))
    (empty, b), () = st.begin([0, 2], [])
    assert empty.size == 0
    b[:] = [9, 8]
    (da, db), () = st.upload()
    assert da.numel() == 0 and db.tolist() == [9, 8]


@pytest.mark.parametrize("num_seqs", [3, 40])  # a row at a time, and the masked fill
def test_step_layout_matches_a_request_by_request_reference(num_seqs: int) -> None:
    rng = np.random.default_rng(num_seqs)
    bs, width = 16, 9
    lens = rng.integers(1, 40, num_seqs)
    starts = rng.integers(0, 90, num_seqs)
    tables_in = [list(rng.permutation(500)[: (s + n + bs - 1) // bs]) for s, n in zip(starts, lens, strict=True)]  # fmt: skip
    tables = np.full((num_seqs + 2, width), 7, np.int32)  # rows past the requests: zeroed
    fill_tables(tables, tables_in)
    row, pos = token_spans(starts, lens)
    slots = slot_mapping(tables, row, pos, bs)
    want_rows, want_pos, want_slots = [], [], []
    for i, (s, n, ids) in enumerate(zip(starts, lens, tables_in, strict=True)):
        assert tables[i].tolist() == ids + [0] * (width - len(ids))
        for p in range(s, s + n):
            want_rows.append(i)
            want_pos.append(p)
            want_slots.append(ids[p // bs] * bs + p % bs)
    assert not tables[num_seqs:].any()
    assert row.tolist() == want_rows and pos.tolist() == want_pos
    assert slots.tolist() == want_slots and slots.dtype == np.int64


@pytest.mark.parametrize("n", [0, 3, 64, 65, 5000])
def test_a_host_list_arrives_as_torch_would_make_it(n: int) -> None:
    """Short lists through torch.tensor, long ones through numpy: the same values and dtype
    (floats rounded to float32 the same way, int64 beyond 32 bits, negative ints)."""
    ints = [(i * 2_654_435_761) % (1 << 40) - (1 << 39) for i in range(n)]
    floats = [i / 7 - 3.3 for i in range(n)]
    cpu = torch.device("cpu")
    for values, dtype in (
        (ints, torch.long),
        (ints[: n // 2], torch.int32),
        (floats, torch.float32),
    ):
        if dtype == torch.int32:
            values = [v % (1 << 31) for v in values]
        got = list_to_device(values, dtype, cpu)
        want = torch.tensor(values, dtype=dtype)
        assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(list_to_device(tuple(ints), torch.long, cpu), torch.tensor(ints))
