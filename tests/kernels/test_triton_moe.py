"""The fused MoE (Triton) against the reference: one token, many, experts with no tokens,
top-1 to top-8, sizes that are no power of two, every float dtype; gpt-oss's biases and clamped
SwiGLU.

float32 within 1e-5 of the output's size. 16-bit outputs against the reference's arithmetic
rounded the way the kernel rounds (``tests.kernels.rounding``: Triton's interpreter truncates to
bf16; truncation at the five rounding points biases a bf16 result by ~2% against torch's
round-to-nearest), within one unit in the last place of the output's size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from kernels.moe import (
    ClampedSwiGLU,
    Fp8Scales,
    Int4Scales,
    dequant_fp8_expert,
    dequant_int4_expert,
    quantize_fp8_experts,
    quantize_int4_experts,
    ref_clamped_swiglu,
    ref_fused_moe,
    ref_moe_routing,
    sort_by_expert,
)
from kernels.triton_moe import align_to_blocks, fused_moe, ref_align_to_blocks
from tests.kernels.paged import assert_matches, rand
from tests.kernels.rounding import Rounder, kernel_rounding

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _inputs(t: int, h: int, e: int, inter: int, top_k: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """x, weights scaled so every projection is O(1), and the router's choice of top_k."""
    x = rand((t, h), dtype, gen, device)
    w13 = (rand((e, 2 * inter, h), torch.float32, gen, device) / h**0.5).to(dtype)
    w2 = (rand((e, h, inter), torch.float32, gen, device) / inter**0.5).to(dtype)
    weights, ids = ref_moe_routing(rand((t, e), torch.float32, gen, device), top_k, True)
    return x, w13, w2, weights, ids


def _ref_rounded(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, rnd: Rounder, *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, clamp: ClampedSwiGLU | None = None) -> torch.Tensor:  # fmt: skip
    """``ref_fused_moe``'s arithmetic, each rounding done by ``rnd``; fp32 values out."""
    dt, inter = x.dtype, w2.shape[2]
    weights, ids = sort_by_expert(topk_weights, topk_ids.long())
    out = torch.zeros(x.shape, device=x.device)
    for j in range(ids.shape[1]):
        e = ids[:, j]
        gate_up = rnd(torch.einsum("th,tnh->tn", x.float(), w13[e].float()), dt)  # [T, 2I]
        if b13 is not None:
            gate_up = rnd(gate_up + b13[e].float(), dt)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if clamp is None:
            act = rnd(rnd(torch.nn.functional.silu(gate), dt) * up, dt)  # [T, I]
        else:  # fp32 in, so unrounded out
            act = rnd(ref_clamped_swiglu(gate_up, clamp), dt)  # [T, I]
        down = rnd(torch.einsum("ti,thi->th", act, w2[e].float()), dt)  # [T, H]
        if b2 is not None:
            down = rnd(down + b2[e].float(), dt)
        c = rnd(down * weights[:, j, None].float(), dt)
        out = c if j == 0 else rnd(out + c, dt)
    return out


