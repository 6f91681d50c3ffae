"""The model's attention dispatch: decode rows and prefill rows of one step, split between the
two kernels, give what causal attention over the whole batch gives."""

from __future__ import annotations

import torch

from kernels.attention import ref_prefill_attention
from services.engine.attention_metadata import AttentionMetadata
from services.engine.models.llama import paged_attention
from tests.kernels.paged import assert_matches, paged_kv


def _case(ctx: list[int], new: list[int]) -> tuple:
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, tables = paged_kv(ctx, 8, 2, 16, torch.float32, gen, torch.device("cpu"))
    qsl = torch.tensor([0, *new]).cumsum(0).to(torch.int32)
    q = torch.randn((int(qsl[-1]), 8, 16), generator=gen)
    return q, k_cache, v_cache, tables, qsl, torch.tensor(ctx, dtype=torch.int32)


def test_mixed_step_matches_causal_attention_over_the_whole_batch() -> None:
    ctx, new = [9, 17, 1, 40, 23], [1, 1, 1, 15, 23]  # three decodes, a chunk, a whole prompt
    q, kc, vc, tables, qsl, lens = _case(ctx, new)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=tables, context_lens=lens,
        query_start_loc=qsl, num_decodes=3, prefill_start_loc=qsl[3:] - 3,
    )  # fmt: skip
    out = paged_attention(q, kc, vc, meta, 0.25)
    assert_matches(out, ref_prefill_attention(q, kc, vc, tables, qsl, lens, 0.25))


def test_all_decode_and_all_prefill_steps() -> None:
    for ctx, new, nd in (([5, 30], [1, 1], 2), ([12, 30], [12, 4], 0)):
        q, kc, vc, tables, qsl, lens = _case(ctx, new)
        meta = AttentionMetadata(torch.zeros(0), tables, lens, qsl, num_decodes=nd)
        out = paged_attention(q, kc, vc, meta, 0.25)
        assert_matches(out, ref_prefill_attention(q, kc, vc, tables, qsl, lens, 0.25))
