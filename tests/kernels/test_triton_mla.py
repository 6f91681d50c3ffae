"""DeepSeek's latent decode attention (Triton) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import ref_mla_decode_attention
from kernels.triton_mla import mla_decode_attention
from tests.kernels.paged import assert_matches, paged_kv, rand

# one token, exactly one block, one past a block boundary, and longer contexts
LENS = [1, 16, 17, 45, 100]


def run_case(
    lens: list[int],
    heads: int,
    rope: int,
    latent: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: torch.device,
    *,
    cache_dtype: torch.dtype | None = None,
    block_size: int = 16,
    out: bool = False,
    **knobs: int,
) -> torch.Tensor:
    cache, _, tables = paged_kv(lens, block_size, 1, rope + latent, dtype, gen, device)
    if cache_dtype is not None:  # an FP8 cache: the spare blocks stay NaN
        cache = cache.to(cache_dtype)
    q = rand((len(lens), heads, rope + latent), dtype, gen, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = (rope + latent) ** -0.5
    into = torch.full((len(lens), heads, latent), float("nan"), dtype=dtype, device=device)
    got = mla_decode_attention(
        q, cache, tables, context_lens, scale, rope, out=into if out else None, **knobs
    )
    want = ref_mla_decode_attention(q.float(), cache.float(), tables, context_lens, scale, rope).to(
        dtype
    )
    assert got.shape == (len(lens), heads, latent) and got.dtype == dtype
    assert_matches(got, want)
    if out:
        assert got.data_ptr() == into.data_ptr()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_lengths_and_split_k(
    dtype: torch.dtype, num_splits: int, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:  # fmt: skip
    """Rope and latent widths off the powers of two (8 + 24: masked columns of both tiles)."""
    run_case(LENS, 4, 8, 24, dtype, gen, device, num_splits=num_splits)


@pytest.mark.parametrize("heads", [1, 16, 20])
def test_head_blocks(heads: int, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """One head; one block of 16; 20 heads in two programs, the second one's rows past the
    heads masked."""
    run_case([5, 33], heads, 16, 32, torch.float32, gen, device, num_splits=2, out=True)


def test_deepseek_widths_fp8_cache(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """DeepSeek-V2/V3's 64 + 512 dims over an e4m3 cache (read exactly in q's dtype); the
    splits' 512 columns merged in chunks of 128."""
    run_case([3, 40], 2, 64, 512, torch.bfloat16, gen, device, num_splits=4,
             cache_dtype=torch.float8_e4m3fn, block_n=16)  # fmt: skip


def test_default_splits_and_tiles(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case([70, 2], 3, 8, 56, torch.float32, gen, device, block_size=8, block_g=32)


def test_bad_inputs_are_refused(device: torch.device) -> None:
    q = torch.zeros(2, 4, 40, device=device)
    cache = torch.zeros(3, 16, 1, 40, device=device)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="rope_dim must be in"):
        mla_decode_attention(q, cache, tables, lens, 1.0, 40)
    with pytest.raises(ValueError, match=r"must be \[N, bs, 1, 40\]"):
        mla_decode_attention(q, cache[..., :32], tables, lens, 1.0, 8)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        mla_decode_attention(q, cache, tables, lens, 1.0, 8, block_n=24)
    with pytest.raises(ValueError, match="2 rows"):
        mla_decode_attention(q, cache, tables[:1], lens, 1.0, 8)
    with pytest.raises(ValueError, match="rope_dim must be in"):
        ref_mla_decode_attention(q, cache, tables, lens, 1.0, 0)


def test_splits_fill_the_sms_once() -> None:
    """132 SMs (the interpreter's nominal count): no split once the programs fill them; else the
    power of two below two programs a SM, at least one 32-key tile a split."""
    from kernels.triton_mla import num_splits_for

    cpu = torch.device("cpu")
    assert num_splits_for(256, 1024, cpu) == 1 and num_splits_for(132, 1024, cpu) == 1
    assert num_splits_for(64, 1024, cpu) == 4 and num_splits_for(64, 64, cpu) == 2
    assert num_splits_for(1, 1024, cpu) == 32 and num_splits_for(1, 16, cpu) == 1
