"""Paged decode attention (Triton) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_decode
from kernels.attention import ref_paged_decode_attention, ref_prefill_attention
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
    half_d: bool | None = None,
    cache_dtype: torch.dtype | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    k_cache, v_cache, tables = paged_kv(lens, block_size, kv_heads, head_dim, dtype, gen, device)
    if cache_dtype is not None:  # an FP8 cache: the spare blocks stay NaN
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = rand((len(lens), kv_heads * group, head_dim), dtype, gen, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, context_lens, scale, num_splits=num_splits, half_d=half_d,
        window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    ref = ref_paged_decode_attention(
        q, k_cache, v_cache, tables, context_lens, scale, window=window, softcap=softcap,
        sinks=sinks,
    )  # fmt: skip
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_matches(out, ref)
    if sinks is not None:  # the sinks changed the result (the reference's own tests say how)
        args = (q, k_cache, v_cache, tables, context_lens, scale)
        plain = ref_paged_decode_attention(*args, window=window, softcap=softcap)
        assert not torch.allclose(ref.float(), plain.float(), atol=1e-2)
    return out


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


# the kernel's two variants, the head dim in two halves (half_d, the default from 32) and whole:
# GQA groups, split-K, head dims padded to a power of two (24, 80, 96: the high half partly
# masked) and FP8 caches, read as fp16 (bf16 queries) and in q's dtype (fp32 ones)
HALF_D_CASES = [
    (torch.float32, None, 1, 1, 32, 2),
    (torch.bfloat16, None, 4, 3, 32, 2),
    (torch.float32, None, 8, 3, 80, 2),
    (torch.bfloat16, None, 4, 1, 96, 2),
    (torch.float32, None, 6, 2, 24, 1),
    (torch.bfloat16, torch.float8_e4m3fn, 4, 1, 32, 2),
    (torch.bfloat16, torch.float8_e4m3fn, 8, 3, 80, 2),
    (torch.float32, torch.float8_e4m3fn, 4, 3, 96, 1),
]


@pytest.mark.parametrize("half_d", [True, False])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "group", "num_splits", "head_dim", "kv_heads"), HALF_D_CASES
)
def test_each_kernel_variant_matches_the_reference(
    dtype: torch.dtype, cache_dtype: torch.dtype | None, group: int, num_splits: int, head_dim: int, kv_heads: int,
    half_d: bool, gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    run_case(
        MIXED_LENS, group, dtype, gen, device, head_dim=head_dim, kv_heads=kv_heads,
        num_splits=num_splits, half_d=half_d, cache_dtype=cache_dtype,
    )  # fmt: skip


# a sliding window: one key (the query's own), fewer keys than a block, one block, more than
# some contexts, more than all of them; the splits share the window's range
@pytest.mark.parametrize("window", [1, 7, 16, 45, 1000])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_sliding_window_matches_the_reference(
    window: int, num_splits: int, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:
    run_case([*MIXED_LENS, 200], 4, torch.float32, gen, device, num_splits=num_splits,
             window=window)  # fmt: skip


# Gemma 2's soft-capped scores (a cap of 1.5 binds on these unit-variance scores): split or
# not, both head-dim layouts, a window, bf16, and an FP8 cache (its q pre-scaled in fp16)
@pytest.mark.parametrize(
    ("dtype", "num_splits", "half_d", "window", "cache_dtype"),
    [(torch.float32, 1, True, 0, None), (torch.float32, 3, False, 0, None),
     (torch.float32, 3, True, 33, None), (torch.bfloat16, 2, True, 0, None),
     (torch.bfloat16, 2, True, 0, torch.float8_e4m3fn)],
)  # fmt: skip
def test_soft_capped_scores_match_the_reference(
    dtype: torch.dtype, num_splits: int, half_d: bool, window: int,
    cache_dtype: torch.dtype | None, gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    same = torch.Generator().set_state(gen.get_state())  # the same inputs, uncapped
    capped = run_case([*MIXED_LENS, 200], 4, dtype, gen, device, num_splits=num_splits,
                      half_d=half_d, window=window, cache_dtype=cache_dtype, softcap=1.5)  # fmt: skip
    again = run_case([*MIXED_LENS, 200], 4, dtype, same, device, num_splits=num_splits,
                     half_d=half_d, window=window, cache_dtype=cache_dtype)  # fmt: skip
    assert not torch.allclose(capped.float(), again.float(), atol=1e-2)  # the cap changed them


def test_the_references_soft_cap_is_transformers_gemma2() -> None:
    """cap * tanh(scores * scale / cap) before the mask and the softmax, in float32 (transformers'
    eager Gemma 2 attention), for decode and prefill alike."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = paged_kv([9, 20], 8, 1, 16, torch.float32, gen, torch.device("cpu"))
    q = torch.randn((2, 2, 16), generator=gen) * 3
    lens = torch.tensor([9, 20], dtype=torch.int32)
    got = ref_paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, softcap=2.0)
    for b, n in enumerate((9, 20)):
        keys = torch.cat([k_cache[int(t)] for t in tables[b]])[:n, 0]  # [n, 16]
        values = torch.cat([v_cache[int(t)] for t in tables[b]])[:n, 0]
        scores = torch.tanh(q[b] @ keys.T * 0.25 / 2.0) * 2.0  # [2, n]
        want = torch.softmax(scores, -1) @ values
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-6)
    qsl = torch.tensor([0, 9, 29], dtype=torch.int32)
    qp = torch.randn((29, 2, 16), generator=gen) * 3
    pre = ref_prefill_attention(qp, k_cache, v_cache, tables, qsl, lens, 0.25, softcap=2.0)
    keys = torch.cat([k_cache[int(t)] for t in tables[1]])[:20, 0]
    values = torch.cat([v_cache[int(t)] for t in tables[1]])[:20, 0]
    scores = torch.tanh(qp[9:].transpose(0, 1) @ keys.T * 0.25 / 2.0) * 2.0  # [2, 20, 20]
    scores = scores.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    want = (torch.softmax(scores, -1) @ values).transpose(0, 1)
    torch.testing.assert_close(pre[9:], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="softcap must be 0"):
        ref_paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, softcap=-1.0)


