"""The few-token fused MoE (a GEMV a pair, kernels.triton_moe_pairs) against the reference, with
the same tolerances and rounding model as the grouped kernel's tests: one token and several,
top-1 to top-8, experts two tokens share, sizes that are no power of two and not multiples of
the tiles, every float dtype, gpt-oss's biases and clamp, FP8 experts (block and per-channel
scales), int4 ones (act-order too); and the dispatch of ``kernels.triton_moe.fused_moe`` to it."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_moe, triton_moe_pairs
from kernels.moe import ClampedSwiGLU
from kernels.triton_moe_pairs import fused_moe_pairs
from tests.kernels.test_triton_moe import (
    _assert_close,
    _fp8,
    _gpt_oss,
    _inputs,
    _int4,
    _int4_act_order,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("t", "h", "e", "inter", "top_k"),
    [
        (1, 64, 8, 32, 2),  # decode: one token, two experts
        (1, 40, 16, 24, 8),  # top-8 of 16, H and I no power of two
        (3, 72, 6, 40, 1),  # top-1
        (3, 96, 4, 42, 3),  # top-3 of 4: tokens share experts; I wider than a tile, not a multiple
        (2, 48, 8, 56, 8),  # top-8 of 8: every pair of a token, every expert by every token
    ],
)
def test_matches_the_reference(t: int, h: int, e: int, inter: int, top_k: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    args = _inputs(t, h, e, inter, top_k, dtype, gen, device)
    _assert_close(fused_moe_pairs(*args), args)


@pytest.mark.parametrize("tiles", [((16, 16, 1), (16, 16, 1)), ((32, 64, 4), (64, 32, 2))])
def test_tiles_narrower_and_wider_than_h_and_i(tiles: tuple[tuple[int, int, int], tuple[int, int, int]], gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    args = _inputs(4, 72, 5, 56, 2, torch.float32, gen, device)
    _assert_close(fused_moe_pairs(*args, tiles=tiles), args)


def test_unsorted_slots_are_summed_in_ascending_expert_order(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Slots given in descending and mixed expert order, int32 ids, bf16 router weights: the
    sum's order (which rounds in 16-bit dtypes) is the ascending experts', as the reference's."""
    x, w13, w2, _, _ = _inputs(3, 64, 16, 32, 4, torch.bfloat16, gen, device)
    ids = torch.tensor([[11, 7, 3, 0], [2, 15, 9, 4], [5, 6, 1, 14]], dtype=torch.int32, device=device)  # fmt: skip
    weights = torch.rand((3, 4), generator=gen).to(device=device, dtype=torch.bfloat16)
    _assert_close(fused_moe_pairs(x, w13, w2, weights, ids), (x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_biases_and_clamped_swiglu(dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x, w13, w2, weights, ids = _inputs(2, 64, 8, 48, 4, dtype, gen, device)
    x, extra = _gpt_oss(x, 8, 48, gen)
    out = fused_moe_pairs(x, w13, w2, weights, ids, **extra)
    _assert_close(out, (x, w13, w2, weights, ids), **extra)


def test_one_bias_alone(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:
    x, w13, w2, weights, ids = _inputs(2, 40, 4, 24, 2, torch.float32, gen, device)
    b2 = torch.randn((4, 40), generator=gen).to(device)
    out = fused_moe_pairs(x, w13, w2, weights, ids, b2=b2, clamp=ClampedSwiGLU())
    _assert_close(out, (x, w13, w2, weights, ids), b2=b2, clamp=ClampedSwiGLU())


@pytest.mark.parametrize("block", [(32, 48), (16, 16), None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_match_the_dequantized_reference(block: tuple[int, int] | None, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Block scales that do not divide H or I (a K tile of 256 halved to 16 so none straddles
    two 48-wide blocks), square ones, and per-channel ones."""
    x, w13, w2, weights, ids = _inputs(2, 96, 6, 56, 2, dtype, gen, device)
    q13, q2, fp8, d13, d2 = _fp8(w13, w2, block)
    out = fused_moe_pairs(x, q13, q2, weights, ids, fp8=fp8)
    _assert_close(out, (x, d13, d2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "h", "e", "inter", "top_k", "group"),
    [
        (1, 96, 8, 80, 1, 16),  # top-1; six and five groups of 16 (K tiles of 16)
        (1, 40, 16, 24, 8, None),  # top-8, one group a row: K no multiple of the tile
        (2, 96, 4, 48, 3, 48),  # tokens share experts; groups of 48 (tiles halved to 16)
        (2, 64, 8, 32, 8, 32),  # every expert by every token
    ],
)
def test_int4_experts_match_the_dequantized_reference(t: int, h: int, e: int, inter: int, top_k: int, group: int | None, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Packed int4 experts (kernels.moe.Int4Scales) dequantized in the GEMVs' tiles, against
    the float reference on the dequantized weights (rounded to x's dtype, as the kernel does)."""
    x, w13, w2, weights, ids = _inputs(t, h, e, inter, top_k, dtype, gen, device)
    q13, q2, int4, d13, d2 = _int4(w13, w2, group)
    out = fused_moe_pairs(x, q13, q2, weights, ids, int4=int4)
    _assert_close(out, (x, d13, d2, weights, ids))


def test_int4_tiles_narrower_and_wider_than_a_group(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x, w13, w2, weights, ids = _inputs(2, 128, 5, 64, 2, torch.float32, gen, device)
    q13, q2, int4, d13, d2 = _int4(w13, w2, 64)
    for tiles in (((16, 16, 1), (16, 16, 1)), ((4, 512, 2), (32, 256, 4))):
        out = fused_moe_pairs(x, q13, q2, weights, ids, int4=int4, tiles=tiles)
        _assert_close(out, (x, d13, d2, weights, ids))


@pytest.mark.parametrize(
    ("t", "h", "e", "inter", "top_k", "group", "dtype"),
    [
        (2, 96, 4, 48, 3, 48, torch.bfloat16),  # tokens share experts; two and one groups of 48
        (3, 40, 16, 24, 8, None, torch.float16),  # one group a row: K no multiple of the tile
    ],
)
def test_int4_act_order_experts_match_the_dequantized_reference(t: int, h: int, e: int, inter: int, top_k: int, group: int | None, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Act-order int4 experts: x's and the intermediate's columns gathered through each pair's
    expert's permutation (masked past K where the tiles are not whole), against the float
    reference on the weights in the input's order."""
    x, w13, w2, weights, ids = _inputs(t, h, e, inter, top_k, dtype, gen, device)
    q13, q2, int4, d13, d2 = _int4_act_order(w13, w2, group, gen)
    out = fused_moe_pairs(x, q13, q2, weights, ids, int4=int4)
    _assert_close(out, (x, d13, d2, weights, ids))


def test_int4_act_order_tiles_narrower_and_wider_than_a_group(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x, w13, w2, weights, ids = _inputs(2, 128, 5, 64, 2, torch.float32, gen, device)
    q13, q2, int4, d13, d2 = _int4_act_order(w13, w2, 64, gen, torch.int64)
    for tiles in (((16, 16, 1), (16, 16, 1)), ((4, 512, 2), (32, 256, 4))):
        out = fused_moe_pairs(x, q13, q2, weights, ids, int4=int4, tiles=tiles)
        _assert_close(out, (x, d13, d2, weights, ids))


def test_fused_moe_takes_pairs_for_few_and_groups_beyond(gen: torch.Generator, device: torch.device, poison_empty: None, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Up to MAX_PAIRS (token, expert) pairs and no more than the experts the pair kernels
    serve; past either, or with a launch config given, the grouped ones; both equal the
    reference."""
    calls: list[int] = []

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return fused_moe_pairs(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_moe, "fused_moe_pairs", spy)
    few = _inputs(4, 40, 8, 24, 2, torch.float32, gen, device)  # 8 pairs on 8 experts
    _assert_close(triton_moe.fused_moe(*few), few)
    assert calls == [1]
    many = _inputs(5, 40, 8, 24, 2, torch.float32, gen, device)  # 10 pairs: more than experts
    _assert_close(triton_moe.fused_moe(*many), many)
    _assert_close(triton_moe.fused_moe(*few, config=(16, 16, 16, 1)), few)
    monkeypatch.setattr(triton_moe_pairs, "MAX_PAIRS", 6)
    _assert_close(triton_moe.fused_moe(*few), few)  # 8 pairs: past the cap
    assert calls == [1]


def test_k_tiles_halve_only_inside_fp8_scale_blocks() -> None:
    """Float weights keep the asked K tile (capped by K); FP8 ones halve it to fit a block."""
    from kernels.triton_moe_pairs import _k_tile

    assert _k_tile(256, 2048, None) == 256
    assert _k_tile(256, 40, None) == 64
    assert _k_tile(256, 2048, 128) == 128
    assert _k_tile(256, 96, 48) == 16
    assert _k_tile(256, 96, 96) == 128  # one block covers all of K


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "k", "e", "top_k"),
    [
        (1, 64, 8, 8),  # decode: one token's eight pairs
        (3, 40, 4, 2),  # K no power of two
        (5, 1500, 6, 3),  # K past one block (1024), not a multiple of it
        (7, 24, 3, 1),  # a row a pair (the intermediate's case)
        (0, 32, 4, 2),  # no rows
    ],
)
def test_permuted_rows_equal_the_reference(rows: int, k: int, e: int, top_k: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Each pair's row of its token's (or its own) input in its act-order expert's column
    order, bit for bit: every column gathered (the permutations are random, so a missed or
    repeated one shows), int32 and int64 permutations and expert ids."""
    from kernels.moe import ref_permuted_rows

    src = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    for index_dtype in (torch.int32, torch.int64):
        perm = torch.stack([torch.randperm(k, generator=gen) for _ in range(e)])
        ids = torch.randint(0, e, (rows * top_k,), generator=gen)
        perm, ids = perm.to(device, index_dtype), ids.to(device, index_dtype)
        got = triton_moe_pairs.permuted_rows(src, perm, ids, top_k)
        want = ref_permuted_rows(src, perm, ids, top_k)
        assert got.shape == (rows * top_k, k) and torch.equal(got, want)
        if rows:  # the reference is what it says: row p is src[p // top_k] permuted
            p = rows * top_k - 1
            assert torch.equal(want[p], src[p // top_k][perm[ids[p]].long()])
