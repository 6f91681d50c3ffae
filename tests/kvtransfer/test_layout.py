"""KV layouts: derived from caches, compared field by field, block ids validated."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.layout import KvLayout, check_block_ids


def test_layout_of_caches_and_its_byte_size():
    caches = [torch.zeros(2, 10, 16, 8, 128, dtype=torch.bfloat16) for _ in range(32)]
    layout = KvLayout.of(caches)
    assert layout == KvLayout(32, 16, 8, 128, "bfloat16")
    assert layout.block_bytes == 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB per block of Llama-3.1-8B
    assert layout.buffer_shape(3) == (32, 2, 3, 16, 8, 128)


@pytest.mark.parametrize(
    "caches",
    [
        [],
        [torch.zeros(3, 4, 16, 2, 8)],
        [torch.zeros(2, 4, 16, 2, 8), torch.zeros(2, 4, 16, 2, 4)],
        [torch.zeros(2, 4, 16, 2, 8), torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16)],
        [torch.zeros(2, 4, 16, 2, 8, dtype=torch.int32)],
    ],
)
def test_non_uniform_or_odd_caches_are_refused(caches):
    with pytest.raises(ValueError):
        KvLayout.of(caches)


def test_mismatch_names_each_differing_field():
    a = KvLayout(2, 16, 8, 128, "bfloat16")
    assert a.mismatch(a) == ""
    assert (
        a.mismatch(KvLayout(2, 16, 8, 64, "float16"))
        == "head_dim 128 != 64, dtype bfloat16 != float16"
    )


@pytest.mark.parametrize("ids", [[], [-1], [10], [1, 1], [True]])
def test_bad_block_ids_are_refused(ids):
    with pytest.raises(ValueError):
        check_block_ids(ids, 10)
