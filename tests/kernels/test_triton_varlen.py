"""Causal attention of packed whole prompts (Triton, ``kernels.triton_varlen``) against the
reference: DeepSeek's expanded prefill (192-dim keys, 128-dim values) and other widths, split
into a power-of-two main part and a remainder."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_varlen
from kernels.attention import ref_prefill_attention, ref_varlen_attention
from kernels.triton_common import max_shared_memory, next_pow2
from kernels.triton_varlen import VarlenTiles, split_width, varlen_attention
from tests.kernels.paged import assert_matches, rand

# several query and key tiles even at tiny lengths
SMALL = VarlenTiles(16, 16, 4, 1)
# the lengths around a 16-row tile: one token, empty, one short of a tile, a tile, one past it,
# several tiles (the last ragged)
EDGES = [1, 0, 15, 16, 17, 40]


def starts_of(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)


def varlen_case(
    lens: list[int], heads: int, kv_heads: int, dim: int, v_dim: int, dtype: torch.dtype,
    gen: torch.Generator, device: torch.device, tiles: triton_varlen.VarlenTilesLike | None,
) -> None:  # fmt: skip
    """The kernel writes the reference's output into a NaN-filled ``out`` (every row of it)."""
    starts = starts_of(lens, device)
    t = sum(lens)
    q = rand((t, heads, dim), dtype, gen, device)
    k = rand((t, kv_heads, dim), dtype, gen, device)
    v = rand((t, kv_heads, v_dim), dtype, gen, device)
    want = ref_varlen_attention(q, k, v, starts, dim**-0.5)
    out = torch.full((t, heads, v_dim), float("nan"), dtype=dtype, device=device)
    got = varlen_attention(q, k, v, starts, dim**-0.5, out=out, tiles=tiles)
    assert got is out and got.shape == (t, heads, v_dim)
    assert_matches(got, want)


