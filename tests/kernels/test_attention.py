"""The torch references of attention: prefill against a dense masked softmax, and on torch's fused
SDPA kernel (a 3-D call fell back to the math path, which holds every [q_len, n] score: on the CPU
that was 80% of a 4k-token prefill); decode on the fused kernel too, NaN past each context kept
out; prefill and decode with a sliding window against a softmax per query over the keys it sees;
attention sinks against transformers' gpt-oss softmax."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.attention import (
    StepMemo,
    ref_paged_decode_attention,
    ref_prefill_attention,
    ref_write_kv,
    soft_cap,
)
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


@pytest.mark.parametrize("window", [0, 5])
def test_decode_reference_runs_on_the_fused_kernel_and_ignores_nan_past_each_context(
    window: int,
) -> None:
    """Without soft-capping or sinks the decode reference is torch's fused attention (flash, on
    the CPU) over the gathered keys: NaN in the unwritten tail of a sequence's last block is
    never read into the output, the cache itself is left as it was, and each row is the
    softmax over the keys it sees."""
    gen = torch.Generator().manual_seed(8)
    hq, hkv, d, bs, scale = 6, 2, 16, 8, 16**-0.5
    lens = [3, 8, 13, 30]
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv(lens, bs, hkv, d, torch.float32, gen, cpu)
    for b, n in enumerate(lens):  # the slots past each context in its last block
        last = int(tables[b, (n - 1) // bs])
        k_cache[last, (n - 1) % bs + 1 :] = float("nan")
        v_cache[last, (n - 1) % bs + 1 :] = float("nan")
    kept = k_cache.clone(), v_cache.clone()
    q = rand((len(lens), hq, d), torch.float32, gen, cpu)
    ctx = torch.tensor(lens, dtype=torch.int32)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises "No available kernel" off it
        out = ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, window=window)
    assert bool(torch.isfinite(out).all())
    assert torch.allclose(k_cache, kept[0], equal_nan=True)
    assert torch.allclose(v_cache, kept[1], equal_nan=True)
    for b, n in enumerate(lens):
        keys, vals = _gather(k_cache, tables[b], n), _gather(v_cache, tables[b], n)
        assert_matches(out[b], brute_force(q[b], keys, vals, n - 1, window, scale))


def test_decode_reference_takes_caches_whose_blocks_are_not_one_run_of_slots() -> None:
    """A cache laid out [bs, N, ...] and viewed [N, bs, ...] (its slots not one run): the
    blocks are gathered whole instead, the same output as from a contiguous copy."""
    gen = torch.Generator().manual_seed(9)
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv([5, 20], 8, 2, 16, torch.float32, gen, cpu)
    q = rand((2, 4, 16), torch.float32, gen, cpu)
    ctx = torch.tensor([5, 20], dtype=torch.int32)
    k_odd = k_cache.transpose(0, 1).contiguous().transpose(0, 1)
    v_odd = v_cache.transpose(0, 1).contiguous().transpose(0, 1)
    assert k_odd.stride(0) != k_odd.shape[1] * k_odd.stride(1)
    want = ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25)
    assert_matches(ref_paged_decode_attention(q, k_odd, v_odd, tables, ctx, 0.25), want)


def _five_tokens(seed: int, q_heads: int) -> tuple[torch.Tensor, ...]:
    """(k_cache, v_cache, tables, q, context_lens) of one 5-token sequence, one KV head of 16:
    what the argument checks below call the references with."""
    gen = torch.Generator().manual_seed(seed)
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv([5], 8, 1, 16, torch.float32, gen, cpu)
    q = rand((5, q_heads, 16), torch.float32, gen, cpu)
    return k_cache, v_cache, tables, q, torch.tensor([5], dtype=torch.int32)


def test_references_refuse_a_negative_window() -> None:
    k_cache, v_cache, tables, q, ctx = _five_tokens(7, 1)
    with pytest.raises(ValueError, match="window must be >= 0"):
        ref_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor([0, 5]), ctx, 0.25, window=-1
        )
    with pytest.raises(ValueError, match="window must be >= 0"):
        ref_paged_decode_attention(q[:1], k_cache, v_cache, tables, ctx, 0.25, window=-1)


def concat_softmax(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, qpos: torch.Tensor, sinks: torch.Tensor,
    scale: float, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """transformers' eager gpt-oss attention, in float64: queries [q_len, Hq, D] at positions
    ``qpos`` over keys [n, Hkv, D] at 0 ..< n: dense (capped) scores, the causal and window
    mask, a column of sinks concatenated, softmax, the sink column dropped, times the values."""
    q_len, hq, _ = q.shape
    k = keys.double().repeat_interleave(hq // keys.shape[1], dim=1)
    v = vals.double().repeat_interleave(hq // keys.shape[1], dim=1)
    scores = soft_cap(torch.einsum("qhd,khd->hqk", q.double(), k) * scale, softcap)
    kpos = torch.arange(keys.shape[0])
    allowed = kpos[None, :] <= qpos[:, None]  # [q_len, n]
    if window:
        allowed &= kpos[None, :] > qpos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))  # [Hq, q_len, n]
    column = sinks.double()[:, None, None].expand(hq, q_len, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v).float()


# GQA (2 query heads a KV head), a whole prompt, a chunk after a 36-token prefix and a single
# token (one key); sinks from far below the scores to far above (some heads' sink dominates)
SINK_Q_LENS, SINK_LENS = [9, 5, 1], [9, 41, 1]


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (3, 0.0), (3, 2.0)])
def test_references_with_sinks_match_transformers_concatenated_softmax(
    window: int, softcap: float
) -> None:
    gen = torch.Generator().manual_seed(8)
    hq, hkv, d, bs, scale = 4, 2, 16, 8, 16**-0.5
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv(SINK_LENS, bs, hkv, d, torch.float32, gen, cpu)
    q = rand((sum(SINK_Q_LENS), hq, d), torch.float32, gen, cpu)
    starts = torch.tensor([0, *SINK_Q_LENS]).cumsum(0).to(torch.int32)
    ctx = torch.tensor(SINK_LENS, dtype=torch.int32)
    sinks = torch.tensor([-3.0, 0.5, 2.0, 4.0])
    cap = {"window": window, "softcap": softcap}
    out = ref_prefill_attention(q, k_cache, v_cache, tables, starts, ctx, scale, sinks=sinks, **cap)  # fmt: skip
    for b, (n, m) in enumerate(zip(SINK_LENS, SINK_Q_LENS, strict=True)):
        keys, vals = _gather(k_cache, tables[b], n), _gather(v_cache, tables[b], n)
        s = int(starts[b])
        want = concat_softmax(q[s : s + m], keys, vals, torch.arange(n - m, n), sinks, scale, **cap)
        assert_matches(out[s : s + m], want)
    # decode, the sinks in bf16 (any float dtype, read as float32)
    sinks16 = sinks.bfloat16()
    qd = rand((len(SINK_LENS), hq, d), torch.float32, gen, cpu)
    got = ref_paged_decode_attention(qd, k_cache, v_cache, tables, ctx, scale, sinks=sinks16, **cap)  # fmt: skip
    for b, n in enumerate(SINK_LENS):
        keys, vals = _gather(k_cache, tables[b], n), _gather(v_cache, tables[b], n)
        want = concat_softmax(qd[b : b + 1], keys, vals, torch.tensor([n - 1]), sinks16, scale, **cap)  # fmt: skip
        assert_matches(got[b : b + 1], want)


def test_a_very_negative_sink_is_no_sink_and_a_large_one_shrinks_the_output() -> None:
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d, scale = 4, 2, 16, 16**-0.5
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv(SINK_LENS, 8, hkv, d, torch.float32, gen, cpu)
    q = rand((sum(SINK_Q_LENS), hq, d), torch.float32, gen, cpu)
    starts = torch.tensor([0, *SINK_Q_LENS]).cumsum(0).to(torch.int32)
    ctx = torch.tensor(SINK_LENS, dtype=torch.int32)

    def prefill(sinks: torch.Tensor | None) -> torch.Tensor:
        return ref_prefill_attention(q, k_cache, v_cache, tables, starts, ctx, scale, sinks=sinks)

    def decode(sinks: torch.Tensor | None) -> torch.Tensor:
        return ref_paged_decode_attention(q[:3], k_cache, v_cache, tables, ctx, scale, sinks=sinks)

    for run in (prefill, decode):
        plain = run(None)
        torch.testing.assert_close(run(torch.full((hq,), -1e4)), plain, rtol=1e-5, atol=1e-6)
        # the keys' weights sum to Z / (Z + e^sink): each head's output scaled toward 0
        norms = [run(torch.full((hq,), x)).norm() for x in (0.0, 3.0)]
        assert plain.norm() > norms[0] > norms[1]
        assert float(run(torch.full((hq,), 40.0)).abs().max()) < 1e-9


def test_references_refuse_sinks_that_are_not_one_per_query_head() -> None:
    k_cache, v_cache, tables, q, ctx = _five_tokens(10, 2)
    prefill = (q, k_cache, v_cache, tables, torch.tensor([0, 5]), ctx, 0.25)
    decode = (q[:1], k_cache, v_cache, tables, ctx, 0.25)
    bad = [
        (torch.zeros(3), r"sinks has shape \(3,\); expected \[num_q_heads\] = \(2,\)"),
        (torch.zeros(1, 2), r"sinks has shape \(1, 2\)"),
        (torch.zeros(2, dtype=torch.int32), "sinks has dtype torch.int32"),
        (torch.zeros(2, device="meta"), "sinks is on meta; expected q's device cpu"),
    ]
    for sinks, msg in bad:
        with pytest.raises(ValueError, match=msg):
            ref_prefill_attention(*prefill, sinks=sinks)
        with pytest.raises(ValueError, match=msg):
            ref_paged_decode_attention(*decode, sinks=sinks)


@pytest.mark.parametrize("window", [0, 3, 7])
def test_prefill_reference_image_spans_match_transformers_gemma3_mask(window: int) -> None:
    # transformers' Gemma 3 mask (masking_utils): a key is seen when (causal OR in the query's
    # image) AND inside the window; here a whole prompt with two images, a chunk after a prefix
    # whose image starts it, and a text-only chunk
    gen = torch.Generator().manual_seed(6)
    hq, hkv, d, bs, scale = 4, 2, 16, 8, 16**-0.5
    q_lens, lens = [20, 9, 4], [20, 30, 11]
    images = [[(2, 5), (10, 8)], [(21, 6)], []]  # (start, length), sequence positions
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv(lens, bs, hkv, d, torch.float32, gen, cpu)
    q = rand((sum(q_lens), hq, d), torch.float32, gen, cpu)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    span_last = []
    for n, m, imgs in zip(lens, q_lens, images, strict=True):
        for p in range(n - m, n):
            span_last.append(next((o + k - 1 for o, k in imgs if o <= p < o + k), 0))
    spans = torch.tensor(span_last, dtype=torch.int32)
    out = ref_prefill_attention(q, k_cache, v_cache, tables, starts, ctx, scale, window=window,
                                span_last=spans)  # fmt: skip
    for b, (n, m) in enumerate(zip(lens, q_lens, strict=True)):
        keys = _gather(k_cache, tables[b], n).double()
        vals = _gather(v_cache, tables[b], n).double()
        block = torch.full((n,), -1)  # transformers' block ids: each image's tokens one group
        for g, (o, k) in enumerate(images[b]):
            block[o : o + k] = g
        for i in range(m):
            row, p = int(starts[b]) + i, n - m + i
            kpos = torch.arange(n)
            seen = (kpos <= p) | ((block == block[p]) & (block[p] >= 0))
            if window:
                seen &= kpos > p - window
            for h in range(hq):
                kh, vh = keys[seen, h // (hq // hkv)], vals[seen, h // (hq // hkv)]
                probs = torch.softmax(kh @ q[row, h].double() * scale, dim=0)
                assert_matches(out[row, h], (probs @ vh).float())


def test_a_step_memo_reuses_the_decode_gather_plan_only_for_the_same_unchanged_tensors() -> None:
    """Layers of one step share a StepMemo: each layer's output (its own q and caches) is the
    one computed without a memo; a window, a slice taken anew, or a length changed in place is
    a different plan, never the stale one."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, bs, scale = 4, 2, 16, 8, 16**-0.5
    lens = [2, 9, 17]
    cpu = torch.device("cpu")
    memo = StepMemo()
    ctx = torch.tensor(lens, dtype=torch.int32)
    k0, v0, tables = paged_kv(lens, bs, hkv, d, torch.float32, gen, cpu)
    # each layer's own caches at the same block ids, as in a step
    caches = [(k0 * (i + 1), v0 - i, tables) for i in range(3)]
    for (k_cache, v_cache, _), window in zip(caches, [0, 4, 0], strict=True):
        q = rand((len(lens), hq, d), torch.float32, gen, cpu)
        want = ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, window=window)
        got = ref_paged_decode_attention(
            q, k_cache, v_cache, tables, ctx, scale, window=window, memo=memo
        )
        assert torch.equal(got, want)
    k_cache, v_cache, _ = caches[0]
    q = rand((len(lens), hq, d), torch.float32, gen, cpu)
    ctx[2] = 5  # in place: the plan of 17 keys must not be used for 5
    assert torch.equal(
        ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, memo=memo),
        ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale),
    )
    rows = tables[:2], ctx[:2]  # new views: a miss, and the right rows
    assert torch.equal(
        ref_paged_decode_attention(q[:2], k_cache, v_cache, *rows, scale, memo=memo),
        ref_paged_decode_attention(q[:2], k_cache, v_cache, *rows, scale),
    )


