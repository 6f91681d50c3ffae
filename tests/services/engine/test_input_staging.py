"""The pinned input buffers a step's integers go through (CPU here: the buffers are the views)."""

from __future__ import annotations

import numpy as np
import torch

from services.engine.input_staging import InputStaging


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
