"""The torch reference of prefill attention: against a dense masked softmax, and on torch's fused
SDPA kernel (a 3-D call fell back to the math path, which holds every [q_len, n] score: on the CPU
that was 80% of a 4k-token prefill)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.attention import ref_prefill_attention
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