# gpt-oss's attention sinks, from far below the scores to dominating the longest context (e^6
# against ~200 keys): one split; three splits of 64-key tiles over a 100-key window (gpt-oss's
# sliding layers), two of them holding keys of the 200-token context, so the merge must count the
# sink once; bf16 over an FP8 cache (q pre-scaled in fp16) in two splits, soft-capped (the sinks
# are not capped), the sinks in bf16
@pytest.mark.parametrize(
    ("dtype", "num_splits", "half_d", "window", "cache_dtype", "softcap"),
    [(torch.float32, 1, True, 0, None, 0.0), (torch.float32, 3, False, 100, None, 0.0),
     (torch.bfloat16, 2, True, 0, torch.float8_e4m3fn, 1.5)],
)  # fmt: skip
def test_attention_sinks_match_the_reference(
    dtype: torch.dtype, num_splits: int, half_d: bool, window: int,
    cache_dtype: torch.dtype | None, softcap: float, gen: torch.Generator, device: torch.device,
    poison_empty: None,
) -> None:  # fmt: skip
    sinks = torch.linspace(-2.0, 6.0, 8, device=device).to(dtype)  # 2 KV heads x 4
    run_case([*MIXED_LENS, 200], 4, dtype, gen, device, num_splits=num_splits, half_d=half_d,
             window=window, cache_dtype=cache_dtype, softcap=softcap, sinks=sinks)  # fmt: skip


@pytest.mark.parametrize("half_d", [True, False])
def test_a_sliding_window_over_an_fp8_cache(
    half_d: bool, gen: torch.Generator, device: torch.device, poison_empty: None
) -> None:
    run_case([*MIXED_LENS, 200], 4, torch.bfloat16, gen, device, num_splits=2, half_d=half_d,
             cache_dtype=torch.float8_e4m3fn, window=33)  # fmt: skip


