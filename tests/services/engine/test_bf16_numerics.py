"""Our layer references round where transformers' Llama code rounds: bit for bit in bf16/fp16.

RMSNorm against ``LlamaRMSNorm``, SiLU-and-mul against ``ACT2FN["silu"](gate) * up``, and rotary
(our fp32 cos/sin table, then ``ref_rotary_embedding``) against ``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb``, on random CPU inputs. The Triton kernels are held to these references
in tests/kernels.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kernels.attention import ref_rotary_write_kv
from kernels.layers import (
    ref_gelu_tanh_and_mul,
    ref_gemma_rms_norm,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)
from services.engine.rope import cos_sin_cache

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20240611)


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


# ---- RMSNorm -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [96, 576])
def test_rms_norm_equals_llama_rms_norm(dtype: torch.dtype, width: int, gen: torch.Generator) -> None:  # fmt: skip
    x = randn((33, width), dtype, gen, scale=3.0)
    weight = randn((width,), dtype, gen)
    out, res = ref_rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and res is x
    assert torch.equal(out, hf_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_add_then_norm_equals_transformers(dtype: torch.dtype, gen: torch.Generator) -> None:  # fmt: skip
    """``hidden = residual + hidden`` in the model dtype, then the norm of that sum."""
    x, residual = randn((17, 192), dtype, gen, 4.0), randn((17, 192), dtype, gen, 4.0)
    weight = randn((192,), dtype, gen)
    out, summed = ref_rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed, residual + x)
    assert torch.equal(out, hf_rms_norm(residual + x, weight, 1e-6))


def test_rms_norm_rounds_before_the_weight(gen: torch.Generator) -> None:
    """Not one rounding of fp32 ``x * rstd * w``: that differs from transformers somewhere."""
    x, weight = randn((64, 576), torch.bfloat16, gen, 3.0), randn((576,), torch.bfloat16, gen)
    xf = x.float()
    once = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).bfloat16()
    assert not torch.equal(once, ref_rms_norm(x, weight, 1e-5)[0])


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)])  # fmt: skip
def test_mixed_dtypes_give_the_promoted_product_in_x_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, gen: torch.Generator) -> None:  # fmt: skip
    """transformers returns torch's promoted dtype; we return x's dtype: that result, cast."""
    x, weight = randn((9, 96), x_dtype, gen, 3.0), randn((96,), w_dtype, gen)
    out = ref_rms_norm(x, weight, 1e-5)[0]
    assert out.dtype == x_dtype
    assert torch.equal(out, hf_rms_norm(x, weight, 1e-5).to(x_dtype))


# ---- SiLU-and-mul --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_act_fn_times_up(dtype: torch.dtype, gen: torch.Generator) -> None:
    gate, up = randn((31, 1536), dtype, gen, 4.0), randn((31, 1536), dtype, gen, 4.0)
    want = ACT2FN["silu"](gate) * up
    assert torch.equal(ref_silu_and_mul(torch.cat([gate, up], dim=-1)), want)
    once = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
    assert dtype == torch.float32 or not torch.equal(once, want)  # the rounding in between matters


# ---- Gemma 3's norm and GELU-and-mul -----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_equals_gemma3_rms_norm(dtype: torch.dtype, gen: torch.Generator) -> None:
    """``1 + weight`` in fp32 and one rounding after the product; with the residual added in
    the model dtype first, as the Gemma 3 layer does."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x, residual = randn((17, 192), dtype, gen, 4.0), randn((17, 192), dtype, gen, 4.0)
    weight = randn((192,), dtype, gen, 0.3)
    norm = Gemma3RMSNorm(192, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert torch.equal(ref_gemma_rms_norm(x, weight, 1e-6)[0], norm(x))
        out, summed = ref_gemma_rms_norm(x, weight, 1e-6, residual)
        assert torch.equal(summed, residual + x) and torch.equal(out, norm(residual + x))
    if dtype != torch.float32:  # the Llama order (round, then the weight) differs somewhere
        assert not torch.equal(ref_rms_norm(x, 1 + weight, 1e-6)[0], norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_equals_act_fn_times_up(dtype: torch.dtype, gen: torch.Generator) -> None:
    gate, up = randn((31, 1536), dtype, gen, 4.0), randn((31, 1536), dtype, gen, 4.0)
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up
    assert torch.equal(ref_gelu_tanh_and_mul(torch.cat([gate, up], dim=-1)), want)


# ---- rotary --------------------------------------------------------------------------------
LLAMA3 = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}  # fmt: skip
ROPES: list[Any] = [
    pytest.param(64, {"rope_type": "default", "rope_theta": 100000.0}, id="default-smollm2"),
    pytest.param(128, {"rope_type": "default", "rope_theta": 10000.0}, id="default-llama2"),
    pytest.param(128, LLAMA3, id="llama3"),
    pytest.param(64, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, id="linear"),
]
MAX_POS = 12288


def hf_rope(head_dim: int, rope: dict[str, Any]) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=MAX_POS, rope_parameters=dict(rope),
    )  # fmt: skip
    return LlamaRotaryEmbedding(config)


