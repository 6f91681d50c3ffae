"""The torch references of attention: prefill against a dense masked softmax, and on torch's fused
SDPA kernel (a 3-D call fell back to the math path, which holds every [q_len, n] score: on the CPU
that was 80% of a 4k-token prefill); prefill and decode with a sliding window against a softmax
per query over the keys it sees."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.attention import ref_paged_decode_attention, ref_prefill_attention
from tests.kernels.paged import assert_matches, paged_kv, rand


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[q_len, Hq, D] attending to [n, Hkv, D], query i at position n - q_len + i."""
    q_len, hq, _ = q.shape
    n, hkv, _ = k.shape
    k = k.float().repeat_interleave(hq // hkv, dim=1)
    v = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    allowed = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize(
    "prefixes", [[0, 0], [0, 37], [16, 5]]
)  # chunk == context, and after a prefix
def test_prefill_reference_runs_on_the_fused_kernel_and_matches_a_dense_softmax(prefixes: list[int]) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, bs, scale = 8, 2, 32, 16, 32**-0.5
    q_lens = [21, 16]
    lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    k_cache, v_cache, tables = paged_kv(lens, bs, hkv, d, torch.float32, gen, torch.device("cpu"))
    q = rand((sum(q_lens), hq, d), torch.float32, gen, torch.device("cpu"))
    starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises "No available kernel" off it
        out = ref_prefill_attention(
            q, k_cache, v_cache, tables, starts, torch.tensor(lens, dtype=torch.int32), scale
        )
    for b, (n, s) in enumerate(zip(lens, starts.tolist(), strict=False)):
        nblk = -(-n // bs)
        keys = k_cache[tables[b, :nblk].long()].flatten(0, 1)[:n]
        vals = v_cache[tables[b, :nblk].long()].flatten(0, 1)[:n]
        want = dense(q[s : s + q_lens[b]], keys, vals, scale)
        assert_matches(out[s : s + q_lens[b]], want)


def brute_force(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, pos: int, window: int, scale: float
) -> torch.Tensor:
    """One query token [Hq, D] at position ``pos`` over keys [n, Hkv, D], head by head: a softmax
    over the positions it sees (``pos - window < j <= pos``; all ``j <= pos`` for window 0)."""
    hq, hkv = q.shape[0], keys.shape[1]
    lo = max(0, pos - window + 1) if window else 0
    out = torch.empty(q.shape)
    for h in range(hq):
        k, v = keys[lo : pos + 1, h // (hq // hkv)].double(), vals[lo : pos + 1, h // (hq // hkv)].double()  # fmt: skip
        probs = torch.softmax(k @ q[h].double() * scale, dim=0)
        out[h] = (probs @ v).float()
    return out


def _gather(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    nblk = -(-n // cache.shape[1])
    return cache[table[:nblk].long()].flatten(0, 1)[:n]


# window 0 (none), each query alone (1), narrower than the prefix (3, 7), and as wide as the
# longest context or wider (the same as none)
WINDOWS = [0, 1, 3, 7, 41, 1000]


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_reference_window_matches_a_softmax_per_query(window: int) -> None:
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, scale = 4, 2, 16, 8, 16**-0.5
    q_lens, lens = [9, 5, 1, 6], [9, 41, 20, 6]  # whole prompts, chunks after prefixes
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv(lens, bs, hkv, d, torch.float32, gen, cpu)
    q = rand((sum(q_lens), hq, d), torch.float32, gen, cpu)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = ref_prefill_attention(q, k_cache, v_cache, tables, starts, ctx, scale, window=window)
    for b, (n, m) in enumerate(zip(lens, q_lens, strict=True)):
        keys = _gather(k_cache, tables[b], n)
        vals = _gather(v_cache, tables[b], n)
        for i in range(m):
            row = int(starts[b]) + i
            want = brute_force(q[row], keys, vals, n - m + i, window, scale)
            assert_matches(out[row], want)
    if window >= max(lens):  # as wide as every context: no window
        assert_matches(out, ref_prefill_attention(q, k_cache, v_cache, tables, starts, ctx, scale))


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_reference_window_matches_a_softmax_per_query(window: int) -> None:
    gen = torch.Generator().manual_seed(6)
    hq, hkv, d, bs, scale = 4, 2, 16, 8, 16**-0.5
    lens = [1, 7, 8, 41]
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv(lens, bs, hkv, d, torch.float32, gen, cpu)
    q = rand((len(lens), hq, d), torch.float32, gen, cpu)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, window=window)
    for b, n in enumerate(lens):
        keys, vals = _gather(k_cache, tables[b], n), _gather(v_cache, tables[b], n)
        assert_matches(out[b], brute_force(q[b], keys, vals, n - 1, window, scale))
    if window >= max(lens):
        assert_matches(out, ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale))


def test_references_refuse_a_negative_window() -> None:
    gen = torch.Generator().manual_seed(7)
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv([5], 8, 1, 16, torch.float32, gen, cpu)
    q = rand((5, 1, 16), torch.float32, gen, cpu)
    ctx = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="window must be >= 0"):
        ref_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor([0, 5]), ctx, 0.25, window=-1
        )
    with pytest.raises(ValueError, match="window must be >= 0"):
        ref_paged_decode_attention(q[:1], k_cache, v_cache, tables, ctx, 0.25, window=-1)
