"""The dispatch the engine calls: references on the CPU, Triton on CUDA, no hard triton import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import ops
from kernels.attention import ref_paged_decode_attention, ref_prefill_attention
from tests.kernels.paged import assert_matches, paged_kv, rand

REPO = Path(__file__).resolve().parents[2]

WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError, as on macOS
import torch
from kernels import ops
from kernels.attention import ref_prefill_attention
from kernels.layers import ref_rms_norm

assert not ops.triton_available()
x, w = torch.randn(3, 8), torch.randn(8)
out, res = ops.rms_norm(x, w, 1e-6, x)
assert torch.equal(out, ref_rms_norm(x, w, 1e-6, x)[0])
kc, vc = torch.randn(4, 4, 1, 8), torch.randn(4, 4, 1, 8)
tables = torch.tensor([[2, 0]], dtype=torch.int32)
args = (torch.randn(6, 2, 8), kc, vc, tables, torch.tensor([0, 6], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32), 0.3)
assert torch.equal(ops.prefill_attention(*args), ref_prefill_attention(*args))
print("ok")
"""


def test_cpu_tensors_use_the_references_and_triton_is_optional() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_cpu_dispatch_matches_the_reference_exactly(gen: torch.Generator) -> None:
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv([3, 20], 8, 2, 16, torch.float32, gen, cpu)
    q = rand((2, 4, 16), torch.float32, gen, cpu)
    lens = torch.tensor([3, 20], dtype=torch.int32)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    assert torch.equal(out, ref_paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25))


def test_cpu_dispatch_passes_the_sinks_to_the_references(gen: torch.Generator) -> None:
    cpu = torch.device("cpu")
    k_cache, v_cache, tables = paged_kv([3, 20], 8, 2, 16, torch.float32, gen, cpu)
    lens = torch.tensor([3, 20], dtype=torch.int32)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    q = rand((2, 4, 16), torch.float32, gen, cpu)
    decode = (q, k_cache, v_cache, tables, lens, 0.25)
    out = ops.paged_decode_attention(*decode, sinks=sinks)
    assert torch.equal(out, ref_paged_decode_attention(*decode, sinks=sinks))
    assert not torch.allclose(out, ops.paged_decode_attention(*decode))
    qp = rand((13, 4, 16), torch.float32, gen, cpu)
    qsl = torch.tensor([0, 3, 13], dtype=torch.int32)  # a whole prompt, a chunk after 10 keys
    prefill = (qp, k_cache, v_cache, tables, qsl, lens, 0.25)
    out = ops.prefill_attention(*prefill, window=4, sinks=sinks)
    assert torch.equal(out, ref_prefill_attention(*prefill, window=4, sinks=sinks))
    assert not torch.allclose(out, ops.prefill_attention(*prefill, window=4))


def test_env_switch_forces_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    ops.triton_available.cache_clear()
    monkeypatch.setenv("TANDEM_KERNELS", "ref")
    try:
        assert not ops.triton_available()
    finally:
        ops.triton_available.cache_clear()


@pytest.mark.gpu
def test_cuda_tensors_go_through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.triton_attention as ta

    calls = []
    real = ta.paged_decode_attention
    monkeypatch.setattr(
        ta, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    gen, cuda = torch.Generator().manual_seed(0), torch.device("cuda")
    k_cache, v_cache, tables = paged_kv([300, 17], 16, 8, 128, torch.bfloat16, gen, cuda)
    q = rand((2, 32, 128), torch.bfloat16, gen, cuda)
    lens = torch.tensor([300, 17], dtype=torch.int32, device=cuda)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
    assert calls == [1]
    assert_matches(out, ref_paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1))


