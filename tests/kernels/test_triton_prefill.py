"""Variable-length causal prefill attention over a paged cache (Triton) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_prefill
from kernels.attention import ref_prefill_attention
from kernels.triton_prefill import (
    TILE_CHOICES,
    Tiles,
    choose_tiles,
    prefill_attention,
)
from tests.kernels.paged import assert_matches, paged_kv, rand

# several query tiles and unmasked key tiles even at tiny lengths; GQA groups packed in a tile
SMALL_TILES = (16, 16, 4, 1, True)
UNPACKED = (16, 16, 4, 1, False)  # one query head per tile


def run_case(
    ctx_lens: list[int],
    q_lens: list[int],
    group: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: torch.device,
    *,
    block_size: int = 16,
    head_dim: int = 32,
    kv_heads: int = 2,
    tiles: triton_prefill.TilesLike | None = SMALL_TILES,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    span_last: torch.Tensor | None = None,
) -> None:
    k_cache, v_cache, tables = paged_kv(
        ctx_lens, block_size, kv_heads, head_dim, dtype, gen, device
    )
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = rand((int(starts[-1]), kv_heads * group, head_dim), dtype, gen, device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = prefill_attention(
        q, k_cache, v_cache, tables, starts.to(device), lens, scale, tiles=tiles, window=window,
        softcap=softcap, sinks=sinks, span_last=span_last,
    )  # fmt: skip
    ref = ref_prefill_attention(
        q, k_cache, v_cache, tables, starts.to(device), lens, scale, window=window,
        softcap=softcap, sinks=sinks, span_last=span_last,
    )  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches(out, ref)
    if sinks is not None:  # the sinks changed the result (the reference's own tests say how)
        args = (q, k_cache, v_cache, tables, starts.to(device), lens, scale)
        plain = ref_prefill_attention(*args, window=window, softcap=softcap)
        assert not torch.allclose(ref.float(), plain.float(), atol=1e-2)


# every group and dtype with the small tiles; the unpacked ones (one head a tile: slow under
# the interpreter) with one head and with a group of 4
@pytest.mark.parametrize(
    ("tiles", "group", "dtype"),
    [(SMALL_TILES, g, d) for g in (1, 4, 8) for d in (torch.float32, torch.bfloat16)]
    + [(UNPACKED, 1, torch.float32), (UNPACKED, 4, torch.bfloat16)],
)
def test_pure_prefill_of_different_lengths(
    dtype: torch.dtype, group: int, tiles: triton_prefill.Tiles, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:  # fmt: skip
    lens = [1, 16, 17, 33]  # one token, exactly one block, one past it, several tiles
    run_case(lens, lens, group, dtype, gen, device, tiles=tiles)


@pytest.mark.parametrize("group", [3, 6, 32])
def test_groups_that_do_not_divide_the_tile(group: int, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # 16 rows hold 5 tokens of 3 heads (one padding row) or 2 tokens of 6 (four); a group of 32
    # does not fit 16 rows and runs one head per tile
    run_case([23, 40], [23, 9], group, torch.float32, gen, device, kv_heads=1)


@pytest.mark.parametrize(("head_dim", "tiles"), [(64, (32, 32, 4, 2, True)), (80, SMALL_TILES), (128, (64, 32, 4, 2, True)), (128, (256, 64, 16, 2, True))])  # fmt: skip
def test_model_head_dims_after_a_prefix(head_dim: int, tiles: triton_prefill.Tiles, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # a prompt over several tiles of 4-head groups, and a chunk after a prefix
    run_case([37, 70], [37, 30], 4, torch.bfloat16, gen, device, head_dim=head_dim, tiles=tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [SMALL_TILES, UNPACKED])
def test_long_prefix_short_chunk(dtype: torch.dtype, tiles: triton_prefill.Tiles, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case([100], [5], 4, dtype, gen, device, tiles=tiles)


# each kernel variant alone and all together: 16-key tiles of two 8-key blocks (block_reads and
# narrow addressing apply), and 32-key blocks that a 16-key tile does not span (they fall back to
# per-key addressing); the unmasked loop runs for the 70-token prompt and the chunk after its prefix
KNOBS = ("narrow", "block_reads", "k_transposed")


@pytest.mark.parametrize(
    ("knobs", "block_size", "dtype"),
    [((k,), 8, torch.float32) for k in KNOBS]
    + [(KNOBS, 8, torch.float32), (KNOBS, 8, torch.bfloat16), (KNOBS, 32, torch.float32)],
)
def test_kernel_variants_match_the_reference(knobs: tuple[str, ...], block_size: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    tiles = Tiles(32, 16, 4, 1, True)._replace(**dict.fromkeys(knobs, True))
    run_case([37, 70], [37, 30], 4, dtype, gen, device, block_size=block_size, tiles=tiles)


def test_unpacked_variants_match_the_reference(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    tiles = Tiles(16, 16, 4, 1, False, narrow=True, block_reads=True, k_transposed=True)
    run_case([100, 9], [5, 9], 2, torch.float32, gen, device, block_size=8, tiles=tiles)


def test_chunks_after_prefixes_mixed_with_decode_tokens(
    gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:  # fmt: skip
    # chunk ending on a block boundary, a decode-like single token, a chunk crossing blocks
    run_case([32, 57, 90, 20], [16, 1, 37, 20], 4, torch.float32, gen, device, block_size=8)


def test_sequence_with_no_new_tokens_is_skipped(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case([12, 30, 9], [12, 0, 3], 1, torch.float32, gen, device)


@pytest.mark.parametrize(("block_size", "head_dim"), [(8, 16), (32, 64)])
def test_default_tiles(block_size: int, head_dim: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    run_case([70, 9], [70, 4], 2, torch.float32, gen, device, block_size=block_size, head_dim=head_dim, tiles=None)  # fmt: skip


def test_non_power_of_two_head_dim(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case([25, 40], [25, 7], 2, torch.float32, gen, device, head_dim=24)


def test_many_sequences_find_their_tiles(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # 21 sequences (not a power of two) of mixed lengths: every tile's binary search for its
    # sequence, single-token rows among chunks, empty-prefix prompts and chunks after prefixes
    lens = [int(x) for x in torch.randint(1, 40, (21,), generator=gen)]
    new = [n if i % 3 else max(1, n // 4) for i, n in enumerate(lens)]
    run_case(lens, new, 4, torch.float32, gen, device)


def test_writes_into_the_given_out_and_nothing_else(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    ctx = [20, 9]  # 4 new tokens after a 16-token prefix, then a whole 9-token prompt
    k_cache, v_cache, tables = paged_kv(ctx, 8, 2, 16, torch.float32, gen, device)
    qsl = torch.tensor([0, 4, 13], dtype=torch.int32, device=device)
    q = rand((13, 4, 16), torch.float32, gen, device)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    big = torch.full((15, 4, 16), 7.0, device=device)
    got = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 0.25, out=big[2:])
    assert got.data_ptr() == big[2:].data_ptr()
    assert_matches(big[2:], ref_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 0.25))
    assert bool((big[:2] == 7.0).all())
    with pytest.raises(ValueError, match="out has shape"):
        prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 0.25, out=big)


def new_kv_case(
    ctx_lens: list[int],
    q_lens: list[int],
    dtype: torch.dtype,
    gen: torch.Generator,
    device: torch.device,
    tiles: triton_prefill.TilesLike | None,
    *,
    block_size: int = 8,
    head_dim: int = 32,
    group: int = 4,
    tma: bool | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    span_last: torch.Tensor | None = None,
) -> None:
    """The chunk's keys read from ``k_new``/``v_new`` (strided views of one qkv-like buffer):
    the cache's slots for the new tokens are overwritten with NaN first, so reading them there
    fails the check; the result must equal the reference over the untouched cache."""
    kv_heads = 2
    k_cache, v_cache, tables = paged_kv(ctx_lens, block_size, kv_heads, head_dim, dtype, gen, device)  # fmt: skip
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    t = int(starts[-1])
    q = rand((t, kv_heads * group, head_dim), dtype, gen, device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    qsl = starts.to(device)
    cap = {"window": window, "softcap": softcap, "sinks": sinks, "span_last": span_last}
    want = ref_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, head_dim**-0.5, **cap)
    qkv = torch.empty((t, 3 * kv_heads, head_dim), dtype=dtype, device=device)
    k_new, v_new = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    for b, (n, m) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        s = int(starts[b])
        for i, pos in enumerate(range(n - m, n)):
            blk, off = int(tables[b, pos // block_size]), pos % block_size
            k_new[s + i], v_new[s + i] = k_cache[blk, off], v_cache[blk, off]
            k_cache[blk, off] = float("nan")
            v_cache[blk, off] = float("nan")
    args = (q, k_cache, v_cache, tables, qsl, lens, head_dim**-0.5)
    got = prefill_attention(*args, tiles=tiles, k_new=k_new, v_new=v_new, tma=tma, **cap)
    assert_matches(got, want)
    if ctx_lens == q_lens:  # whole prompts: the caller may say so, and the paged loops go
        whole = prefill_attention(*args, tiles=tiles, k_new=k_new, v_new=v_new, tma=tma, no_prefix=True, **cap)  # fmt: skip
        assert_matches(whole, want)
    assert_matches(ref_prefill_attention(*args, k_new=k_new, v_new=v_new, **cap), want)


# each tiling in float32, the small tiles in bf16 too
@pytest.mark.parametrize(
    ("tiles", "dtype"),
    [(SMALL_TILES, torch.float32), (SMALL_TILES, torch.bfloat16), (UNPACKED, torch.float32),
     (Tiles(32, 16, 4, 1, True, narrow=True, block_reads=True, k_transposed=True), torch.float32)],
)  # fmt: skip
def test_new_tokens_read_from_contiguous_kv(dtype: torch.dtype, tiles: Tiles, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # whole prompts (1 token, one block, several tiles), a chunk after a prefix that ends inside
    # a key tile, one after a prefix on a tile boundary, a single token after a prefix
    run_lens = ([1, 16, 17, 40, 45, 32, 21], [1, 16, 17, 40, 7, 16, 1])
    new_kv_case(*run_lens, dtype, gen, device, tiles)


# (one head per tile, UNPACKED, reads as the others through a descriptor: left out for the
# suite's time, as in the windowed case below)
@pytest.mark.parametrize("tiles", [SMALL_TILES, Tiles(32, 16, 4, 2, True)])
def test_new_kv_through_tma_descriptors(tiles: Tiles, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    new_kv_case([1, 16, 17, 40, 45, 21], [1, 16, 17, 40, 7, 1], torch.float32, gen, device, tiles, tma=True)  # fmt: skip
    new_kv_case([40, 33], [40, 33], torch.bfloat16, gen, device, tiles, tma=True)


def test_new_kv_with_the_default_tiles_and_wide_heads(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    new_kv_case([70, 9, 100], [70, 4, 33], torch.bfloat16, gen, device, None, head_dim=128, block_size=16)  # fmt: skip
    # whole prompts: with no_prefix the whole-prompt tiles run (and TMA where forced)
    new_kv_case([70, 9, 33], [70, 9, 33], torch.bfloat16, gen, device, None, head_dim=128, block_size=16)  # fmt: skip
    new_kv_case([70, 9, 33], [70, 9, 33], torch.bfloat16, gen, device, None, head_dim=128, block_size=16, tma=True)  # fmt: skip


@pytest.mark.parametrize("tma", [False, True])
def test_an_inf_in_one_prompt_stays_in_that_prompt(tma: bool, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    # the last tile of prompt 0 spans into prompt 1's rows: their values must not reach it
    k_cache, v_cache, tables = paged_kv([20, 12], 8, 2, 32, torch.float32, gen, device)
    qsl = torch.tensor([0, 20, 32], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 12], dtype=torch.int32, device=device)
    q = rand((32, 8, 32), torch.float32, gen, device)
    k_new, v_new = rand((32, 2, 32), torch.float32, gen, device), rand((32, 2, 32), torch.float32, gen, device)  # fmt: skip
    want = ref_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 0.2, k_new=k_new, v_new=v_new)  # fmt: skip
    v_new[21], k_new[22] = float("inf"), float("nan")
    got = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 0.2, k_new=k_new, v_new=v_new, no_prefix=True, tma=tma, tiles=Tiles(32, 16, 4, 1, True))  # fmt: skip
    assert_matches(got[:20], want[:20])


def test_a_layout_a_descriptor_cannot_read_falls_back_to_plain_loads(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    # heads interleaved with other data (stride(1) = 2 * D): TMA asked, plain loads run
    k_cache, v_cache, tables = paged_kv([24], 8, 2, 32, torch.float32, gen, device)
    qsl = torch.tensor([0, 24], dtype=torch.int32, device=device)
    lens = torch.tensor([24], dtype=torch.int32, device=device)
    q = rand((24, 8, 32), torch.float32, gen, device)
    wide = rand((24, 4, 32), torch.float32, gen, device)
    k_new, v_new = wide[:, 0::2], wide[:, 1::2]
    want = ref_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 0.2, k_new=k_new, v_new=v_new)  # fmt: skip
    got = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 0.2, k_new=k_new, v_new=v_new, no_prefix=True, tma=True)  # fmt: skip
    assert_matches(got, want)


def test_the_reference_refuses_no_prefix_for_a_chunk_after_a_prefix(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    k_cache, v_cache, tables = paged_kv([20, 9], 8, 2, 16, torch.float32, gen, device)
    qsl = torch.tensor([0, 4, 13], dtype=torch.int32, device=device)
    q = rand((13, 4, 16), torch.float32, gen, device)
    lens = torch.tensor([20, 9], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="no_prefix, but sequence 0 has 16 cached tokens"):
        ref_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, 0.25, no_prefix=True)


# sliding windows (transformers' definition: position p sees keys p - window < j <= p): whole
# prompts of 1, 16, 17 and 40 tokens, a 20-token chunk after an 80-token prefix (longer than
# most windows), a decode-like token after 56 and a 9-token chunk after 21. Windows: each query sees
# only itself (1), narrower than a key tile (5), exactly one (16), a multiple of neither the tile
# nor the block (23), wide enough that tiles between the window's edge and the diagonal need no
# mask (40), and wider than every context (the same as none)
WINDOW_CTX, WINDOW_NEW = [1, 16, 17, 40, 100, 57, 30], [1, 16, 17, 40, 20, 1, 9]
WINDOWS = [1, 5, 16, 23, 40, 1000]
WINDOW_KNOBS = Tiles(32, 16, 4, 1, True, narrow=True, block_reads=True, k_transposed=True)


# every window but the one wider than every context (the tests after take it) with the small
# tiles; the unpacked ones (slower under the interpreter) with the window narrower than a tile
@pytest.mark.parametrize(
    ("tiles", "window"), [(SMALL_TILES, w) for w in WINDOWS[:-1]] + [(UNPACKED, 5)]
)
def test_sliding_window_matches_the_reference(window: int, tiles: triton_prefill.Tiles, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case(WINDOW_CTX, WINDOW_NEW, 4, torch.float32, gen, device, tiles=tiles, window=window)


@pytest.mark.parametrize(("group", "kv_heads", "dtype"), [(1, 2, torch.float32), (3, 1, torch.float32), (8, 2, torch.bfloat16)])  # fmt: skip
def test_sliding_window_of_other_groups(group: int, kv_heads: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # one head per row, 5 tokens of 3 heads (a padding row), 2 tokens of 8 heads
    run_case(WINDOW_CTX, WINDOW_NEW, group, dtype, gen, device, kv_heads=kv_heads, window=23)


# 32 tokens a tile over 16-key tiles: with a narrow window the tile's later rows see no key of the
# first key tile it walks (the online softmax must stay NaN-free there)
@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("tiles", [Tiles(32, 16, 4, 1, False), Tiles(128, 16, 4, 1, True)])
def test_sliding_window_narrower_than_a_tile_of_queries(window: int, tiles: Tiles, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case([70, 45], [70, 38], 4, torch.float32, gen, device, tiles=tiles, window=window)


@pytest.mark.parametrize(
    ("knobs", "block_size", "window", "dtype"),
    [(KNOBS, 8, 5, torch.float32), (KNOBS, 8, 23, torch.float32), (KNOBS, 8, 23, torch.bfloat16)]
    + [((k,), 8, 9, torch.float32) for k in KNOBS]
    + [(KNOBS, 32, 23, torch.float32)],
)
def test_sliding_window_kernel_variants(knobs: tuple[str, ...], block_size: int, window: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    tiles = Tiles(32, 16, 4, 1, True)._replace(**dict.fromkeys(knobs, True))
    run_case(WINDOW_CTX, WINDOW_NEW, 4, dtype, gen, device, block_size=block_size, tiles=tiles, window=window)  # fmt: skip


def test_sliding_window_with_the_default_tiles(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # 64-key tiles, a window narrower than one, after a prefix and in a whole prompt
    run_case([150, 9], [70, 9], 2, torch.float32, gen, device, head_dim=16, tiles=None, window=20)
    new_kv_case([150, 9], [70, 9], torch.float32, gen, device, None, head_dim=16, window=20)
    new_kv_case([90, 9], [90, 9], torch.float32, gen, device, None, head_dim=16, window=20)


# the windows that take each branch (one key, narrower than a tile, wider than a key tile,
# none at all) with the knobs on, the small tiles and the unpacked ones (one head a tile)
@pytest.mark.parametrize(
    ("tiles", "window"),
    [(WINDOW_KNOBS, w) for w in (1, 5, 1000)]
    + [(SMALL_TILES, 1), (SMALL_TILES, 40), (UNPACKED, 5)],
)
def test_sliding_window_with_contiguous_new_kv(window: int, tiles: Tiles, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # the unpacked tiles run a program per query head: two heads a KV head take the same
    # per-head path as four, with half the programs (the suite's time)
    group = 2 if tiles == UNPACKED else 4
    new_kv_case(WINDOW_CTX, WINDOW_NEW, torch.float32, gen, device, tiles, window=window, group=group)  # fmt: skip
    # whole prompts: with no_prefix too
    new_kv_case(WINDOW_NEW[:4], WINDOW_NEW[:4], torch.float32, gen, device, tiles, window=window, group=group)  # fmt: skip


@pytest.mark.parametrize("tiles", [SMALL_TILES, Tiles(32, 16, 4, 2, True)])
def test_sliding_window_through_tma_descriptors(tiles: Tiles, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    new_kv_case(WINDOW_CTX, WINDOW_NEW, torch.float32, gen, device, tiles, tma=True, window=5)
    new_kv_case([40, 33], [40, 33], torch.bfloat16, gen, device, tiles, tma=True, window=23)


@pytest.mark.parametrize("contig", [False, True])
@pytest.mark.parametrize("tiles", [SMALL_TILES, UNPACKED, WINDOW_KNOBS])
def test_keys_below_every_window_are_never_read(contig: bool, tiles: Tiles, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    # a 20-token chunk after an 80-token prefix (longer than the window of 24): the first query
    # (position 80) sees keys 57 ..= 80, so no tile reads below 48 (57 rounded down to a 16-key
    # tile); NaN in the blocks before must not reach the output
    k_cache, v_cache, tables = paged_kv([100], 8, 2, 32, torch.float32, gen, device)
    qsl = torch.tensor([0, 20], dtype=torch.int32, device=device)
    lens = torch.tensor([100], dtype=torch.int32, device=device)
    q = rand((20, 8, 32), torch.float32, gen, device)
    args = (q, k_cache, v_cache, tables, qsl, lens, 0.2)
    want = ref_prefill_attention(*args, window=24)
    new = {}
    if contig:  # positions 80 ..< 100: blocks 10 ..= 12
        blocks = tables[0, 10:13].long()
        new = {"k_new": k_cache[blocks].flatten(0, 1)[:20].clone(), "v_new": v_cache[blocks].flatten(0, 1)[:20].clone()}  # fmt: skip
    below = tables[0, : 48 // 8].long()
    k_cache[below], v_cache[below] = float("nan"), float("nan")
    got = prefill_attention(*args, tiles=tiles, window=24, **new)
    assert_matches(got, want)


class TestErrors:
    def inputs(self, device: torch.device, gen: torch.Generator) -> dict:
        k_cache, v_cache, tables = paged_kv([5, 9], 8, 2, 16, torch.float32, gen, device)
        return {
            "q": rand((7, 4, 16), torch.float32, gen, device),
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_tables": tables,
            "query_start_loc": torch.tensor([0, 5, 7], dtype=torch.int32, device=device),
            "context_lens": torch.tensor([5, 9], dtype=torch.int32, device=device),
            "scale": 0.25,
        }

    def test_query_start_loc_length(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["query_start_loc"] = torch.tensor([0, 7], dtype=torch.int32)
        with pytest.raises(ValueError, match="query_start_loc needs 3 entries"):
            prefill_attention(**args)

    def test_float_index_tensor(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["block_tables"] = args["block_tables"].float()
        with pytest.raises(ValueError, match="block_tables has dtype"):
            prefill_attention(**args)

    def test_cache_shapes_differ(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["v_cache"] = args["v_cache"][:, :4]
        with pytest.raises(ValueError, match="differ in shape"):
            prefill_attention(**args)

    def test_scale_not_positive(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["scale"] = -0.25
        with pytest.raises(ValueError, match="scale must be positive"):
            prefill_attention(**args)

    def test_window_negative(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        with pytest.raises(ValueError, match="window must be >= 0"):
            prefill_attention(**args, window=-1)
        with pytest.raises(ValueError, match="window must be >= 0"):
            ref_prefill_attention(**args, window=-1)

    def test_sinks_one_per_query_head_contiguous(
        self, device: torch.device, gen: torch.Generator
    ) -> None:
        args = self.inputs(device, gen)  # 4 query heads
        with pytest.raises(ValueError, match=r"sinks has shape \(1, 4\); expected"):
            prefill_attention(**args, sinks=torch.zeros(1, 4, device=device))
        with pytest.raises(ValueError, match="sinks must be contiguous"):
            prefill_attention(**args, sinks=torch.zeros(8, device=device)[::2])

    def test_new_kv_must_come_in_pairs_and_fit(self, device: torch.device, gen: torch.Generator) -> None:  # fmt: skip
        args = self.inputs(device, gen)
        k_new = rand((7, 2, 16), torch.float32, gen, device)
        with pytest.raises(ValueError, match="k_new and v_new go together"):
            prefill_attention(**args, k_new=k_new)
        with pytest.raises(ValueError, match=r"v_new \(7, 1, 16\) must be \[T, Hkv, D\]"):
            prefill_attention(**args, k_new=k_new, v_new=k_new[:, :1])
        with pytest.raises(ValueError, match=r"v_new must be torch\.float32 on .*, like q"):
            prefill_attention(**args, k_new=k_new, v_new=k_new.to(torch.bfloat16))

    def test_new_kv_refuses_an_fp8_cache(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["k_cache"] = args["k_cache"].to(torch.float8_e4m3fn)
        args["v_cache"] = args["v_cache"].to(torch.float8_e4m3fn)
        k_new = rand((7, 2, 16), torch.float32, gen, device)
        with pytest.raises(ValueError, match="needs a cache of q's dtype"):
            prefill_attention(**args, k_new=k_new, v_new=k_new)

    def test_head_counts_not_divisible(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["q"] = rand((7, 5, 16), torch.float32, gen, device)
        with pytest.raises(ValueError, match="multiple of KV heads"):
            prefill_attention(**args)


@pytest.mark.gpu
@pytest.mark.parametrize(("ctx_lens", "q_lens"), [([1024, 1000, 3], [1024, 1000, 3]), ([4096 + 512], [512]), ([1024] * 4 + [77], [1024] * 4 + [77])])  # fmt: skip
def test_gpu_llama_shapes(ctx_lens: list[int], q_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    run_case(ctx_lens, q_lens, 4, torch.bfloat16, gen, torch.device("cuda"), head_dim=128, kv_heads=8, tiles=None)  # fmt: skip
    new_kv_case(ctx_lens, q_lens, torch.bfloat16, gen, torch.device("cuda"), None, head_dim=128, block_size=16)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("ctx_lens", "q_lens", "window"), [([1024, 1000, 3], [1024, 1000, 3], 256), ([4096 + 512], [512], 4096), ([4096 + 512], [512], 1000), ([5000, 77], [5000, 77], 4096)])  # fmt: skip
def test_gpu_sliding_window_shapes(ctx_lens: list[int], q_lens: list[int], window: int) -> None:
    # Mistral's 4096 and narrower windows; the whole prompts of over TMA_MIN_TOKENS read k_new
    # through TMA descriptors
    gen = torch.Generator().manual_seed(0)
    cuda = torch.device("cuda")
    run_case(ctx_lens, q_lens, 4, torch.bfloat16, gen, cuda, head_dim=128, kv_heads=8, tiles=None, window=window)  # fmt: skip
    new_kv_case(ctx_lens, q_lens, torch.bfloat16, gen, cuda, None, head_dim=128, block_size=16, window=window)  # fmt: skip


@pytest.mark.gpu
def test_gpu_window_sizes_share_one_compiled_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    cuda = torch.device("cuda")
    kernels = triton_prefill._prefill_kernel.device_caches[torch.cuda.current_device()][0]
    run_case([300, 40], [100, 40], 4, torch.bfloat16, gen, cuda, tiles=None, window=1)
    compiled = len(kernels)
    for window in (5, 16, 64, 4096, 2**40):
        run_case([300, 40], [100, 40], 4, torch.bfloat16, gen, cuda, tiles=None, window=window)
    assert len(kernels) == compiled


@pytest.mark.parametrize("smem_kib", [99, 163, 227])  # Ada, A100, H100
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tiles_fit_shared_memory(smem_kib: int, dtype: torch.dtype, head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(triton_prefill, "max_shared_memory", lambda device: smem_kib * 1024)
    tiles = triton_prefill.default_tiles(head_dim, dtype, torch.device("cpu"))
    elem = torch.finfo(dtype).bits // 8
    assert (
        tiles.num_stages * 2 * tiles.block_n + tiles.block_m
    ) * head_dim * elem <= smem_kib * 1024
    if smem_kib == 227 and dtype == torch.bfloat16 and head_dim == 128:
        assert tiles == triton_prefill.TILE_CHOICES[0]  # the tuned H100 choice


LARGE = triton_prefill.LARGE_TILES[0][0]


@pytest.mark.parametrize(
    ("q_lens", "expected"),
    [
        ([1024] * 8, LARGE),  # 8 prompts of 1024: 1024 programs of 256 rows for 132 SMs
        ([512], TILE_CHOICES[0]),  # one 512-token chunk: 64 programs of 256 rows, too few
        ([1] * 64, TILE_CHOICES[0]),  # single tokens: mostly empty tiles, whatever their count
        ([4096, 1], LARGE),  # one long prompt beside a decode-like row
    ],
)
def test_step_tiles_follow_the_grid(q_lens: list[int], expected: Tiles) -> None:
    # Llama-8B heads (32 query heads in groups of 4) on an H100's 132 SMs
    got = choose_tiles(sum(q_lens), 32, 4, sms=132, fits=lambda t: True)
    assert got == expected


def test_step_tiles_take_the_large_tiles_from_two_programs_per_sm() -> None:
    per_sm = triton_prefill.LARGE_TILES[0][1]
    # 64 tokens (of 4 heads) per 256-row tile, times 8 head sets
    tokens = int(per_sm * 132 // 8) * 64
    assert choose_tiles(tokens, 32, 4, 132, lambda t: True) == LARGE
    assert choose_tiles(tokens - 64, 32, 4, 132, lambda t: True) == TILE_CHOICES[0]


def test_step_tiles_respect_shared_memory() -> None:
    # a device whose shared memory holds only 64-key tiles of 32 rows or fewer
    def small(t: Tiles) -> bool:
        return t.block_m <= 32

    assert choose_tiles(8192, 32, 4, 132, small) == Tiles(32, 32, 4, 2, True)
    assert TILE_CHOICES[0].block_m > 32


def test_tiles_print_as_code() -> None:
    assert Tiles(64, 64, 4, 3, True).code() == "Tiles(64, 64, 4, 3, True)"
    tiles = Tiles(256, 64, 16, 2, True, narrow=True, k_transposed=True)
    assert tiles.code() == "Tiles(256, 64, 16, 2, True, narrow=True, k_transposed=True)"
    assert eval(tiles.code(), {"Tiles": Tiles}) == tiles


# Gemma 2's soft-capped scores (a cap of 1.5 binds on these unit-variance scores): through the
# block table with the small tiles and with every knob and a window, from the contiguous new
# K/V (a chunk after a prefix, and whole prompts), in bf16 too
@pytest.mark.parametrize(
    ("tiles", "window", "dtype"),
    [(SMALL_TILES, 0, torch.float32), (WINDOW_KNOBS, 23, torch.float32), (SMALL_TILES, 0, torch.bfloat16)],
)  # fmt: skip
def test_soft_capped_scores_match_the_reference(tiles: Tiles, window: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case([40, 57, 9], [40, 20, 9], 4, dtype, gen, device, tiles=tiles, window=window, softcap=1.5)  # fmt: skip
    new_kv_case([45, 21], [7, 21], dtype, gen, device, tiles, window=window, softcap=1.5)
    new_kv_case([33, 9], [33, 9], dtype, gen, device, tiles, window=window, softcap=1.5)


# gpt-oss's attention sinks, from far below the scores to far above (each row of a packed tile
# loads its own head's): through the block table (whole prompts, a chunk after a prefix) and
# from the contiguous new K/V (a chunk after a prefix, whole prompts also with no_prefix); the
# small tiles (4 tokens of 4 heads), and every knob with a window and a soft cap (the sinks are
# not capped) in bf16, the sinks in bf16 too
@pytest.mark.parametrize(
    ("tiles", "window", "softcap", "dtype"),
    [(SMALL_TILES, 0, 0.0, torch.float32), (WINDOW_KNOBS, 23, 1.5, torch.bfloat16)],
)
def test_attention_sinks_match_the_reference(tiles: Tiles, window: int, softcap: float, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    sinks = torch.linspace(-2.0, 4.0, 8, device=device).to(dtype)  # 2 KV heads x 4
    cap = {"window": window, "softcap": softcap, "sinks": sinks}
    run_case([40, 57, 9], [40, 20, 9], 4, dtype, gen, device, tiles=tiles, **cap)
    new_kv_case([45, 21], [7, 21], dtype, gen, device, tiles, **cap)
    new_kv_case([33, 9], [33, 9], dtype, gen, device, tiles, **cap)


@pytest.mark.gpu
@pytest.mark.parametrize(("ctx_lens", "q_lens", "window"), [([1024, 1000, 3], [1024, 1000, 3], 128), ([4096 + 512], [512], 128), ([5000, 77], [5000, 77], 0)])  # fmt: skip
def test_gpu_attention_sinks_gpt_oss_shapes(ctx_lens: list[int], q_lens: list[int], window: int) -> None:  # fmt: skip
    # gpt-oss-20b's heads (64 query heads over 8 KV heads of 64 dims) and its sliding layers'
    # 128-key window; the whole prompts of over TMA_MIN_TOKENS read k_new through TMA descriptors
    gen, cuda = torch.Generator().manual_seed(0), torch.device("cuda")
    sinks = torch.linspace(-2.0, 10.0, 64, device=cuda).bfloat16()
    run_case(ctx_lens, q_lens, 8, torch.bfloat16, gen, cuda, head_dim=64, kv_heads=8, tiles=None, window=window, sinks=sinks)  # fmt: skip
    new_kv_case(ctx_lens, q_lens, torch.bfloat16, gen, cuda, None, head_dim=64, block_size=16, group=8, window=window, sinks=sinks[:16])  # fmt: skip


def latent_case(
    ctx_lens: list[int], q_lens: list[int], group: int, dtype: torch.dtype,
    gen: torch.Generator, device: torch.device, tiles: triton_prefill.TilesLike | None,
) -> None:  # fmt: skip
    """DeepSeek's latent cache (``models.deepseek``): one KV head of 576 dims, one tensor given
    as the keys and the values; the chunks' own rows read from the cache and, for whole prompts
    (``no_prefix``), from one new-rows tensor given as ``k_new`` and ``v_new``."""
    cache, _, tables = paged_kv(ctx_lens, 16, 1, 576, dtype, gen, device)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    q = rand((int(starts[-1]), group, 576), dtype, gen, device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    args = (q, cache, cache, tables, starts, lens, 0.05)
    want = ref_prefill_attention(*args)
    assert_matches(prefill_attention(*args, tiles=tiles), want)
    if ctx_lens == q_lens:  # whole prompts: their rows also contiguous
        rows = torch.cat([
            cache[tables[b, : (n + 15) // 16].long()].flatten(0, 1)[:n]
            for b, n in enumerate(ctx_lens)
        ])  # fmt: skip
        got = prefill_attention(*args, tiles=tiles, k_new=rows, v_new=rows, no_prefix=True)
        assert_matches(got, want)


@pytest.mark.parametrize(
    ("ctx_lens", "q_lens", "group", "dtype", "tiles"),
    [([9, 40], [9, 40], 16, torch.float32, SMALL_TILES),
     ([30, 17], [5, 17], 16, torch.bfloat16, None),
     ([20], [3], 128, torch.float32, None)],
)  # fmt: skip
def test_one_latent_head_read_as_keys_and_values(
    ctx_lens: list[int], q_lens: list[int], group: int, dtype: torch.dtype,
    tiles: triton_prefill.TilesLike | None, gen: torch.Generator, device: torch.device,
    poison_empty: None,
) -> None:  # fmt: skip
    latent_case(ctx_lens, q_lens, group, dtype, gen, device, tiles)


@pytest.mark.gpu
@pytest.mark.parametrize(("ctx_lens", "q_lens"), [([700, 33], [700, 33]), ([2048 + 512], [512])])
def test_gpu_deepseek_latent_shapes(ctx_lens: list[int], q_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    latent_case(ctx_lens, q_lens, 128, torch.bfloat16, gen, torch.device("cuda"), None)


# Gemma 3's images: an image's tokens see each other both ways (span_last: each row's last key,
# its image's last token). Sequences: a whole prompt with an image of 10 tokens across several
# 4-token query tiles, starting mid-tile; a chunk after a 37-token prefix whose image starts the
# chunk; a chunk ending with its image; two images in one chunk (one of a single token); a
# sequence with none; a decode-like token. (start, length) in sequence positions.
SPAN_CTX, SPAN_NEW = [30, 60, 25, 40, 18, 33], [30, 23, 25, 40, 18, 1]
SPAN_IMAGES = [[(3, 10)], [(37, 17)], [(15, 10)], [(2, 1), (20, 16)], [], []]


def span_rows(
    ctx_lens: list[int], q_lens: list[int], images: list[list[tuple[int, int]]],
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """[T] int32: each new token's image's last position, 0 for a text token."""
    rows = []
    for n, m, imgs in zip(ctx_lens, q_lens, images, strict=True):
        for p in range(n - m, n):
            rows.append(next((o + k - 1 for o, k in imgs if o <= p < o + k), 0))
    return torch.tensor(rows, dtype=torch.int32, device=device)


@pytest.mark.parametrize(
    ("tiles", "window", "dtype", "group"),
    [(SMALL_TILES, 0, torch.float32, 4), (SMALL_TILES, 0, torch.bfloat16, 4),
     (SMALL_TILES, 5, torch.float32, 4), (SMALL_TILES, 23, torch.float32, 1),
     (UNPACKED, 0, torch.float32, 2), (WINDOW_KNOBS, 5, torch.float32, 4),
     (Tiles(128, 16, 4, 1, True), 0, torch.float32, 4)],
)  # fmt: skip
def test_image_spans_match_the_reference(tiles: Tiles, window: int, dtype: torch.dtype, group: int, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    spans = span_rows(SPAN_CTX, SPAN_NEW, SPAN_IMAGES, device)
    run_case(SPAN_CTX, SPAN_NEW, group, dtype, gen, device, tiles=tiles, window=window,
             span_last=spans)  # fmt: skip


@pytest.mark.parametrize(
    ("tiles", "window", "tma"),
    [(SMALL_TILES, 0, False), (WINDOW_KNOBS, 5, False), (SMALL_TILES, 0, True),
     (UNPACKED, 23, False)],
)  # fmt: skip
def test_image_spans_with_contiguous_new_kv(tiles: Tiles, window: int, tma: bool, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    spans = span_rows(SPAN_CTX, SPAN_NEW, SPAN_IMAGES, device)
    # the unpacked tiles (a program per query head) with two heads a KV head: their per-head
    # path, half the programs of four (the suite's time)
    group = 2 if tiles == UNPACKED else 4
    new_kv_case(SPAN_CTX, SPAN_NEW, torch.float32, gen, device, tiles, window=window, tma=tma,
                span_last=spans, group=group)  # fmt: skip
    whole = [0, 2, 3, 4]  # whole prompts (no_prefix too)
    ctx = [SPAN_CTX[i] for i in whole]
    spans = span_rows(ctx, ctx, [SPAN_IMAGES[i] for i in whole], device)
    new_kv_case(ctx, ctx, torch.float32, gen, device, tiles, window=window, tma=tma,
                span_last=spans, group=group)  # fmt: skip


def test_image_spans_with_the_default_tiles(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # 64-key tiles: a 70-token image across the diagonal tiles after a 100-token prefix
    ctx, new, images = [170, 90], [70, 90], [[(100, 70)], [(10, 64)]]
    spans = span_rows(ctx, new, images, device)
    run_case(ctx, new, 2, torch.float32, gen, device, head_dim=16, tiles=None, span_last=spans)
    new_kv_case(ctx, new, torch.float32, gen, device, None, head_dim=16, span_last=spans)


def test_image_spans_change_the_result_and_are_checked(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    # the spans are not a no-op: an image's first token sees its last one
    k_cache, v_cache, tables = paged_kv([30], 8, 2, 16, torch.float32, gen, device)
    qsl = torch.tensor([0, 30], dtype=torch.int32, device=device)
    lens = torch.tensor([30], dtype=torch.int32, device=device)
    q = rand((30, 4, 16), torch.float32, gen, device)
    args = (q, k_cache, v_cache, tables, qsl, lens, 0.25)
    spans = span_rows([30], [30], [[(3, 10)]], device)
    got = prefill_attention(*args, tiles=SMALL_TILES, span_last=spans)
    causal = prefill_attention(*args, tiles=SMALL_TILES)
    assert not torch.allclose(got[3:12], causal[3:12], atol=1e-3)
    torch.testing.assert_close(got[12:], causal[12:])  # the image's last token and after: causal
    torch.testing.assert_close(got[:3], causal[:3])
    with pytest.raises(ValueError, match="span_last must be"):
        prefill_attention(*args, span_last=spans[:-1])
    with pytest.raises(ValueError, match="span_last must be"):
        prefill_attention(*args, span_last=spans.float())
    over = spans.clone()
    over[5] = 30  # a span past the chunk's keys: the reference refuses it
    with pytest.raises(ValueError, match="image span ends past its chunk"):
        ref_prefill_attention(*args, span_last=over)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("ctx_lens", "q_lens", "images", "window"),
    [([300, 1000], [300, 1000], [[(10, 256)], [(5, 256), (600, 256)]], 1024),
     ([1024 + 512], [512], [[(1024 + 100, 256)]], 1024),
     ([5000], [5000], [[(4700, 256)]], 1024), ([700, 9], [700, 9], [[(200, 256)], []], 0)],
)  # fmt: skip
def test_gpu_gemma3_image_span_shapes(ctx_lens: list[int], q_lens: list[int], images: list[list[tuple[int, int]]], window: int) -> None:  # fmt: skip
    # Gemma 3 4B's attention (head_dim 256, 8 query heads over 4 KV heads, bf16): 256-token
    # images in whole prompts, after a prefix, past TMA_MIN_TOKENS (TMA), with its 1024 window
    gen = torch.Generator().manual_seed(0)
    cuda = torch.device("cuda")
    spans = span_rows(ctx_lens, q_lens, images, cuda)
    run_case(ctx_lens, q_lens, 2, torch.bfloat16, gen, cuda, head_dim=256, kv_heads=4, tiles=None, window=window, span_last=spans)  # fmt: skip
    new_kv_case(ctx_lens, q_lens, torch.bfloat16, gen, cuda, None, head_dim=256, group=2, block_size=16, window=window, span_last=spans)  # fmt: skip


@pytest.mark.parametrize(
    ("head_dim", "expected"),
    [(128, triton_prefill.WHOLE_PROMPT_TILES), (80, triton_prefill.WHOLE_PROMPT_TILES),
     (192, triton_prefill.WIDE_WHOLE_PROMPT_TILES),
     (256, triton_prefill.WIDE_WHOLE_PROMPT_TILES)],
)  # fmt: skip
def test_whole_prompts_of_wide_heads_take_their_own_tiles(head_dim: int, expected: Tiles) -> None:
    # a 256-wide tile never holds 128 rows in four warps (256 accumulator registers a thread)
    tiles = triton_prefill._whole_prompt_tiles(head_dim)
    assert tiles == expected
    if head_dim > 128:  # float32 accumulator registers a thread
        assert tiles.block_m * 256 // (32 * tiles.num_warps) <= 128
    assert triton_prefill.fits_in(tiles, head_dim, torch.bfloat16, 227 * 1024)  # an H200's


def test_expanded_mla_chunks_after_a_prefix(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    # DeepSeek's chunk after a prefix in the expanded form: 192-dim heads (a padded tile), its
    # own keys from k_new, the prefix's through the block table, the default tiles
    new_kv_case([40, 33], [8, 33], torch.bfloat16, gen, device, None, head_dim=192, group=1, block_size=16)  # fmt: skip


@pytest.mark.gpu
def test_gpu_deepseek_expanded_chunk_after_a_prefix() -> None:
    gen = torch.Generator().manual_seed(0)
    new_kv_case([2048 + 512, 700], [512, 700], torch.bfloat16, gen, torch.device("cuda"), None, head_dim=192, group=1, block_size=16)  # fmt: skip
