"""Block gather/scatter (Triton) against the references."""

from __future__ import annotations

import pytest
import torch

from kernels.block_copy import (
    RefBlockCopier,
    ref_fence_cas,
    ref_gather_blocks,
    ref_scatter_blocks,
)
from kernels.triton_block_copy import BlockCopier, fence_cas, gather_blocks, scatter_blocks
from tests.kernels.paged import assert_same_rounding, rand

SHAPE = (2, 12, 4, 2, 16)  # [K/V, blocks, block_size, Hkv, D]


def separate_layers(n: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> list[torch.Tensor]:  # fmt: skip
    return [rand(SHAPE, dtype, gen, device) for _ in range(n)]


def views_of_one_pool(n: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> list[torch.Tensor]:  # fmt: skip
    return list(rand((n, *SHAPE), dtype, gen, device).unbind(0))


@pytest.mark.parametrize("make", [separate_layers, views_of_one_pool])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_then_scatter_round_trip(make, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    src = make(3, dtype, gen, device)
    ids = torch.tensor([7, 0, 11, 3], device=device)
    buf = gather_blocks(src, ids)
    assert torch.equal(buf, ref_gather_blocks(src, ids))

    dst = make(3, dtype, gen, device)
    ref_dst = [c.clone() for c in dst]
    dst_ids = torch.tensor([1, 2, 10, 5], dtype=torch.int32, device=device)
    scatter_blocks(buf, dst, dst_ids)
    ref_scatter_blocks(buf, ref_dst, dst_ids)
    assert all(torch.equal(a, b) for a, b in zip(dst, ref_dst, strict=True))  # other blocks intact


def test_scatter_converts_dtype(gen: torch.Generator, device: torch.device) -> None:
    dst = separate_layers(2, torch.bfloat16, gen, device)
    ref_dst = [c.clone() for c in dst]
    ids = torch.tensor([4, 9], device=device)
    buf = rand((2, 2, 2, *SHAPE[2:]), torch.float32, gen, device)
    scatter_blocks(buf, dst, ids)
    ref_scatter_blocks(buf, ref_dst, ids)
    for a, b in zip(dst, ref_dst, strict=True):
        assert_same_rounding(a, b)


def test_no_blocks(gen: torch.Generator, device: torch.device) -> None:
    caches = separate_layers(2, torch.float32, gen, device)
    buf = gather_blocks(caches, torch.tensor([], dtype=torch.int64, device=device))
    assert buf.shape == (2, 2, 0, *SHAPE[2:])
    scatter_blocks(buf, caches, torch.tensor([], dtype=torch.int64, device=device))


def test_errors(gen: torch.Generator, device: torch.device) -> None:
    caches = separate_layers(2, torch.float32, gen, device)
    ids = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match="dtype"):
        gather_blocks([caches[0], caches[1].bfloat16()], ids)
    with pytest.raises(ValueError, match=r"must be \[planes \(1 or 2\), blocks"):
        gather_blocks([torch.cat([c, c[:1]]) for c in caches], ids)
    with pytest.raises(ValueError, match="buffer shape"):
        scatter_blocks(rand((2, 2, 3, *SHAPE[2:]), torch.float32, gen, device), caches, ids)
    with pytest.raises(ValueError, match="non-empty list"):
        gather_blocks([], ids)


@pytest.mark.parametrize("copier", [BlockCopier, RefBlockCopier])
@pytest.mark.parametrize("make", [separate_layers, views_of_one_pool])
def test_copier_moves_any_layer_range_like_the_reference(copier, make, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    src = make(5, torch.bfloat16, gen, device)
    ids = torch.tensor([7, 0, 11, 3], device=device)
    whole = ref_gather_blocks(src, ids)
    plan = copier(src)
    assert torch.equal(plan.gather(ids), whole)
    out = torch.full((5, 2, 4, *SHAPE[2:]), float("nan"), dtype=torch.bfloat16, device=device)
    for first, last in ((0, 2), (2, 3), (3, 5)):  # chunks of layers, one buffer
        got = plan.gather(ids, first, last, out=out[first:last])
        assert got.data_ptr() == out[first].data_ptr()
        assert torch.equal(got, whole[first:last])

    dst = make(5, torch.bfloat16, gen, device)
    want = [c.clone() for c in dst]
    dst_ids = torch.tensor([1, 2, 10, 5], dtype=torch.int32, device=device)
    ref_scatter_blocks(whole[1:4], want[1:4], dst_ids)
    copier(dst).scatter(whole[1:4], dst_ids, 1, 4)
    assert all(torch.equal(a, b) for a, b in zip(dst, want, strict=True))  # layers 0, 4 intact


@pytest.mark.parametrize("copier", [BlockCopier, RefBlockCopier])
def test_copier_gathers_into_another_dtype_and_only_into_contiguous_buffers(copier, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    src = separate_layers(2, torch.bfloat16, gen, device)
    ids = torch.tensor([3, 5], device=device)
    out = torch.empty((2, 2, 2, *SHAPE[2:]), dtype=torch.float32, device=device)
    copier(src).gather(ids, out=out)
    assert torch.equal(out, ref_gather_blocks(src, ids).float())
    strided = torch.empty((2, 2, 2, 2, *SHAPE[2:]), device=device)[:, :, :, 0]
    with pytest.raises(ValueError, match="contiguous"):
        copier(src).gather(ids, out=strided)


def test_copier_rejects_bad_ranges_buffers_and_ids(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    plan = BlockCopier(separate_layers(3, torch.float32, gen, device))
    ids = torch.tensor([1, 2], device=device)
    for first, last in ((0, 0), (2, 1), (0, 4), (-1, 2)):
        with pytest.raises(ValueError, match="range"):
            plan.gather(ids, first, last)
    with pytest.raises(ValueError, match="out shape"):
        plan.gather(ids, 0, 2, out=torch.empty((3, 2, 2, *SHAPE[2:]), device=device))
    with pytest.raises(ValueError, match="buffer shape"):
        plan.scatter(torch.empty((1, 2, 3, *SHAPE[2:]), device=device), ids, 0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        plan.scatter(
            torch.empty((2, 2, 1, 2, *SHAPE[2:]), device=device)[:, :, :, 0], ids[:1], 0, 2
        )
    with pytest.raises(ValueError, match="block_ids"):
        plan.gather(ids.float())
    with pytest.raises(ValueError, match="non-empty"):
        BlockCopier([])


@pytest.mark.parametrize("copier", [BlockCopier, RefBlockCopier])
def test_copy_from_moves_blocks_between_pools_like_the_reference(copier, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    src = views_of_one_pool(4, torch.bfloat16, gen, device)
    dst = separate_layers(4, torch.bfloat16, gen, device)  # another allocation, another layout
    want = [c.clone() for c in dst]
    src_ids = torch.tensor([7, 0, 11], device=device)
    dst_ids = torch.tensor([2, 9, 4], dtype=torch.int32, device=device)
    for first, last in ((1, 3), (3, 4)):  # a range of layers at a time, as a streamed KV lands
        copier(dst).copy_from(copier(src), src_ids, dst_ids, first, last)
    ref_scatter_blocks(ref_gather_blocks(src[1:], src_ids), want[1:], dst_ids)
    assert all(torch.equal(a, b) for a, b in zip(dst, want, strict=True))  # layer 0 intact
    with pytest.raises(ValueError, match="destination ids"):
        copier(dst).copy_from(copier(src), src_ids, dst_ids[:2])
    with pytest.raises(ValueError, match="range"):
        copier(dst).copy_from(copier(src[:2]), src_ids, dst_ids, 0, 3)


@pytest.mark.gpu
def test_gpu_llama_layers() -> None:
    gen, cuda = torch.Generator().manual_seed(0), torch.device("cuda")
    caches = [rand((2, 256, 16, 8, 128), torch.bfloat16, gen, cuda) for _ in range(32)]
    ids = torch.randperm(256, device=cuda)[:64]
    buf = gather_blocks(caches, ids)
    assert torch.equal(buf, ref_gather_blocks(caches, ids))
    dst = [torch.zeros_like(c) for c in caches]
    scatter_blocks(buf, dst, ids)
    assert torch.equal(ref_gather_blocks(dst, ids), buf)
    plan = BlockCopier(caches)
    out = torch.empty_like(buf)
    for first in range(0, 32, 8):
        plan.gather(ids, first, first + 8, out=out[first : first + 8])
    assert torch.equal(out, buf)
    plan.scatter(out[8:16], torch.flip(ids, (0,)), 8, 16)
    assert torch.equal(ref_gather_blocks(caches[8:16], torch.flip(ids, (0,))), buf[8:16])
    moved = [torch.zeros_like(c) for c in caches]
    BlockCopier(moved).copy_from(plan, ids, torch.flip(ids, (0,)))
    assert torch.equal(ref_gather_blocks(moved, torch.flip(ids, (0,))), plan.gather(ids))


def _meta(token: int, src: list[int], dst: list[int], device: torch.device, slot: int = 1, room: int = 0) -> torch.Tensor:  # fmt: skip
    pad = [-1] * (2 * room)  # room for more blocks than this transfer names: never read
    return torch.tensor([token, slot, len(src), *src, *dst, *pad], dtype=torch.int64, device=device)  # fmt: skip


@pytest.mark.parametrize("copier", [BlockCopier, RefBlockCopier])
@pytest.mark.parametrize(
    ("state", "copies", "after"),
    [
        (40, True, 42),  # granted: claimed, copied, landed
        (41, True, 42),  # already claimed (an earlier launch of the same grant): copies too
        (43, False, 43),  # revoked before it ran: writes nothing
        (44, False, 44),  # the slot granted again, to another transfer: writes nothing
        (0, False, 0),  # never granted
    ],
)
def test_push_copies_only_what_the_fence_grants(copier, state: int, copies: bool, after: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    src = views_of_one_pool(3, torch.bfloat16, gen, device)
    dst = separate_layers(3, torch.bfloat16, gen, device)
    before = [c.clone() for c in dst]
    fence = torch.tensor([[40, 0], [state, 0], [40, 0]], dtype=torch.int64, device=device)
    copier(dst).push_from(copier(src), _meta(40, [7, 0, 11], [2, 9, 4], device, room=2), fence)
    want = [c.clone() for c in before]
    if copies:
        ref_scatter_blocks(ref_gather_blocks(src, torch.tensor([7, 0, 11])), want, torch.tensor([2, 9, 4]))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(dst, want, strict=True))
    assert fence[:, 0].tolist() == [40, after, 40]  # only its own slot


@pytest.mark.parametrize("copier", [BlockCopier, RefBlockCopier])
def test_push_rejects_bad_meta_and_fence(copier, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    src = views_of_one_pool(2, torch.float32, gen, device)
    dst = separate_layers(2, torch.float32, gen, device)
    fence = torch.zeros((2, 2), dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="meta"):
        copier(dst).push_from(copier(src), _meta(4, [1], [3], device)[:2], fence)
    with pytest.raises(ValueError, match="meta"):
        copier(dst).push_from(copier(src), _meta(4, [1], [3], device).int(), fence)
    with pytest.raises(ValueError, match="fence"):
        copier(dst).push_from(copier(src), _meta(4, [1], [3], device), fence[0])
    with pytest.raises(ValueError, match="layers"):
        copier(dst).push_from(copier(src[:1]), _meta(4, [1], [3], device), fence)


@pytest.mark.parametrize("copier", [BlockCopier, RefBlockCopier])
def test_push_of_no_blocks_or_a_token_never_granted_writes_nothing(copier, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    src = views_of_one_pool(2, torch.float32, gen, device)
    dst = separate_layers(2, torch.float32, gen, device)
    before = [c.clone() for c in dst]
    fence = torch.tensor([[0, 0], [8, 0]], dtype=torch.int64, device=device)
    # what a sender warms its launch up with: a negative token matches no state
    copier(dst).push_from(copier(src), _meta(-4, [], [], device, slot=0, room=3), fence)
    assert fence.tolist() == [[0, 0], [8, 0]]
    copier(dst).push_from(copier(src), _meta(8, [], [], device, room=3), fence)  # n = 0
    assert int(fence[1, 0]) == 10  # claimed and landed, nothing to copy
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


@pytest.mark.parametrize("cas", [fence_cas, ref_fence_cas])
def test_fence_cas_swaps_only_the_expected_value(cas, device: torch.device) -> None:
    word = torch.tensor([40, 7], dtype=torch.int64, device=device)
    assert cas(word, 40, 43) == 40
    assert word.tolist() == [43, 7]
    assert cas(word, 40, 99) == 43  # not what it holds: left alone
    assert word.tolist() == [43, 7]
    big = 1 << 60  # tokens are 64-bit
    word[0] = big
    assert cas(word, big, big + 3) == big and int(word[0]) == big + 3


@pytest.mark.parametrize("copier", [BlockCopier, RefBlockCopier])
def test_one_plane_caches_move_as_two_plane_ones_do(copier, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    """Caches of one plane (DeepSeek's latent: the keys are the values): gather, scatter,
    copy_from and a fenced push move whole blocks of that plane, nothing of other blocks."""
    shape = (1, *SHAPE[1:])
    src = [rand(shape, torch.bfloat16, gen, device) for _ in range(3)]
    dst = [rand(shape, torch.bfloat16, gen, device) for _ in range(3)]
    ids, dst_ids = torch.tensor([7, 0, 11], device=device), torch.tensor([2, 9, 4], device=device)
    plan, into = copier(src), copier(dst)
    buf = plan.gather(ids)
    assert tuple(buf.shape) == plan.buffer_shape(3) == (3, 1, 3, *SHAPE[2:])
    assert torch.equal(buf, ref_gather_blocks(src, ids))
    assert torch.equal(gather_blocks(src, ids), buf)
    want = [c.clone() for c in dst]
    ref_scatter_blocks(buf, want, dst_ids)
    into.scatter(buf, dst_ids)
    assert all(torch.equal(a, b) for a, b in zip(dst, want, strict=True))
    moved = [c.clone() for c in dst]
    copier(moved).copy_from(plan, ids, torch.tensor([1, 3, 5], device=device))
    ref_scatter_blocks(buf, want, torch.tensor([1, 3, 5]))
    assert all(torch.equal(a, b) for a, b in zip(moved, want, strict=True))
    fence = torch.tensor([[0, 0], [40, 0]], dtype=torch.int64, device=device)
    pushed = [c.clone() for c in dst]
    copier(pushed).push_from(plan, _meta(40, [7, 0, 11], [1, 3, 5], device), fence)
    assert all(torch.equal(a, b) for a, b in zip(pushed, want, strict=True))
    assert fence[1, 0].item() == 42
    with pytest.raises(ValueError, match="do not fit"):
        BlockCopier(dst).copy_from(BlockCopier([torch.cat([c, c]) for c in src]), ids, dst_ids)