@pytest.mark.parametrize("rows", [1, 16, 17, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "scale_cols"), [(64, 128, 1), (64, 128, 2), (72, 128, 1), (64, 120, 1)])  # fmt: skip
def test_takes_w8a8_says_what_fp8_linear_does(monkeypatch: pytest.MonkeyPatch, rows: int, dtype: torch.dtype, n: int, k: int, scale_cols: int) -> None:  # fmt: skip
    """A layer before an FP8 one hands it a quantized input exactly when the layer would have
    quantized it itself (W8A8): the two decisions must not drift apart."""
    from types import SimpleNamespace

    taken: list[str] = []
    fake = SimpleNamespace(
        per_token_quant_fp8=None,
        fp8_linear=lambda *a, **kw: taken.append("weight-only") or torch.zeros(rows, n),
    )
    monkeypatch.setattr(ops, "_triton", lambda module, t: fake)  # an FP8 GPU, stood in for
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    monkeypatch.setattr(ops, "fp8_supported", lambda device: True)
    monkeypatch.setattr(
        ops, "scaled_mm_w8a8_linear", lambda *a, **kw: taken.append("w8a8") or torch.zeros(rows, n)
    )
    x = torch.zeros(rows, k, dtype=dtype)
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.ones(n, scale_cols)
    ops.fp8_linear(x, w, scale, k // scale_cols)
    assert taken == ["w8a8" if ops.takes_w8a8(x, w, scale) else "weight-only"]


def test_linear_on_cpu_is_torch_linear(gen: torch.Generator) -> None:
    x, w, b = torch.randn(1, 16, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(8)
    assert torch.equal(ops.linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.gpu
def test_batch_one_linear_goes_through_the_triton_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.triton_gemv as tg
    from kernels.gemv import ref_gemv

    calls = []
    real = tg.gemv
    monkeypatch.setattr(tg, "gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen, cuda = torch.Generator().manual_seed(0), torch.device("cuda")
    x1, x4 = rand((1, 4096), torch.bfloat16, gen, cuda), rand((4, 4096), torch.bfloat16, gen, cuda)
    w = rand((4096, 4096), torch.bfloat16, gen, cuda)
    out = ops.linear(x1, w)
    ops.linear(x4, w)  # a batch of 4: cuBLAS (default TANDEM_GEMV_ROWS=1)
    assert calls == [1]
    assert_matches(out / 64, ref_gemv(x1, w) / 64)


def test_row_invariance_takes_at_most_the_gemv_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # a process-wide setting: an engine with drafts in an earlier test of this worker sets it
    monkeypatch.setattr(ops, "_row_invariant", 3)
    with pytest.raises(ValueError, match="0 to 8 rows"):
        ops.set_row_invariant(9)
    assert ops.row_invariant() == 3  # a refused value leaves the setting as it was


@pytest.mark.gpu
def test_row_invariant_batches_compute_each_row_as_alone() -> None:
    """With drafts, the engine makes short batches row-invariant: a linear layer and decode
    attention (the general and the latent one) give a batch of 8 the bits of 8 batches of one
    (cuBLAS and the batch-dependent split of the context would not)."""
    gen, cuda, dt = torch.Generator().manual_seed(0), torch.device("cuda"), torch.bfloat16
    x, w = rand((8, 2048), dt, gen, cuda), rand((6144, 2048), dt, gen, cuda)
    lens = [3000, 17, 1, 4096, 900, 2500, 64, 1500]
    k_cache, v_cache, tables = paged_kv(lens, 16, 2, 64, dt, gen, cuda)
    q, ctx = rand((8, 8, 64), dt, gen, cuda), torch.tensor(lens, dtype=torch.int32, device=cuda)
    try:
        ops.set_row_invariant(8)
        whole = ops.linear(x, w)
        attn = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125)
        for i in range(8):
            one = slice(i, i + 1)
            assert torch.equal(ops.linear(x[one], w), whole[one])
            alone = ops.paged_decode_attention(
                q[one], k_cache, v_cache, tables[one], ctx[one], 0.125
            )
            assert torch.equal(alone, attn[one])
        # DeepSeek's latent decode: 16 heads over one 64 + 512-dim row a token
        cache, _, tables = paged_kv(lens, 16, 1, 576, dt, gen, cuda)
        q = rand((8, 16, 576), dt, gen, cuda)
        latent = ops.mla_decode_attention(q, cache, tables, ctx, 0.07, 64)
        for i in range(8):
            one = slice(i, i + 1)
            alone = ops.mla_decode_attention(q[one], cache, tables[one], ctx[one], 0.07, 64)
            assert torch.equal(alone, latent[one])
    finally:
        ops.set_row_invariant(0)


def test_cpu_moe_dispatch_is_the_reference(gen: torch.Generator) -> None:
    from kernels.moe import ref_fused_moe

    cpu = torch.device("cpu")
    x, w13, w2 = (rand(s, torch.float32, gen, cpu) for s in ((5, 16), (4, 24, 16), (4, 16, 12)))
    weights, ids = ops.moe_routing(rand((5, 4), torch.float32, gen, cpu), 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    out = ops.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(out, ref_fused_moe(x, w13, w2, weights, ids))
