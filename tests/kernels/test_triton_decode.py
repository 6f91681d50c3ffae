"""Paged decode attention (Triton) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_decode
from kernels.attention import ref_paged_decode_attention
from kernels.triton_decode import (
    MIN_KEYS_PER_SPLIT,
    choose_num_splits,
    default_block_n,
    paged_decode_attention,
)
from tests.kernels.paged import assert_matches, paged_kv, rand

# one token, exactly one block, one past a block boundary, and longer contexts
MIXED_LENS = [1, 16, 17, 45, 100]


def run_case(
    lens: list[int],
    group: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: torch.device,
    *,
    block_size: int = 16,
    head_dim: int = 32,
    kv_heads: int = 2,
    num_splits: int | None = None,
) -> None:
    k_cache, v_cache, tables = paged_kv(lens, block_size, kv_heads, head_dim, dtype, gen, device)
    q = rand((len(lens), kv_heads * group, head_dim), dtype, gen, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, context_lens, scale, num_splits=num_splits
    )
    ref = ref_paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_lengths_gqa_and_split_k(
    dtype: torch.dtype, group: int, num_splits: int, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:  # fmt: skip
    run_case(MIXED_LENS, group, dtype, gen, device, num_splits=num_splits)


@pytest.mark.parametrize(("block_size", "head_dim"), [(8, 16), (16, 64), (32, 32)])
def test_block_sizes_and_head_dims(
    block_size: int, head_dim: int, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:  # fmt: skip
    lens = [1, block_size, block_size + 1, 3 * block_size - 1]
    run_case(
        lens, 4, torch.float32, gen, device, block_size=block_size, head_dim=head_dim, num_splits=2
    )


def test_single_token_single_sequence(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case([1], 8, torch.bfloat16, gen, device, kv_heads=1)


def test_more_splits_than_keys_leaves_empty_splits_harmless(
    gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:  # fmt: skip
    run_case([1, 2, 70], 4, torch.float32, gen, device, num_splits=8)


def test_mqa_non_power_of_two_head_dim(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    run_case([5, 33], 6, torch.float32, gen, device, kv_heads=1, head_dim=24, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_writes_into_the_given_out_and_nothing_else(
    num_splits: int, gen: torch.Generator, device: torch.device
) -> None:
    lens = [5, 33, 17]
    k_cache, v_cache, tables = paged_kv(lens, 16, 2, 32, torch.float32, gen, device)
    q = rand((3, 8, 32), torch.float32, gen, device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    big = torch.full((5, 8, 32), 7.0, device=device)  # rows 1..3 are the output, 0 and 4 stay
    got = paged_decode_attention(
        q, k_cache, v_cache, tables, ctx, 0.2, num_splits=num_splits, out=big[1:4]
    )
    assert got.data_ptr() == big[1:4].data_ptr()
    assert_matches(big[1:4], ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2))
    assert bool((big[0] == 7.0).all() and (big[4] == 7.0).all())
    with pytest.raises(ValueError, match="out has shape"):
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, out=big[:2])


def test_split_choice_follows_batch_and_context(device: torch.device) -> None:
    assert choose_num_splits(64, 8, 4096, device) == 1  # 512 programs fill the GPU already
    assert choose_num_splits(256, 8, 512, device) == 1
    long_single = choose_num_splits(1, 8, 32768, device)
    assert 16 <= long_single <= 64
    assert choose_num_splits(1, 8, 60, device) == 1  # under one tile of keys: nothing to split
    assert choose_num_splits(1, 8, 300, device) == 300 // MIN_KEYS_PER_SPLIT  # a tile a split
    # an FP8 cache's tiles are 128 keys: no split smaller than one
    assert choose_num_splits(1, 8, 300, device, 1) == 300 // (2 * MIN_KEYS_PER_SPLIT)


@pytest.mark.parametrize("smem_kib", [99, 227])
@pytest.mark.parametrize(("block_d", "elem"), [(128, 1), (128, 2), (128, 4), (256, 4)])
def test_default_key_tile_fits_shared_memory(smem_kib: int, block_d: int, elem: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(triton_decode, "max_shared_memory", lambda device: smem_kib * 1024)
    block_n = default_block_n(block_d, elem, 2, torch.device("cpu"))
    assert 16 <= block_n <= (128 if elem == 1 else 64)
    assert 2 * 2 * block_n * block_d * elem <= smem_kib * 1024
    if block_d == 128 and elem <= 2:  # an FP8 tile holds as many bytes as a bf16 one
        assert block_n == 128 // elem


class TestErrors:
    def inputs(self, device: torch.device, gen: torch.Generator) -> dict:
        k_cache, v_cache, tables = paged_kv([5, 9], 8, 2, 16, torch.float32, gen, device)
        q = rand((2, 4, 16), torch.float32, gen, device)
        lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
        return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "context_lens": lens, "scale": 0.25}  # fmt: skip

    def test_bad_dtype(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["q"] = args["q"].to(torch.int32)
        with pytest.raises(ValueError, match="q has dtype"):
            paged_decode_attention(**args)

    def test_q_and_cache_dtype_differ(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["q"] = args["q"].bfloat16()
        with pytest.raises(ValueError, match="KV cache dtype"):
            paged_decode_attention(**args)

    def test_head_counts_not_divisible(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["q"] = rand((2, 3, 16), torch.float32, gen, device)
        with pytest.raises(ValueError, match="multiple of KV heads"):
            paged_decode_attention(**args)

    def test_head_dim_mismatch(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["q"] = rand((2, 4, 32), torch.float32, gen, device)
        with pytest.raises(ValueError, match="head_dim"):
            paged_decode_attention(**args)

    def test_non_contiguous_head_dim(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["q"] = rand((2, 16, 4), torch.float32, gen, device).transpose(1, 2)
        with pytest.raises(ValueError, match="contiguous in its last dim"):
            paged_decode_attention(**args)

    def test_batch_mismatch(self, device: torch.device, gen: torch.Generator) -> None:
        args = self.inputs(device, gen)
        args["context_lens"] = torch.tensor([5], dtype=torch.int32)
        with pytest.raises(ValueError, match="context_lens has 1 entries for 2"):
            paged_decode_attention(**args)

    def test_cpu_tensors_rejected_outside_the_interpreter(
        self, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        args = self.inputs(torch.device("cpu"), gen)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="need CUDA tensors"):
            paged_decode_attention(**args)


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "ctx"), [(4, 4096), (1, 32768), (64, 700)])
def test_gpu_llama_shapes(batch: int, ctx: int) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [ctx - 3 * i for i in range(batch)]
    run_case(lens, 4, torch.bfloat16, gen, torch.device("cuda"), head_dim=128, kv_heads=8)