def our_table(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    return cos_sin_cache(head_dim, MAX_POS, float(rope["rope_theta"]), rope)


def positions_for_test(gen: torch.Generator) -> torch.Tensor:
    spread = torch.randint(0, MAX_POS, (40,), generator=gen)
    return torch.cat([torch.tensor([0, 1, 2, 31, 1000, 8191, 8192, MAX_POS - 1]), spread])


@pytest.mark.parametrize(("head_dim", "rope"), ROPES)
def test_cos_sin_table_equals_transformers_fp32(head_dim: int, rope: dict[str, Any], gen: torch.Generator) -> None:  # fmt: skip
    pos = positions_for_test(gen)
    cos, sin = hf_rope(head_dim, rope)(torch.zeros(1, dtype=torch.float32), pos[None, :])
    half = head_dim // 2
    table = our_table(head_dim, rope)
    assert table.dtype == torch.float32 and table.shape == (MAX_POS, head_dim)
    assert torch.equal(table[pos, :half], cos[0, :, :half])
    assert torch.equal(table[pos, half:], sin[0, :, :half])
    assert torch.equal(cos[0, :, half:], cos[0, :, :half])  # transformers' halves are repeats


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rope"), ROPES)
def test_rotary_equals_apply_rotary_pos_emb(dtype: torch.dtype, head_dim: int, rope: dict[str, Any], gen: torch.Generator) -> None:  # fmt: skip
    pos = positions_for_test(gen)
    t = pos.shape[0]
    q, k = randn((t, 4, head_dim), dtype, gen, 3.0), randn((t, 2, head_dim), dtype, gen, 3.0)
    cos, sin = hf_rope(head_dim, rope)(q, pos[None, :])  # cast to q's dtype by transformers
    assert cos.dtype == dtype
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours_q, ours_k = q.clone(), k.clone()
    ref_rotary_embedding(pos, ours_q, ours_k, our_table(head_dim, rope))
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rotary_write_kv_rotates_like_transformers(dtype: torch.dtype, gen: torch.Generator) -> None:  # fmt: skip
    head_dim, rope = 64, {"rope_type": "default", "rope_theta": 100000.0}
    pos = positions_for_test(gen)[:16]
    q, k, v = (randn((16, h, head_dim), dtype, gen, 3.0) for h in (4, 2, 2))
    cos, sin = hf_rope(head_dim, rope)(q, pos[None, :])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    k_cache, v_cache = torch.zeros((4, 4, 2, head_dim), dtype=dtype), torch.zeros((4, 4, 2, head_dim), dtype=dtype)  # fmt: skip
    slots = torch.arange(16)
    out = ref_rotary_write_kv(pos, q, k, v, our_table(head_dim, rope), k_cache, v_cache, slots)
    assert torch.equal(out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_cache.flatten(0, 1), hf_k[0].transpose(0, 1))
    assert torch.equal(v_cache.flatten(0, 1), v)