def test_a_window_beyond_every_context_is_no_window(
    gen: torch.Generator, device: torch.device
) -> None:
    k_cache, v_cache, tables = paged_kv(MIXED_LENS, 16, 2, 32, torch.float32, gen, device)
    q = rand((len(MIXED_LENS), 4, 32), torch.float32, gen, device)
    lens = torch.tensor(MIXED_LENS, dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, tables, lens, 0.2)
    whole = paged_decode_attention(*args, num_splits=1)
    assert torch.equal(paged_decode_attention(*args, num_splits=1, window=100), whole)


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

    def test_sinks_one_per_query_head_contiguous(
        self, device: torch.device, gen: torch.Generator
    ) -> None:
        args = self.inputs(device, gen)  # 4 query heads
        with pytest.raises(ValueError, match=r"sinks has shape \(3,\); expected"):
            paged_decode_attention(**args, sinks=torch.zeros(3, device=device))
        with pytest.raises(ValueError, match="sinks must be contiguous"):
            paged_decode_attention(**args, sinks=torch.zeros(8, device=device)[::2])

    def test_half_d_needs_two_halves_of_16(
        self, device: torch.device, gen: torch.Generator
    ) -> None:
        args = self.inputs(device, gen)  # head_dim 16: one tile of 16 columns, no halves
        with pytest.raises(ValueError, match="half_d needs a head_dim over 16"):
            paged_decode_attention(**args, half_d=True)

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


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize(("batch", "ctx"), [(4, 4096), (1, 32768), (64, 700)])
def test_gpu_both_variants_give_the_same_bits(
    batch: int, ctx: int, cache_dtype: torch.dtype | None
) -> None:
    """The head dim in halves runs the whole-width kernel's MMAs in the same order: compiled,
    its output is bit for bit the same (so it changes no greedy token anywhere)."""
    lens = [ctx - 3 * i for i in range(batch)]
    cuda = torch.device("cuda")
    outs = [
        run_case(
            lens,
            4,
            torch.bfloat16,
            torch.Generator().manual_seed(0),
            cuda,
            head_dim=128,
            kv_heads=8,
            half_d=half_d,
            cache_dtype=cache_dtype,
        )
        for half_d in (True, False)
    ]
    assert torch.equal(*outs)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batch", "ctx", "window"), [(4, 4096, 4096), (1, 32768, 4096), (64, 700, 100)]
)
def test_gpu_sliding_window_llama_shapes(batch: int, ctx: int, window: int) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [ctx - 3 * i for i in range(batch)]
    run_case(lens, 4, torch.bfloat16, gen, torch.device("cuda"), head_dim=128, kv_heads=8,
             window=window)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batch", "ctx", "window"), [(4, 4096, 0), (1, 32768, 128), (64, 700, 128)]
)
def test_gpu_attention_sinks_gpt_oss_shapes(batch: int, ctx: int, window: int) -> None:
    # gpt-oss-20b's attention: 64 query heads over 8 KV heads of 64 dims, its sliding layers'
    # 128-key window; sinks up to e^10 so that some heads' outweigh thousands of keys
    gen, cuda = torch.Generator().manual_seed(0), torch.device("cuda")
    lens = [ctx - 3 * i for i in range(batch)]
    sinks = torch.linspace(-2.0, 10.0, 64, device=cuda).bfloat16()
    run_case(lens, 8, torch.bfloat16, gen, cuda, head_dim=64, kv_heads=8, window=window,
             sinks=sinks)  # fmt: skip


# DeepSeek's latent cache (models.deepseek): one KV head of 576 dims (64 rotary + 512 latent:
# a 1024-wide tile, its high half mostly masked) that every query head reads, as keys and as
# values (one tensor given as both caches); V3's 128 heads in one group, and 16
@pytest.mark.parametrize(
    ("group", "dtype", "lens", "num_splits"),
    [(16, torch.float32, MIXED_LENS, 2), (128, torch.float32, [3, 17], 1),
     (16, torch.bfloat16, [1, 40], 3)],
)  # fmt: skip
def test_one_latent_head_read_as_keys_and_values(
    group: int, dtype: torch.dtype, lens: list[int], num_splits: int, gen: torch.Generator,
    device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    cache, _, tables = paged_kv(lens, 16, 1, 576, dtype, gen, device)
    q = rand((len(lens), group, 576), dtype, gen, device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, cache, cache, tables, ctx, 0.05, num_splits=num_splits)
    assert_matches(out, ref_paged_decode_attention(q, cache, cache, tables, ctx, 0.05))


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "ctx"), [(1, 4096), (64, 700)])
def test_gpu_deepseek_latent_shapes(batch: int, ctx: int) -> None:
    gen, cuda = torch.Generator().manual_seed(0), torch.device("cuda")
    cache, _, tables = paged_kv([ctx] * batch, 16, 1, 576, torch.bfloat16, gen, cuda)
    q = rand((batch, 128, 576), torch.bfloat16, gen, cuda)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=cuda)
    out = paged_decode_attention(q, cache, cache, tables, lens, 576**-0.5)
    assert_matches(out, ref_paged_decode_attention(q, cache, cache, tables, lens, 576**-0.5))