def _assert_close(out: torch.Tensor, args: tuple[torch.Tensor, ...], **gpt_oss: Any) -> None:
    """``gpt_oss``: the biases and clamp, passed on to the references."""
    ref = ref_fused_moe(*args, **gpt_oss)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype != torch.float32:
        ref = _ref_rounded(*args, kernel_rounding(out.device), **gpt_oss)
    assert not torch.isnan(out).any(), "unwritten output"
    scale = ref.float().abs().max().clamp(min=1.0)
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float() / scale, ref.float() / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("t", "h", "e", "inter", "top_k"),
    [
        (1, 64, 8, 32, 2),  # decode: one token, two experts, six idle
        (1, 40, 16, 24, 8),  # one token, top-8 of 16
        (37, 40, 16, 24, 8),
        (37, 96, 16, 80, 2),  # most experts see a few rows, some none
        (130, 72, 6, 40, 1),  # top-1, long runs per expert
        (20, 64, 8, 48, 8),  # top-8 of 8: every expert sees every token
    ],
)
def test_matches_the_reference(t: int, h: int, e: int, inter: int, top_k: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    args = _inputs(t, h, e, inter, top_k, dtype, gen, device)
    _assert_close(fused_moe(*args), args)


@pytest.mark.parametrize("config", [(16, 16, 16, 1), (16, 64, 32, 4), (64, 32, 64, 4)])
def test_launch_configs(config: tuple[int, int, int, int], gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Blocks smaller and larger than the runs, tiles narrower and wider than H and I."""
    args = _inputs(30, 72, 5, 56, 2, torch.float32, gen, device)
    _assert_close(fused_moe(*args, config=config), args)


def test_experts_receiving_no_tokens(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Only experts 3 and 11 of 16 are chosen (int32 ids, bf16 router weights)."""
    x, w13, w2, _, _ = _inputs(37, 64, 16, 32, 2, torch.float32, gen, device)
    ids = torch.tensor([[3, 11], [11, 3]] * 18 + [[11, 3]], dtype=torch.int32, device=device)
    weights = torch.rand((37, 2), generator=gen).to(device=device, dtype=torch.bfloat16)
    _assert_close(fused_moe(x, w13, w2, weights, ids), (x, w13, w2, weights, ids))


def test_every_token_to_one_expert(gen: torch.Generator, device: torch.device) -> None:
    x, w13, w2, _, _ = _inputs(20, 48, 4, 32, 1, torch.float32, gen, device)
    ids = torch.full((20, 1), 2, dtype=torch.int64, device=device)
    weights = torch.ones((20, 1), device=device)
    _assert_close(fused_moe(x, w13, w2, weights, ids), (x, w13, w2, weights, ids))


def _gpt_oss(x: torch.Tensor, e: int, inter: int, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
    """x scaled by 4 (exact in every dtype), so gate and up often pass the clamp's limit of 7;
    O(1) biases of x's dtype; gpt-oss's clamp."""
    b13 = rand((e, 2 * inter), x.dtype, gen, x.device)
    b2 = rand((e, x.shape[1]), x.dtype, gen, x.device)
    return x * 4, {"b13": b13, "b2": b2, "clamp": ClampedSwiGLU()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "h", "e", "inter", "top_k"),
    [
        (3, 64, 8, 40, 4),  # decode-like: a few tokens, top-4 (gpt-oss's)
        (40, 48, 8, 32, 2),  # ~10 rows per expert: padded rows, blocks past the last run
    ],
)
def test_gpt_oss_biases_and_clamped_swiglu(t: int, h: int, e: int, inter: int, top_k: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    x, w13, w2, weights, ids = _inputs(t, h, e, inter, top_k, dtype, gen, device)
    x, gpt_oss = _gpt_oss(x, e, inter, gen)
    args = (x, w13, w2, weights, ids)
    _assert_close(fused_moe(*args, **gpt_oss), args, **gpt_oss)


def test_biases_and_clamp_each_alone(gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """HAS_BIAS and CLAMPED are independent flags; each bias applies without the other."""
    x, w13, w2, weights, ids = _inputs(3, 64, 8, 40, 2, torch.float32, gen, device)
    x, gpt_oss = _gpt_oss(x, 8, 40, gen)
    args = (x, w13, w2, weights, ids)
    for name, value in gpt_oss.items():
        _assert_close(fused_moe(*args, **{name: value}), args, **{name: value})


@pytest.mark.parametrize(
    ("t", "top_k", "e", "block_m"),
    [(1, 2, 8, 16), (37, 2, 16, 16), (130, 8, 8, 64), (64, 6, 64, 16), (9, 8, 256, 32),
     (200, 3, 5, 16)],
)  # fmt: skip
def test_alignment_groups_every_pair_once_by_expert(t: int, top_k: int, e: int, block_m: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    """The alignment kernel (one program, chunks of 64 pairs: 1 to 600 pairs here, experts
    not a power of two) gives the torch reference's rows exactly: each expert's pairs in their
    order, its run padded with the sentinel, each block's expert."""
    _, ids = ref_moe_routing(torch.randn((t, e), generator=gen), top_k, False)
    ids = ids.sort(dim=-1).values.to(device)
    pairs, blocks = align_to_blocks(ids, e, block_m)
    want = ref_align_to_blocks(ids, e, block_m)
    assert torch.equal(pairs, want[0]) and torch.equal(blocks, want[1])
    pairs, blocks, ids = pairs.cpu(), blocks.cpu(), ids.cpu()
    flat = ids.reshape(-1)
    assert pairs.numel() == blocks.numel() * block_m
    real = pairs[pairs < t * top_k].long()
    assert sorted(real.tolist()) == list(range(t * top_k))  # each pair exactly once
    for b, expert in enumerate(blocks.tolist()):
        rows = pairs[b * block_m : (b + 1) * block_m].long()
        rows = rows[rows < t * top_k]
        if expert < 0:
            assert rows.numel() == 0  # past the last run
        else:
            assert rows.numel() > 0 and (flat[rows] == expert).all()


def test_no_tokens_and_errors(gen: torch.Generator, device: torch.device) -> None:
    x, w13, w2, weights, ids = _inputs(3, 32, 4, 16, 2, torch.float32, gen, device)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights, ids[:2])
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, w13.half(), w2, weights, ids)
    with pytest.raises(ValueError, match="b13"):
        fused_moe(x, w13, w2, weights, ids, b13=torch.zeros((4, 16), device=device))  # not 2I
    with pytest.raises(ValueError, match="b2"):
        fused_moe(x, w13, w2, weights, ids, b2=torch.zeros((4, 32), device=device).half())
    assert_matches(fused_moe(x, w13, w2, weights, ids), ref_fused_moe(x, w13, w2, weights, ids))


def _fp8(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, Fp8Scales, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The weights quantized to e4m3 (block or per-channel scales), and their dequantized
    values rounded to x's dtype: what a float checkpoint dequantized at load would hold."""
    q13, s13 = quantize_fp8_experts(w13, block, halves=True)
    q2, s2 = quantize_fp8_experts(w2, block, halves=False)
    fp8 = Fp8Scales(s13, s2, block)
    h, inter = w13.shape[2], w2.shape[2]
    d13 = torch.stack([dequant_fp8_expert(q13[i], s13[i], fp8.blocks(h), True) for i in range(len(q13))])  # fmt: skip
    d2 = torch.stack([dequant_fp8_expert(q2[i], s2[i], fp8.blocks(inter), False) for i in range(len(q2))])  # fmt: skip
    return q13, q2, fp8, d13.to(w13.dtype), d2.to(w2.dtype)


@pytest.mark.parametrize("block", [(16, 16), (32, 48), None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "h", "e", "inter", "top_k"),
    [
        (1, 64, 8, 40, 1),  # decode, top-1; I = 40 not a multiple of the blocks
        (1, 40, 16, 24, 8),  # one token, top-8 of 16
        (37, 96, 16, 80, 2),  # most experts see a few rows, some none
        (20, 64, 8, 48, 8),  # every expert sees every token
    ],
)
def test_fp8_experts_match_the_dequantized_reference(t: int, h: int, e: int, inter: int, top_k: int, dtype: torch.dtype, block: tuple[int, int] | None, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """e4m3 weights with 2-D block scales (blocks not dividing H or I, the gate's and up's
    blocks apart) or per-channel ones, against the float kernel's reference on the dequantized
    weights (rounded to x's dtype, which the kernel does not do: within the same tolerance)."""
    x, w13, w2, weights, ids = _inputs(t, h, e, inter, top_k, dtype, gen, device)
    q13, q2, fp8, d13, d2 = _fp8(w13, w2, block)
    assert q13.dtype == torch.float8_e4m3fn
    out = fused_moe(x, q13, q2, weights, ids, fp8=fp8)
    _assert_close(out, (x, d13, d2, weights, ids))
    ref = ref_fused_moe(x, q13, q2, weights, ids, fp8=fp8)  # the reference dequantizes itself
    torch.testing.assert_close(ref, ref_fused_moe(x, d13, d2, weights, ids), rtol=0, atol=0)


@pytest.mark.parametrize("config", [(16, 16, 16, 1), (64, 32, 64, 4)])
def test_fp8_launch_configs_keep_k_tiles_in_one_block(config: tuple[int, int, int, int], gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """A BLOCK_K of 64 over scale blocks 48 wide is halved to 16: no tile straddles two."""
    x, w13, w2, weights, ids = _inputs(30, 96, 5, 56, 2, torch.float32, gen, device)
    q13, q2, fp8, d13, d2 = _fp8(w13, w2, (32, 48))
    out = fused_moe(x, q13, q2, weights, ids, fp8=fp8, config=config)
    _assert_close(out, (x, d13, d2, weights, ids))


def test_fp8_errors_name_what_is_wrong(gen: torch.Generator, device: torch.device) -> None:
    x, w13, w2, weights, ids = _inputs(3, 32, 4, 16, 2, torch.float32, gen, device)
    q13, q2, fp8, _, _ = _fp8(w13, w2, (16, 16))
    with pytest.raises(ValueError, match="w13"):  # fp8 weights without their scales
        ref_fused_moe(x, q13, q2, weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, q13, q2, weights, ids)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_moe(x, q13, q2, weights, ids, fp8=Fp8Scales(fp8.w13_scale, fp8.w2_scale[:, :1], (16, 16)))  # fmt: skip
    with pytest.raises(ValueError, match="block_k"):
        bad = Fp8Scales(*_fp8(w13, w2, (16, 8))[2].__dict__.values())
        fused_moe(x, q13, q2, weights, ids, fp8=bad)


@pytest.mark.parametrize("fp8_block", [None, (32, 48), "channel", "int4"])
def test_every_launch_has_k_tiles_tl_dot_compiles(fp8_block: Any, gen: torch.Generator, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """BLOCK_K of both GEMMs at least 16 (tl.dot's least when compiled; the interpreter takes
    less): float weights keep their tile (a float weight's placeholder scale block of 1 once
    halved it to 1, which the interpreter ran and a GPU refused to compile), FP8 ones a
    divisor of the scale block."""
    from kernels import triton_moe

    seen: list[int] = []
    for name in ("_gate_up_kernel", "_down_kernel"):
        kernel = getattr(triton_moe, name)

        class Spy:
            def __init__(self, real: Any) -> None:
                self.real = real

            def __getitem__(self, grid: Any) -> Any:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    seen.append(kwargs["BLOCK_K"])
                    return self.real[grid](*args, **kwargs)

                return launch

        monkeypatch.setattr(triton_moe, name, Spy(kernel))
    x, w13, w2, weights, ids = _inputs(5, 96, 4, 56, 2, torch.float32, gen, device)
    if fp8_block is None:
        out, args = fused_moe(x, w13, w2, weights, ids), (x, w13, w2, weights, ids)
    elif fp8_block == "int4":  # groups of 32 along H and I (halve the K tile of 64)
        x, w13, w2, weights, ids = _inputs(5, 96, 4, 64, 2, torch.float32, gen, device)
        q13, q2, int4, d13, d2 = _int4(w13, w2, 32)
        out, args = fused_moe(x, q13, q2, weights, ids, int4=int4), (x, d13, d2, weights, ids)
    else:
        q13, q2, fp8, d13, d2 = _fp8(w13, w2, None if fp8_block == "channel" else fp8_block)
        out, args = fused_moe(x, q13, q2, weights, ids, fp8=fp8), (x, d13, d2, weights, ids)
    _assert_close(out, args)
    assert len(seen) == 2 and min(seen) >= 16, seen


def _int4(w13: torch.Tensor, w2: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor, Int4Scales, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The weights quantized to packed int4 in groups of ``group`` input features (None: one
    group a row), and their dequantized values rounded to x's dtype as the kernels round them
    (under the interpreter bf16 truncates): with torch's rounding, what the loader's
    dequantized AWQ/GPTQ experts hold."""
    q13, s13, z13 = quantize_int4_experts(w13, group)
    q2, s2, z2 = quantize_int4_experts(w2, group)
    int4 = Int4Scales(s13, z13, s2, z2, group)
    rnd = kernel_rounding(w13.device)
    d13, d2 = (rnd(_dequant_int4(q, s, z), w13.dtype).to(w13.dtype) for q, s, z in ((q13, s13, z13), (q2, s2, z2)))  # fmt: skip
    return q13, q2, int4, d13, d2


def _dequant_int4(q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Stacked packed int4 experts -> float32 [E, N, K] (``perm``: act-order, each expert's
    columns back in the input's order)."""
    perms = [None] * len(q) if perm is None else list(perm)
    return torch.stack([dequant_int4_expert(q[i], scale[i], zeros[i], perms[i]) for i in range(len(q))])  # fmt: skip


def _int4_act_order(w13: torch.Tensor, w2: torch.Tensor, group: int | None, gen: torch.Generator, perm_dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, torch.Tensor, Int4Scales, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`_int4` of an act-order checkpoint: each expert's w13 and w2 columns in a random
    order of its own (its ``g_idx`` sorted, as the loader sorts them), quantized in groups of
    that order, with the permutations (packed column j holds input feature perm[e, j]); the
    dequantized weights in the input's order, rounded as the kernels round them."""
    e, dev = w13.shape[0], w13.device
    perms = []
    for w in (w13, w2):
        k = w.shape[2]
        perm = torch.stack([torch.randperm(k, generator=gen) for _ in range(e)]).to(dev)
        perms.append(perm.to(perm_dtype))
    sorted13, sorted2 = (w.gather(2, p.long()[:, None, :].expand_as(w)) for w, p in zip((w13, w2), perms, strict=True))  # fmt: skip
    q13, s13, z13 = quantize_int4_experts(sorted13, group)
    q2, s2, z2 = quantize_int4_experts(sorted2, group)
    int4 = Int4Scales(s13, z13, s2, z2, group, w13_perm=perms[0], w2_perm=perms[1])
    rnd = kernel_rounding(dev)
    d13 = rnd(_dequant_int4(q13, s13, z13, perms[0]), w13.dtype).to(w13.dtype)
    d2 = rnd(_dequant_int4(q2, s2, z2, perms[1]), w13.dtype).to(w13.dtype)
    return q13, q2, int4, d13, d2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "h", "e", "inter", "top_k", "group"),
    [
        (1, 96, 8, 80, 1, 16),  # decode, top-1; six and five groups of 16
        (1, 40, 16, 24, 8, None),  # top-8 of 16, one group a row: K no multiple of the tile
        (37, 96, 16, 48, 2, 48),  # most experts see a few rows; groups of 48 (tiles of 16)
        (20, 64, 8, 32, 8, 32),  # top-8 of 8: every expert sees every token; two groups / one
        (23, 128, 6, 64, 2, 64),  # tiles as wide as a group
        (20, 256, 4, 128, 2, 128),  # groups of 128 (AWQ's, GPTQ's): the default K tile of 128
    ],
)
def test_int4_experts_match_the_dequantized_reference(t: int, h: int, e: int, inter: int, top_k: int, group: int | None, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Packed int4 weights (AWQ/GPTQ converted, kernels.moe.Int4Scales) dequantized in the
    kernels' tiles (the pair GEMVs for one token, the grouped GEMMs beyond), against the float
    reference on the dequantized weights rounded to x's dtype (as the kernels round them)."""
    x, w13, w2, weights, ids = _inputs(t, h, e, inter, top_k, dtype, gen, device)
    q13, q2, int4, d13, d2 = _int4(w13, w2, group)
    assert q13.dtype == torch.int32 and q13.shape == (e, 2 * inter, h // 8)
    out = fused_moe(x, q13, q2, weights, ids, int4=int4)
    _assert_close(out, (x, d13, d2, weights, ids))
    ref = ref_fused_moe(x, q13, q2, weights, ids, int4=int4)  # the reference dequantizes itself
    d13 = _dequant_int4(q13, int4.w13_scale, int4.w13_zeros).to(dtype)  # rounded as torch does
    d2 = _dequant_int4(q2, int4.w2_scale, int4.w2_zeros).to(dtype)
    torch.testing.assert_close(ref, ref_fused_moe(x, d13, d2, weights, ids), rtol=0, atol=0)


@pytest.mark.parametrize("config", [(16, 16, 16, 1), (32, 64, 64, 4)])
def test_int4_launch_configs_keep_k_tiles_in_one_group(config: tuple[int, int, int, int], gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """A BLOCK_K of 64 over groups 32 wide is halved to 32: one scale and zero a tile row."""
    x, w13, w2, weights, ids = _inputs(30, 96, 5, 64, 2, torch.float32, gen, device)
    q13, q2, int4, d13, d2 = _int4(w13, w2, 32)
    out = fused_moe(x, q13, q2, weights, ids, int4=int4, config=config)
    _assert_close(out, (x, d13, d2, weights, ids))


def test_int4_experts_attached_to_w13_and_errors(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    """The groups found on ``w13.int4_scales`` (as the model's experts attach them); int32
    weights without groups, groups of the wrong shape or not dividing K are refused."""
    x, w13, w2, weights, ids = _inputs(3, 64, 4, 32, 2, torch.float32, gen, device)
    q13, q2, int4, d13, d2 = _int4(w13, w2, 32)
    with pytest.raises(ValueError, match="int4"):
        ref_fused_moe(x, q13, q2, weights, ids)
    q13.int4_scales = int4  # type: ignore[attr-defined]
    _assert_close(fused_moe(x, q13, q2, weights, ids), (x, d13, d2, weights, ids))
    bad = Int4Scales(int4.w13_scale, int4.w13_zeros, int4.w2_scale[:, :32], int4.w2_zeros, 32)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_moe(x, q13, q2, weights, ids, int4=bad)
    with pytest.raises(ValueError, match="group size 24"):
        fused_moe(x, q13, q2, weights, ids, int4=Int4Scales(*list(int4.__dict__.values())[:4], 24))  # fmt: skip
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, q13, q2[:, :, :2], weights, ids, int4=int4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("t", "h", "e", "inter", "top_k", "group"),
    [
        (1, 96, 8, 96, 2, 32),  # decode (the pair GEMVs): three groups of 32 along H and I
        (17, 96, 6, 160, 2, 32),  # grouped GEMMs: K tiles of 32 (gathered int4 tiles), five
        (7, 192, 4, 64, 2, 64),  # three groups of 64 along H: joined tiles of 64
        (5, 384, 4, 128, 2, 128),  # groups of 128 (the served K tile), three along H
        (30, 40, 5, 24, 2, None),  # one group a row: K no multiple of the tile (masked)
    ],
)
def test_int4_act_order_experts_match_the_dequantized_reference(t: int, h: int, e: int, inter: int, top_k: int, group: int | None, dtype: torch.dtype, gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """Act-order int4 experts (GPTQ desc_act, compressed-tensors actorder "group"): each
    expert's columns sorted by its own g_idx at load, the activations (x for w13, the
    intermediate for w2) read through the expert's permutation in the kernels' tiles, against
    the float reference on the dequantized weights in the input's order. Without either
    permutation the same packed weights give another output: each is followed."""
    x, w13, w2, weights, ids = _inputs(t, h, e, inter, top_k, dtype, gen, device)
    q13, q2, int4, d13, d2 = _int4_act_order(w13, w2, group, gen)
    out = fused_moe(x, q13, q2, weights, ids, int4=int4)
    _assert_close(out, (x, d13, d2, weights, ids))
    ref = ref_fused_moe(x, q13, q2, weights, ids, int4=int4)  # the reference's own permuting
    d13 = _dequant_int4(q13, int4.w13_scale, int4.w13_zeros, int4.w13_perm).to(dtype)
    d2 = _dequant_int4(q2, int4.w2_scale, int4.w2_zeros, int4.w2_perm).to(dtype)
    torch.testing.assert_close(ref, ref_fused_moe(x, d13, d2, weights, ids), rtol=0, atol=0)
    if dtype != torch.float32:
        return
    for kept in ({"w2_perm": None}, {"w13_perm": None}):  # either permutation left out
        wrong = fused_moe(x, q13, q2, weights, ids, int4=dataclasses.replace(int4, **kept))
        assert (wrong - out).abs().max() > 0.05 * out.abs().max()


@pytest.mark.parametrize("config", [(16, 16, 16, 1), (32, 64, 64, 4)])
def test_int4_act_order_launch_configs(config: tuple[int, int, int, int], gen: torch.Generator, device: torch.device, poison_empty: None) -> None:  # fmt: skip
    """The grouped kernels' permuted activation tiles at narrow and wide K tiles (64 halved to
    32 inside groups of 32), int64 permutations."""
    x, w13, w2, weights, ids = _inputs(30, 96, 5, 64, 2, torch.float32, gen, device)
    q13, q2, int4, d13, d2 = _int4_act_order(w13, w2, 32, gen, torch.int64)
    out = fused_moe(x, q13, q2, weights, ids, int4=int4, config=config)
    _assert_close(out, (x, d13, d2, weights, ids))


def test_int4_act_order_permutations_are_checked(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    """A permutation of the wrong shape or dtype is refused, naming it."""
    x, w13, w2, weights, ids = _inputs(3, 64, 4, 32, 2, torch.float32, gen, device)
    q13, q2, int4, _, _ = _int4_act_order(w13, w2, 32, gen)
    assert int4.w13_perm is not None and int4.w2_perm is not None
    bad = {
        "w13_perm": int4.w13_perm[:, :32],  # I's width, not H's
        "w2_perm": int4.w2_perm.float(),
    }
    for name, perm in bad.items():
        with pytest.raises(ValueError, match=name):
            fused_moe(x, q13, q2, weights, ids, int4=dataclasses.replace(int4, **{name: perm}))
        with pytest.raises(ValueError, match=name):
            ref_fused_moe(x, q13, q2, weights, ids, int4=dataclasses.replace(int4, **{name: perm}))