@pytest.mark.parametrize(
    ("dim", "v_dim", "heads", "kv_heads", "dtype"),
    [(192, 128, 2, 2, torch.float32),  # DeepSeek's expanded heads: 128 + 64, values 128
     (192, 128, 4, 2, torch.bfloat16),
     (576, 512, 1, 1, torch.bfloat16),  # its latent widths: 512 + 64
     (128, 128, 8, 1, torch.float32),  # a power of two (no remainder), a GQA group of 8
     (64, 64, 2, 1, torch.bfloat16),
     (80, 80, 2, 2, torch.float32),  # 64 + 16
     (96, 64, 2, 1, torch.bfloat16),  # 64 + 32, values narrower
     (48, 32, 2, 2, torch.float16),  # 32 + 16
     (24, 32, 4, 4, torch.bfloat16),  # 16 + 8 (a masked remainder), values wider (test models)
     (8, 8, 2, 1, torch.float32)],  # narrower than one dot's K: a masked main part
)  # fmt: skip
def test_widths_match_the_reference(
    dim: int, v_dim: int, heads: int, kv_heads: int, dtype: torch.dtype, gen: torch.Generator,
    device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    varlen_case(EDGES, heads, kv_heads, dim, v_dim, dtype, gen, device, SMALL)


@pytest.mark.parametrize(
    ("lens", "tiles"),
    [([40], SMALL),  # one sequence (no search)
     ([5], (32, 16, 4, 1)),  # one sequence shorter than a tile, rows != keys a tile
     ([0, 0, 1, 0, 15, 0, 0, 1, 33, 0], SMALL),  # empty ones around short ones: the grid bound
     ([31, 32, 33, 1], (32, 16, 4, 2)),  # around a 32-row tile
     ([17, 16, 49], (16, 32, 4, 1))],  # key tiles wider than query tiles
)  # fmt: skip
def test_sequence_layouts(
    lens: list[int], tiles: triton_varlen.VarlenTilesLike, gen: torch.Generator,
    device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    varlen_case(lens, 2, 1, 192, 128, torch.float32, gen, device, tiles)


@pytest.mark.parametrize(
    ("dim", "v_dim", "tiles"),
    [(192, 128, triton_varlen.WIDE_VARLEN_TILES), (128, 128, triton_varlen.VARLEN_TILES),
     (256, 256, triton_varlen.WIDE_VARLEN_TILES),
     (576, 512, triton_varlen.LATENT_VARLEN_TILES)],
)  # fmt: skip
def test_the_default_tiles_of_each_width(
    dim: int, v_dim: int, tiles: VarlenTiles, gen: torch.Generator, device: torch.device,
    poison_empty: None,
) -> None:  # fmt: skip
    """Each width's GPU default (the compile check compiles these launches for sm_90): one
    tile and one key past it, one short of a tile."""
    assert triton_varlen.default_tiles(dim, v_dim) == tiles
    m = tiles.block_m
    varlen_case([m + 1, m - 1], 1, 1, dim, v_dim, torch.bfloat16, gen, device, tiles)


def test_the_launcher_picks_tiles_that_fit(
    gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:
    # no tiles given: the default, or (the interpreter's small shared memory) a fallback
    cfg = triton_varlen.choose_tiles(192, 128, torch.bfloat16, device)
    assert triton_varlen.fits_in(cfg, 192, 128, torch.bfloat16, max_shared_memory(device))
    m = cfg.block_m
    varlen_case([m - 1, m + 1, 0, 3], 4, 2, 192, 128, torch.bfloat16, gen, device, None)


def test_default_tiles_fit_an_h200() -> None:
    h200 = 227 * 1024
    for d, dv in ((192, 128), (128, 128), (80, 80), (256, 256), (576, 512)):
        tiles = triton_varlen.tiles_for(d, dv, torch.bfloat16, h200)
        assert tiles == triton_varlen.default_tiles(d, dv)  # no fallback
        # float32 accumulator registers a thread: at most 128 (the padded path's 256 spilled)
        regs = tiles.block_m * max(16, next_pow2(dv)) // (32 * tiles.num_warps)
        assert regs <= 128, (d, dv, tiles)
    # float32 192 / 128: the default's two stages do not fit, the first fallback that does
    fp32 = triton_varlen.tiles_for(192, 128, torch.float32, h200)
    assert fp32 == triton_varlen.FALLBACK_TILES[1]
    assert triton_varlen.fits_in(fp32, 192, 128, torch.float32, h200)
    assert not triton_varlen.fits_in(triton_varlen.FALLBACK_TILES[0], 192, 128, torch.float32, h200)  # fmt: skip


@pytest.mark.parametrize(
    ("d", "parts"),
    [(192, (128, 64)), (576, (512, 64)), (128, (128, 0)), (80, (64, 16)), (96, (64, 32)),
     (112, (64, 64)), (24, (16, 16)), (16, (16, 0)), (8, (16, 0))],
)  # fmt: skip
def test_split_width(d: int, parts: tuple[int, int]) -> None:
    assert split_width(d) == parts


def test_strided_views_and_a_given_out(
    gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:
    """DeepSeek's callers pass slices: queries and keys cut from wider rows, keys whose rotary
    part is one row expanded over the heads (head stride 0 there, so built whole here and
    sliced), values the tail of kv_b's output, ``out`` a slice of a larger buffer; all read
    and written through their strides. A last dim with a stride is copied first."""
    lens = [17, 0, 30]
    starts = starts_of(lens, device)
    t, heads, nope, rope, v_dim = sum(lens), 4, 32, 16, 32
    dim = nope + rope
    q_rows = rand((t + 3, heads, dim + 8), torch.float32, gen, device)
    q = q_rows[3:, :, 8:]  # token stride (heads * 56), offset base
    kv = rand((t, heads, nope + v_dim), torch.float32, gen, device)
    v = kv[..., nope:]  # token and head strides of the wider rows
    k_rope = rand((t, rope), torch.float32, gen, device)
    k_wide = torch.cat([k_rope[:, None].expand(-1, heads, -1), kv[..., :nope]], dim=-1)
    k = torch.cat([k_wide, k_wide], dim=1)[:, ::2]  # head stride 2 * dim
    assert not any(x.is_contiguous() for x in (q, k, v))
    buf = torch.full((t, heads, v_dim + 16), float("nan"), device=device)
    out = buf[..., 8 : 8 + v_dim]
    want = ref_varlen_attention(q, k, v, starts, 0.3)
    got = varlen_attention(q, k, v, starts, 0.3, out=out)
    assert got is out
    assert_matches(got, want)
    assert buf[..., :8].isnan().all() and buf[..., 8 + v_dim :].isnan().all()  # nothing else
    # a key head that is a stride-0 expansion of one row, and values strided in their last dim
    k0 = k_wide[:, :1].expand(-1, heads, -1)
    v2 = torch.cat([v, v], dim=-1)[..., ::2]
    assert k0.stride(1) == 0 and v2.stride(2) == 2
    want = ref_varlen_attention(q, k0, v2, starts, 0.3)
    assert_matches(varlen_attention(q, k0, v2, starts, 0.3), want)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # prompt 1 itself: NaN
def test_an_inf_in_one_prompt_stays_in_that_prompt(
    gen: torch.Generator, device: torch.device
) -> None:
    # prompt 0's last query tile (16..31) and key tile (16..31) span into prompt 1's rows: its
    # keys and values (an inf, a NaN, in both the main and the remainder part) must not reach it
    starts = torch.tensor([0, 20, 32], dtype=torch.int32, device=device)
    q = rand((32, 2, 192), torch.float32, gen, device)
    k, v = rand((32, 2, 192), torch.float32, gen, device), rand((32, 2, 128), torch.float32, gen, device)  # fmt: skip
    want = ref_varlen_attention(q, k, v, starts, 0.1)
    v[21], k[22, :, 5], k[23, :, 150] = float("inf"), float("nan"), float("inf")
    got = varlen_attention(q, k, v, starts, 0.1, tiles=SMALL)
    assert_matches(got[:20], want[:20])


def test_nothing_to_attend(device: torch.device) -> None:
    # no tokens (with and without sequences): nothing launched, the (empty) out comes back
    for starts in ([0], [0, 0, 0]):
        s = torch.tensor(starts, dtype=torch.int32, device=device)
        q = torch.empty((0, 2, 192), device=device)
        v = torch.empty((0, 2, 128), device=device)
        got = varlen_attention(q, q, v, s, 0.1)
        assert got.shape == (0, 2, 128)


def test_varlen_reference_is_prefill_attention_over_its_own_rows(
    gen: torch.Generator, device: torch.device
) -> None:
    """The reference agrees with the paged reference given the same rows as a whole-prompt
    cache (one block a token)."""
    lens = [3, 9, 1]
    starts = torch.tensor([0, 3, 12, 13], dtype=torch.int32, device=device)
    q, k, v = (rand((13, h, 16), torch.float32, gen, device) for h in (4, 2, 2))
    tables = torch.arange(13, dtype=torch.int32, device=device)
    tables = torch.stack([torch.cat([tables[s : s + n], tables.new_full((9 - n,), -1)])
                          for s, n in zip([0, 3, 12], lens, strict=True)])  # fmt: skip
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    want = ref_prefill_attention(q, k[:, None], v[:, None], tables, starts, lens_t, 0.25)
    assert_matches(ref_varlen_attention(q, k, v, starts, 0.25), want)


def test_varlen_attention_refuses_what_does_not_fit(
    gen: torch.Generator, device: torch.device
) -> None:
    starts = torch.tensor([0, 5], dtype=torch.int32, device=device)
    q, k = (
        rand((5, 4, 16), torch.float32, gen, device),
        rand((5, 2, 16), torch.float32, gen, device),
    )
    for fn in (varlen_attention, ref_varlen_attention):
        with pytest.raises(ValueError, match="must be"):
            fn(q, k[:, :, :8], k, starts, 0.25)  # keys narrower than the queries
        with pytest.raises(ValueError, match="multiple of KV heads"):
            fn(q, k[:, :1].expand(5, 3, 16), k[:, :1].expand(5, 3, 16), starts, 0.25)
        with pytest.raises(ValueError, match="like q"):
            fn(q, k.to(torch.bfloat16), k, starts, 0.25)
        with pytest.raises(ValueError, match="out has shape"):
            fn(q, k, k[..., :8], starts, 0.25, out=torch.empty_like(q))
    with pytest.raises(ValueError, match="ends at"):
        ref_varlen_attention(q, k, k, torch.tensor([0, 4], dtype=torch.int32, device=device), 0.25)
    with pytest.raises(ValueError, match="dtype"):
        varlen_attention(q.double(), k.double(), k.double(), starts, 0.25)
    with pytest.raises(ValueError, match="power of two"):
        varlen_attention(q, k, k, starts, 0.25, tiles=(24, 16, 4, 1))
    with pytest.raises(ValueError, match="power of two"):
        varlen_attention(q, k, k, starts, 0.25, tiles=(16, 8, 4, 1))  # a dot's K below 16


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "lens"), [(16, [1024] * 4 + [77]), (128, [700, 33])])
def test_gpu_deepseek_expanded_prefill_shapes(heads: int, lens: list[int]) -> None:
    # DeepSeek-V2-Lite's 16 heads and V3's 128: 192-dim queries and keys, 128-dim values
    gen = torch.Generator().manual_seed(0)
    varlen_case(lens, heads, heads, 192, 128, torch.bfloat16, gen, torch.device("cuda"), None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes_and_widths(dtype: torch.dtype) -> None:
    # float32 takes a fallback tile (the default's stages do not fit), fp16 the default
    gen = torch.Generator().manual_seed(0)
    cuda = torch.device("cuda")
    varlen_case([1000, 1, 300], 8, 2, 192, 128, dtype, gen, cuda, None)
    varlen_case([513, 64], 4, 4, 576, 512, dtype, gen, cuda, None)
