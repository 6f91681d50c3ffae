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


def test_a_one_plane_layout_counts_its_one_plane_and_travels_as_json():
    """DeepSeek's latent cache: one plane, one KV head of 576 dims (61 layers: V3's)."""
    caches = [torch.zeros(1, 10, 16, 1, 576, dtype=torch.bfloat16) for _ in range(61)]
    layout = KvLayout.of(caches)
    assert layout == KvLayout(61, 16, 1, 576, "bfloat16", planes=1)
    assert layout.block_bytes == 61 * 16 * 576 * 2
    assert layout.buffer_shape(3) == (61, 1, 3, 16, 1, 576)
    assert KvLayout.from_json(layout.to_json()) == layout
    two = KvLayout(61, 16, 1, 576, "bfloat16")
    assert layout.mismatch(two) == "planes 1 != 2"
    old = {k: v for k, v in two.to_json().items() if k != "planes"}  # a peer without the field
    assert KvLayout.from_json(old) == two
    for bad in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="planes"):
            KvLayout.from_json({**two.to_json(), "planes": bad})


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
