"""write_kv (Triton) against the reference; the module re-exports decode and prefill."""

from __future__ import annotations

import pytest
import torch

import kernels.triton_attention as ta
from kernels.attention import ref_rotary_write_kv, ref_write_kv
from tests.kernels.paged import assert_matches, assert_same_rounding, rand
from tests.kernels.rounding import assert_rotated, kernel_rounding, rotate, torch_rounding


def caches(dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return rand((6, 8, 2, 32), dtype, gen, device), rand((6, 8, 2, 32), dtype, gen, device)


@pytest.mark.parametrize(("src", "dst"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])  # fmt: skip
def test_writes_exactly_the_mapped_slots(src: torch.dtype, dst: torch.dtype, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    k_cache, v_cache = caches(dst, gen, device)
    k, v = rand((6, 2, 32), src, gen, device), rand((6, 2, 32), src, gen, device)
    # first slot, a slot skipped (-1), last slot of a block, first of the next, the very last slot
    slots = torch.tensor([0, -1, 7, 8, 47, 20], dtype=torch.int64, device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_write_kv(k, v, ref_k, ref_v, slots)
    ta.write_kv(k, v, k_cache, v_cache, slots)
    assert_same_rounding(k_cache, ref_k)
    assert_same_rounding(v_cache, ref_v)


def test_strided_kv_views_from_a_fused_projection(
    gen: torch.Generator, device: torch.device
) -> None:
    k_cache, v_cache = caches(torch.float32, gen, device)
    qkv = rand((3, 8, 32), torch.float32, gen, device)  # [T, Hq + 2 Hkv, D] with Hq = 4
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([5, 30, 31], dtype=torch.int32, device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_write_kv(k, v, ref_k, ref_v, slots)
    ta.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_shape_mismatch_is_a_value_error(gen: torch.Generator, device: torch.device) -> None:
    k_cache, v_cache = caches(torch.float32, gen, device)
    k = rand((2, 4, 32), torch.float32, gen, device)  # 4 heads, the cache has 2
    with pytest.raises(ValueError, match="do not match the cache"):
        ta.write_kv(k, k, k_cache, v_cache, torch.tensor([0, 1]))


def test_slot_mapping_length_is_checked(gen: torch.Generator, device: torch.device) -> None:
    k_cache, v_cache = caches(torch.float32, gen, device)
    k = rand((2, 2, 32), torch.float32, gen, device)
    with pytest.raises(ValueError, match="slot_mapping has 3 entries for 2 tokens"):
        ta.write_kv(k, k, k_cache, v_cache, torch.tensor([0, 1, 2]))


def test_reexports_the_attention_launchers() -> None:
    assert callable(ta.paged_decode_attention) and callable(ta.prefill_attention)


# ---- rotary + KV write, fused --------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "rot"),
    [(4, 4, 32, 32), (8, 2, 64, 64), (8, 1, 24, 24), (32, 4, 128, 128), (4, 2, 32, 24), (8, 2, 96, 72), (4, 1, 24, 2),
     (64, 2, 320, 64)],  # 64 query heads of 320 dims: two programs a token (Q_TILE_ELEMS)
)  # fmt: skip
def test_rotary_write_kv_matches_rotary_then_write(
    dtype: torch.dtype, cache_dtype: torch.dtype, hq: int, hkv: int, d: int, rot: int,
    gen: torch.Generator, device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """Strided q/k/v views of one fused projection (GQA 1, 4, 8); slots: first, skipped (-1),
    last of a block, first of the next, the very last slot; a token at position 0 and repeats.
    ``rot`` < ``d``: partial rotary (Phi-4-mini's 96 of 128), the rest of each head passes."""
    bs, nblk = 8, 6
    shape = (nblk, bs, hkv, d)
    k_cache, v_cache = rand(shape, cache_dtype, gen, device), rand(shape, cache_dtype, gen, device)
    qkv = rand((6, hq + 2 * hkv, d), dtype, gen, device)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    before = qkv.clone()
    cos_sin = rand((50, rot), torch.float32, gen, device)
    positions = torch.tensor([0, 1, 7, 8, 49, 17], device=device)
    slots = torch.tensor([0, -1, 7, 8, nblk * bs - 1, 20], dtype=torch.int64, device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref_q = ref_rotary_write_kv(positions, q, k, v, cos_sin, ref_k, ref_v, slots)
    # the reference rotates like the test's twin (rounding as torch does) ...
    assert torch.equal(ref_q.float(), rotate(positions, q, cos_sin, torch_rounding))
    # ... and the kernel like the twin rounding the way kernels here do (the interpreter truncates)
    rnd = kernel_rounding(device)
    want_q = rotate(positions, q, cos_sin, rnd)
    ref_write_kv(rnd(rotate(positions, k, cos_sin, rnd), cache_dtype).to(cache_dtype), v, want_k, want_v, slots)  # fmt: skip
    k_out = torch.full((6, hkv, d), float("nan"), dtype=dtype, device=device)
    out = ta.rotary_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots, k_out=k_out)
    assert out.is_contiguous() and out.shape == (6, hq, d)
    assert_rotated(out, want_q, dtype)  # in fp32, compiled kernels may fuse multiply-adds
    assert_rotated(k_cache, want_k, dtype)
    assert_same_rounding(v_cache, ref_v)  # v is copied, never computed
    assert torch.equal(qkv, before)  # the projection itself is read only
    # k_out: every row's rotated key in k's dtype, the skipped slot's too
    assert_rotated(k_out, rotate(positions, k, cos_sin, rnd), dtype)
    ref_out = torch.empty_like(k_out)
    ref_rotary_write_kv(positions, q, k, v, cos_sin, ref_k.clone(), ref_v.clone(), slots, k_out=ref_out)  # fmt: skip
    assert torch.equal(ref_out.float(), rotate(positions, k, cos_sin, torch_rounding))


def test_rotary_write_kv_single_token(gen: torch.Generator, device: torch.device) -> None:
    k_cache, v_cache = caches(torch.float32, gen, device)
    q = rand((1, 4, 32), torch.float32, gen, device)
    k, v = (
        rand((1, 2, 32), torch.float32, gen, device),
        rand((1, 2, 32), torch.float32, gen, device),
    )
    cos_sin = rand((10, 32), torch.float32, gen, device)
    pos, slots = torch.tensor([3], device=device), torch.tensor([47], device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = ref_rotary_write_kv(pos, q, k, v, cos_sin, ref_k, ref_v, slots)
    out = ta.rotary_write_kv(pos, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert_matches(out, ref_q)
    assert_matches(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


def test_rotary_write_kv_errors(gen: torch.Generator, device: torch.device) -> None:
    k_cache, v_cache = caches(torch.float32, gen, device)
    q = rand((2, 4, 32), torch.float32, gen, device)
    k = rand((2, 2, 32), torch.float32, gen, device)
    cs = rand((10, 32), torch.float32, gen, device)
    pos = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="one entry per token"):
        ta.rotary_write_kv(pos, q, k, k, cs, k_cache, v_cache, torch.tensor([0], device=device))
    with pytest.raises(ValueError, match="do not match the cache"):
        ta.rotary_write_kv(pos, q, q, q, cs, k_cache, v_cache, pos)
    for width in (cs[:, :15], torch.cat([cs, cs], dim=1)):  # odd; wider than the head
        with pytest.raises(ValueError, match="cos_sin_cache width"):
            ta.rotary_write_kv(pos, q, k, k, width, k_cache, v_cache, pos)
    with pytest.raises(ValueError, match=r"k_out .* must match k"):
        ta.rotary_write_kv(pos, q, k, k, cs, k_cache, v_cache, pos, k_out=q)


# DeepSeek-V3's 128 query heads over its 576-dim latent row: eight programs a token, the first
# writing the row
@pytest.mark.parametrize(("hq", "d", "rot"), [(4, 40, 8), (16, 576, 64), (128, 576, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_rotary_write_kv_without_values_writes_the_keys_once(
    hq: int, d: int, rot: int, cache_dtype: torch.dtype, gen: torch.Generator,
    device: torch.device, poison_empty: None,
) -> None:  # fmt: skip
    """v None (DeepSeek's latent cache, one tensor given as both caches): each slot gets the
    key with its first ``rot`` dims rotated and the rest as they are, written once (a value
    write after it would put the unrotated dims back); other slots stay as they were."""
    bs, nblk = 8, 4
    cache = rand((nblk, bs, 1, d), torch.float32, gen, device).to(cache_dtype)
    q, k = rand((5, hq, d), torch.float32, gen, device), rand((5, 1, d), torch.float32, gen, device)
    cos_sin = rand((40, rot), torch.float32, gen, device)
    positions = torch.tensor([0, 3, 7, 39, 12], device=device)
    slots = torch.tensor([0, -1, 7, nblk * bs - 1, 9], dtype=torch.int64, device=device)
    want, ref = cache.clone(), cache.clone()
    rnd = kernel_rounding(device)
    rotated = rotate(positions, k, cos_sin, rnd).to(torch.float32)
    assert not torch.equal(rotated[..., :rot], k[..., :rot])
    assert torch.equal(rotated[..., rot:], k[..., rot:])
    ref_write_kv(rotated, None, want, want, slots, 2.0)
    ref_q = ref_rotary_write_kv(positions, q, k, None, cos_sin, ref, ref, slots, 2.0, 2.0)
    out = ta.rotary_write_kv(positions, q, k, None, cos_sin, cache, cache, slots, 2.0, 2.0)
    assert_matches(out, ref_q)
    if cache_dtype == torch.float32:
        assert_rotated(cache, want, torch.float32)
        assert_rotated(ref, want, torch.float32)
    else:  # e4m3 (k / 2.0): within one of its steps (a rotation rounded apart may cross one)
        for got in (cache, ref):
            torch.testing.assert_close(got.float(), want.float(), rtol=0.13, atol=1e-6)
    untouched = torch.ones(nblk * bs, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    flat = cache.view(torch.uint8).reshape(nblk * bs, -1).cpu()
    before = want.view(torch.uint8).reshape(nblk * bs, -1).cpu()
    assert torch.equal(flat[untouched], before[untouched])
