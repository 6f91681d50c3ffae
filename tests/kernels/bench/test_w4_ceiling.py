"""The int4 GEMV's loads-only ceiling kernel (``kernels.bench.w4_ceiling``) returns what its
torch reference says: each column's XOR of words, max of scales and zeros, the sum of x."""

from __future__ import annotations

import pytest
import torch

from kernels.bench.w4_ceiling import FORMS, loads, pack_scales, ref_loads, tile_major
from tests.kernels.paged import rand
from tests.kernels.test_triton_quant import int4_weight


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (40, 1024, (16, 256, 2)),  # a partial tile of N, four chunks (the last loaded twice)
        (16, 256, (16, 256, 2)),  # one chunk: the word loaded ahead is the chunk itself
        (24, 512, None),  # the served launch's 1024-row chunk does not divide K: refused
    ],
)
def test_the_loads_kernel_equals_its_reference(
    form: str, n: int, k: int, config: tuple[int, ...] | None, gen: torch.Generator,
    device: torch.device,
) -> None:  # fmt: skip
    sz, with_x = FORMS[form]
    qweight, scales, zeros = int4_weight(k, n, 128, torch.bfloat16, gen, device)
    x = rand((1, k), torch.bfloat16, gen, device)
    if config is None and k % 1024:  # the served chunk (1024) does not divide K: refused
        with pytest.raises(ValueError, match="multiple of the chunk"):
            loads(x, qweight, scales, zeros, sz=sz, with_x=with_x)
        return
    got = loads(x, qweight, scales, zeros, sz=sz, with_x=with_x, config=config)
    want = ref_loads(x, qweight, scales, zeros, sz=sz, with_x=with_x)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-4)


def test_packed_scales_hold_both_bf16_values(gen: torch.Generator, device: torch.device) -> None:
    _, scales, zeros = int4_weight(256, 8, 128, torch.bfloat16, gen, device)
    scales[0, 0] = -0.5  # a sign bit in the low half must not reach the zero's
    packed = pack_scales(scales, zeros)
    low = (packed & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(low, scales) and torch.equal(
        (packed >> 16).to(torch.int16).view(torch.bfloat16), zeros
    )


@pytest.mark.parametrize("sz", [0, 2])
def test_tile_major_words_give_the_same_columns(sz: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    qweight, scales, zeros = int4_weight(512, 48, 128, torch.bfloat16, gen, device)
    x = rand((1, 512), torch.bfloat16, gen, device)
    tiled = tile_major(qweight, 16)
    assert tiled.shape == (3, 64, 16) and torch.equal(tiled[1, 5], qweight[5, 16:32])
    got = loads(x, qweight, scales, zeros, sz=sz, with_x=False, config=(16, 256, 2), tiled=tiled)
    want = ref_loads(x, qweight, scales, zeros, sz=sz, with_x=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="tile_major"):
        loads(x, qweight, scales, zeros, sz=sz, config=(32, 256, 2), tiled=tiled)