def test_a_step_memo_sees_a_slot_mapping_changed_in_place() -> None:
    """The "every token has a slot" check is reused for the same slot mapping only while it is
    unchanged: a slot set to -1 afterwards is skipped, not written."""
    memo = StepMemo()
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    slots = torch.tensor([1, 6], dtype=torch.int64)
    k = torch.ones(2, 1, 2)
    ref_write_kv(k, k, k_cache, v_cache, slots, memo=memo)
    assert float(k_cache.flatten(0, 1)[[1, 6]].sum()) == 4.0
    slots[1] = -1
    ref_write_kv(2 * k, 2 * k, k_cache, v_cache, slots, memo=memo)
    flat = k_cache.flatten(0, 1)
    assert flat[1].tolist() == [[2.0, 2.0]] and flat[6].tolist() == [[1.0, 1.0]]


def test_a_step_memo_works_on_inference_tensors() -> None:
    """The engine runs under ``torch.inference_mode``, whose tensors carry no version counter:
    the memo still serves their layers (identity decides) and a new tensor is a miss."""
    gen = torch.Generator().manual_seed(12)
    hq, hkv, d, bs, scale = 2, 1, 8, 4, 8**-0.5
    lens = [3, 6]
    cpu = torch.device("cpu")
    with torch.inference_mode():
        memo = StepMemo()
        k_cache, v_cache, tables = paged_kv(lens, bs, hkv, d, torch.float32, gen, cpu)
        ctx = torch.tensor(lens, dtype=torch.int32)
        assert ctx.is_inference()
        for _ in range(2):
            q = rand((len(lens), hq, d), torch.float32, gen, cpu)
            assert torch.equal(
                ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, memo=memo),
                ref_paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale),
            )
        shorter = torch.tensor([3, 2], dtype=torch.int32)  # another step's lengths: a miss
        q = rand((len(lens), hq, d), torch.float32, gen, cpu)
        assert torch.equal(
            ref_paged_decode_attention(q, k_cache, v_cache, tables, shorter, scale, memo=memo),
            ref_paged_decode_attention(q, k_cache, v_cache, tables, shorter, scale),
        )
