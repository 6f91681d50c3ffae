"""The model's attention dispatch: decode rows and prefill rows of one step, split between the
two kernels, give what causal attention over the whole batch gives; its MLP's gate_up and
SiLU-and-mul in one GEMV at batch 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kernels import ops
from kernels.attention import ref_prefill_attention
from services.engine.attention_metadata import AttentionMetadata
from services.engine.models.llama import MLP, paged_attention
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


def _interpreted_kernels(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """``kernels.ops`` running the Triton kernels on CPU tensors under the interpreter, as it
    runs them on a GPU; returns a log of the GEMV's calls (whether each fused SiLU-and-mul)."""
    from kernels import triton_gemv, triton_layers
    from tests.triton_interpreter import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (make test sets it)")
    modules = {"triton_gemv": triton_gemv, "triton_layers": triton_layers}
    monkeypatch.setattr(ops, "_triton", lambda name, t: modules.get(name))
    calls: list[bool] = []
    real = triton_gemv.gemv

    def gemv(*args: object, silu_and_mul: bool = False, **kwargs: object) -> torch.Tensor:
        calls.append(silu_and_mul)
        return real(*args, silu_and_mul=silu_and_mul, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_gemv, "gemv", gemv)
    return calls


def test_the_mlp_fuses_silu_into_the_gate_up_gemv_at_batch_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the batch-1 GEMV runs, gate_up and SiLU-and-mul are one kernel, with the bits of
    the two; a longer batch, another activation or a wrapped layer keep the two."""
    calls = _interpreted_kernels(monkeypatch)
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=40, mlp_bias=False)
    gen = torch.Generator().manual_seed(3)
    mlp = MLP(cfg).to(torch.bfloat16)  # type: ignore[arg-type]
    for p in mlp.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(torch.bfloat16)
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    fused = mlp(x)
    assert calls == [True, False]  # gate_up with its activation, then down
    two = ops.silu_and_mul(ops.linear(x, mlp.gate_up_proj.weight))
    assert torch.equal(fused, ops.linear(two, mlp.down_proj.weight))
    calls.clear()
    mlp(torch.randn(3, 64, generator=gen).to(torch.bfloat16))  # 3 rows: torch's matmul
    assert calls == []
    mlp.act_fn = ops.gelu_tanh_and_mul  # Gemma's: no fused form
    mlp(x)
    assert calls == [False, False]
    calls.clear()
    mlp.act_fn = ops.silu_and_mul
    mlp.gate_up_proj = nn.Sequential(mlp.gate_up_proj)  # a wrapper (as LoRA's) has no fused_act
    mlp(x)
    assert calls == [False, False]
