"""The kernel entry points the engine calls: Triton on CUDA tensors, the torch references elsewhere.

Triton is imported lazily and only when a CUDA tensor arrives, so importing this module works on
machines without triton (macOS) or without a GPU. ``TANDEM_KERNELS=ref`` forces the references
everywhere (for debugging a suspected kernel bug).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType

import torch

from kernels import cpu_linear
from kernels.attention import (
    StepMemo,
    ref_mla_decode_attention,
    ref_paged_decode_attention,
    ref_prefill_attention,
    ref_rotary_write_kv,
    ref_varlen_attention,
    ref_write_kv,
)
from kernels.block_copy import ref_fence_cas, ref_gather_blocks, ref_scatter_blocks
from kernels.checksum import ref_checksum
from kernels.gemv import GEMV_MAX_ROWS
from kernels.layers import (
    ref_gelu_tanh_and_mul,
    ref_gemma_rms_norm,
    ref_rms_norm,
    ref_rotary_embedding,
    ref_silu_and_mul,
)
from kernels.lora import ref_add_lora, ref_expand_lora
from kernels.moe import (
    ClampedSwiGLU,
    Fp8Scales,
    Int4Scales,
    int4_scales_of,
    ref_fused_moe,
    ref_grouped_topk,
    ref_moe_routing,
    scales_of,
)
from kernels.quant import (
    ref_fp8_linear,
    ref_per_token_quant_fp8,
    ref_w4a16_linear,
    scaled_mm_fp8,
    scaled_mm_w8a8_linear,
)

__all__ = [
    "add_lora",
    "checksum",
    "expand_lora",
    "fence_cas",
    "fp8_input_linear",
    "fp8_linear",
    "fp8_supported",
    "fused_moe",
    "gather_blocks",
    "gemv_rows",
    "grouped_topk",
    "linear",
    "moe_routing",
    "paged_decode_attention",
    "prefill_attention",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_embedding",
    "rotary_write_kv",
    "scatter_blocks",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "takes_w8a8",
    "triton_available",
    "varlen_attention",
    "w4a16_linear",
    "write_kv",
]


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernels can run here (triton importable, not disabled by env)."""
    if os.environ.get("TANDEM_KERNELS", "").lower() == "ref":
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


def _triton(module: str, t: torch.Tensor) -> ModuleType | None:
    """The Triton module to use for tensor ``t``, or None for the reference path."""
    if t.device.type != "cuda" or not triton_available():
        return None
    from kernels import (
        triton_attention,
        triton_block_copy,
        triton_checksum,
        triton_gemv,
        triton_layers,
        triton_lora,
        triton_mla,
        triton_moe,
        triton_quant,
        triton_routing,
    )

    modules = {
        "triton_attention": triton_attention,
        "triton_block_copy": triton_block_copy,
        "triton_checksum": triton_checksum,
        "triton_gemv": triton_gemv,
        "triton_layers": triton_layers,
        "triton_lora": triton_lora,
        "triton_mla": triton_mla,
        "triton_moe": triton_moe,
        "triton_quant": triton_quant,
        "triton_routing": triton_routing,
    }
    return modules[module]


@functools.cache
def gemv_rows() -> int:
    """Batches of at most this many rows go through the Triton GEMV (``TANDEM_GEMV_ROWS``,
    default 1; 0 sends every linear layer to cuBLAS)."""
    return int(os.environ.get("TANDEM_GEMV_ROWS", "1"))


# Batches of at most this many rows compute every row as a batch of one would, bit for bit:
# linear layers through the Triton GEMV (each row's sums the same whatever the batch), decode
# attention split as for one sequence. Set by the engine (``set_row_invariant``) when it
# verifies drafts: a verify step's rows then equal the steps of plain decoding they replace.
_row_invariant = 0


def set_row_invariant(rows: int) -> None:
    """Make batches of up to ``rows`` rows (at most the GEMV's 8) row-invariant; 0: off."""
    global _row_invariant
    if not 0 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"row-invariant batches take 0 to {GEMV_MAX_ROWS} rows, got {rows}")
    _row_invariant = rows


def row_invariant() -> int:
    return _row_invariant


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """A linear layer: the Triton GEMV for batch-1 decode on CUDA (and for the short batches
    made row-invariant), cuBLAS otherwise; oneDNN for a CPU weight in its layout
    (:mod:`kernels.cpu_linear`)."""
    if weight.is_mkldnn:
        return cpu_linear.linear(x, weight, bias)
    rows = max(gemv_rows(), _row_invariant)
    if bias is None and x.dim() == 2 and 0 < x.shape[0] <= rows:
        mod = _triton("triton_gemv", x)
        if mod is not None:
            return mod.gemv(x, weight, config=mod.pick_config(*weight.shape, weight.device))
    return torch.nn.functional.linear(x, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [2I, K]: gate rows, then up rows
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:  # [M, I]
    """``silu_and_mul(linear(x, weight, bias))`` in one kernel where :func:`linear` takes the
    Triton GEMV (batch-1 decode on CUDA, and the row-invariant batches): the GEMV with
    SiLU-and-mul in its epilogue, bit for bit the two kernels' result. None elsewhere: the
    caller runs the two (:func:`linear_act`)."""
    rows = max(gemv_rows(), _row_invariant)
    if bias is None and x.dim() == 2 and 0 < x.shape[0] <= rows and weight.shape[0] % 2 == 0:
        mod = _triton("triton_gemv", x)
        if mod is not None:
            config = mod.pick_config(*weight.shape, weight.device)
            return mod.gemv(x, weight, config=config, silu_and_mul=True)
    return None


def fp8_silu_and_mul_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [2I, K] float8_e4m3fn: gate rows, then up rows
    scale: torch.Tensor,  # [2I, ceil(K / block_k)] float32
    block_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:  # [M, I]
    """:func:`silu_and_mul_linear` of an FP8-weight layer: where :func:`fp8_linear` takes the
    Triton GEMV (an sm89+ GPU, at most ``triton_quant.GEMV_ROWS`` rows), its epilogue does
    SiLU-and-mul; None elsewhere."""
    mod = _triton("triton_quant", x)
    if (
        mod is not None
        and fp8_supported(x.device)
        and bias is None
        and x.dim() == 2
        and 0 < x.shape[0] <= mod.GEMV_ROWS
        and weight.shape[0] % 2 == 0
    ):
        return mod.fp8_linear(x, weight, scale, block_k, silu_and_mul=True)
    return None


def w4_silu_and_mul_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K/8, 2I] int32: gate columns, then up columns
    scales: torch.Tensor,  # [K/G, 2I]
    zeros: torch.Tensor,  # [K/G, 2I]
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:  # [M, I]
    """:func:`silu_and_mul_linear` of an int4 layer at one row (batch-1 decode on CUDA): the
    Triton GEMV with SiLU-and-mul in its epilogue; None elsewhere. At two rows the kernel takes
    it too, but the 8B AWQ step was slower fused (3.30 -> 3.55 ms on an H200; one row 2.43 ->
    2.38)."""
    mod = _triton("triton_quant", x)
    if mod is not None and bias is None and x.dim() == 2 and x.shape[0] == 1:
        return mod.w4a16_linear(x, qweight, scales, zeros, group_size, silu_and_mul=True)
    return None


def linear_act(
    layer: torch.nn.Module,
    act: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,  # [T, K]
) -> torch.Tensor:
    """``act(layer(x))``: in one kernel where the layer has a fused form of ``act`` for this
    ``x`` (its ``fused_act(act, x)`` returns the result; None: not here), else the two. A
    wrapper put around the layer (LoRA) has no ``fused_act``, and the two then run."""
    fused = getattr(layer, "fused_act", None)
    out = fused(act, x) if fused is not None else None
    return act(layer(x)) if out is None else out


def w4a16_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K/8, N] int32, 4-bit, packed along K (kernels.quant)
    scales: torch.Tensor,  # [K/G, N]
    zeros: torch.Tensor,  # [K/G, N]
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """An int4 weight-only linear layer: dequantized inside the Triton kernel on CUDA."""
    mod = _triton("triton_quant", x)
    fn = mod.w4a16_linear if mod else ref_w4a16_linear
    out = fn(x, qweight, scales, zeros, group_size)
    return out if bias is None else out + bias


# FP8 tensor cores (torch._scaled_mm) take batches above this many rows; the Triton kernel,
# which reads the fp8 weight and multiplies in the activation dtype, takes the short ones
FP8_GEMV_ROWS = 16


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def fp8_supported(device: torch.device) -> bool:
    """sm89+ GPUs (Ada, Hopper, Blackwell): FP8 tensor cores, and Triton's e4m3 type."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    return (
        scale.shape[1] == 1  # per-channel scales: _scaled_mm's rowwise mode
        and x.dtype == torch.bfloat16
        and x.shape[0] > FP8_GEMV_ROWS
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 16 == 0
    )


def takes_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` runs ``x`` on the FP8 tensor cores (W8A8, x quantized per
    token): a layer before it may then hand it the quantized input (:func:`fp8_input_linear`)."""
    return (
        triton_available()
        and x.dim() == 2
        and fp8_supported(x.device)
        and _scaled_mm_fits(x, weight, scale)
    )


def fp8_input_linear(
    xq: torch.Tensor,  # [M, K] float8_e4m3fn, quantized per token
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, 1] float32, per channel
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """The W8A8 layer of :func:`fp8_linear` for an input already quantized per token (by
    :func:`rms_norm_fp8` or :func:`silu_and_mul_fp8`)."""
    out = scaled_mm_fp8(xq, x_scale, weight, scale, out_dtype)
    return out if bias is None else out + bias


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [N, ceil(K / block_k)] float32
    block_k: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """An FP8-weight linear layer. On an sm89+ GPU: per-channel weights at batches above
    ``FP8_GEMV_ROWS`` run W8A8 on the FP8 tensor cores (x quantized per token); everything
    else (short batches, block scales) runs the Triton kernel, weight-only. Elsewhere (the CPU,
    older GPUs) the weight-only torch reference: the weight dequantized at every call."""
    mod = _triton("triton_quant", x)
    if mod is None or not fp8_supported(x.device):
        out = ref_fp8_linear(x, weight, scale, block_k)
    elif _scaled_mm_fits(x, weight, scale):
        out = scaled_mm_w8a8_linear(x, weight, scale, mod.per_token_quant_fp8)
    else:
        out = mod.fp8_linear(x, weight, scale, block_k)
    return out if bias is None else out + bias


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    k_scale: float = 1.0,  # an FP8 cache stores k / k_scale and v / v_scale
    v_scale: float = 1.0,
) -> None:
    mod = _triton("triton_attention", k)
    (mod.write_kv if mod else ref_write_kv)(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_write_kv(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D], may be a strided view
    k: torch.Tensor,  # [T, Hkv, D], may be a strided view
    v: torch.Tensor | None,  # [T, Hkv, D], may be a strided view; None: the keys are the values
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    k_scale: float = 1.0,  # an FP8 cache stores k / k_scale and v / v_scale
    v_scale: float = 1.0,
    k_out: torch.Tensor | None = None,  # [T, Hkv, D]: the rotated keys in k's dtype, also here
    memo: StepMemo | None = None,  # the step's: what the torch path derives, reused by layers
) -> torch.Tensor:  # [T, Hq, D] rotated q
    mod = _triton("triton_attention", q)
    if mod is None:
        return ref_rotary_write_kv(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            k_out=k_out, memo=memo,
        )  # fmt: skip
    return mod.rotary_write_kv(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k_out=k_out,
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D] to write into
    window: int = 0,  # keys each query sees, itself included (a sliding window); 0: all
    softcap: float = 0.0,  # scores soft-capped to (-softcap, softcap) (Gemma 2); 0: none
    sinks: torch.Tensor | None = None,  # [Hq]: a learned logit per head (gpt-oss); None: none
    memo: StepMemo | None = None,  # the step's: what the torch path derives, reused by layers
) -> torch.Tensor:  # [B, Hq, D]
    mod = _triton("triton_attention", q)
    if mod is None:
        return ref_paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale, out=out, window=window,
            softcap=softcap, sinks=sinks, memo=memo,
        )  # fmt: skip
    splits = None
    if 0 < q.shape[0] <= _row_invariant:  # split each row's context as for a batch of 1
        width = block_tables.shape[1] * k_cache.shape[1]
        width = min(width, window) if window else width  # the keys a query can see
        splits = mod.choose_num_splits(1, k_cache.shape[2], width, q.device, k_cache.element_size())
    return mod.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=splits, out=out,
        window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip


def mla_decode_attention(
    q: torch.Tensor,  # [B, H, R + L]: each head's rotated rope query, then its absorbed one
    cache: torch.Tensor,  # [N, bs, 1, R + L]: a token's rope key, then its latent
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    rope_dim: int,
    out: torch.Tensor | None = None,  # [B, H, L] to write into
) -> torch.Tensor:  # [B, H, L]
    """DeepSeek's decode attention over its latent cache: the attended latent of each head."""
    mod = _triton("triton_mla", q)
    if mod is None:
        return ref_mla_decode_attention(
            q, cache, block_tables, context_lens, scale, rope_dim, out=out
        )
    splits = None
    if 0 < q.shape[0] <= _row_invariant:  # split each row's context as for a batch of 1
        width = block_tables.shape[1] * cache.shape[1]
        splits = mod.num_splits_for(-(-q.shape[1] // mod.DEFAULT_BLOCK_G), width, q.device)
    return mod.mla_decode_attention(
        q, cache, block_tables, context_lens, scale, rope_dim, out=out, num_splits=splits
    )


# whole prompts read their own K/V contiguously (prefill_attention's k_new, no_prefix) from
# this many prefill tokens in a step: 8 x 1024 prompts 374 against 303 TFLOP/s through the block
# table on an H200, but 4 x 512 no faster (193 against 199) while the launch costs more host time
# (docs/benchmarks.md, W3)
NEW_KV_MIN_TOKENS = 4096


def reads_new_kv(device: torch.device) -> bool:
    """Whether the model hands prefill attention the new K/V on this device (the Triton kernel
    reads them contiguously; on the CPU the reference would only copy them)."""
    return device.type == "cuda"


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D] to write into
    k_new: torch.Tensor | None = None,  # [T, Hkv, D]: the new tokens' keys, read contiguously
    v_new: torch.Tensor | None = None,  # [T, Hkv, D]
    no_prefix: bool = False,  # no sequence has a cached prefix (the caller knows it)
    window: int = 0,  # keys each query sees, itself included (a sliding window); 0: all
    softcap: float = 0.0,  # scores soft-capped to (-softcap, softcap) (Gemma 2); 0: none
    sinks: torch.Tensor | None = None,  # [Hq]: a learned logit per head (gpt-oss); None: none
    span_last: torch.Tensor | None = None,  # [T] int32: each row's last key when past its own
    # (Gemma 3's image tokens see their whole image); None: causal
) -> torch.Tensor:  # [T, Hq, D]
    mod = _triton("triton_attention", q)
    fn = mod.prefill_attention if mod else ref_prefill_attention
    return fn(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, out=out,
        k_new=k_new, v_new=v_new, no_prefix=no_prefix, window=window, softcap=softcap,
        sinks=sinks, span_last=span_last,
    )  # fmt: skip


def varlen_attention(
    q: torch.Tensor,  # [T, Hq, D], the sequences' tokens, concatenated
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    query_start_loc: torch.Tensor,  # [B + 1] int32, prefix sums of the sequences' lengths
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, Dv] to write into
) -> torch.Tensor:  # [T, Hq, Dv]
    """Causal attention of whole prompts over their own tokens (no cache): DeepSeek's prefill
    in the expanded form."""
    mod = _triton("triton_attention", q)
    fn = mod.varlen_attention if mod else ref_varlen_attention
    return fn(q, k, v, query_start_loc, scale, out=out)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    mod = _triton("triton_layers", x)
    return (mod.rms_norm if mod else ref_rms_norm)(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    mod = _triton("triton_layers", x)
    return (mod.silu_and_mul if mod else ref_silu_and_mul)(x)


def gemma_rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], an offset from 1
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    mod = _triton("triton_layers", x)
    return (mod.gemma_rms_norm if mod else ref_gemma_rms_norm)(x, weight, eps, residual)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """Gemma's MLP activation: GELU (tanh) of the gate times the up half."""
    mod = _triton("triton_layers", x)
    return (mod.gelu_tanh_and_mul if mod else ref_gelu_tanh_and_mul)(x)


def rms_norm_fp8(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` with its output quantized per token for an FP8 W8A8 layer: (e4m3
    [T, H], float32 scales [T, 1], x + residual); one kernel on a GPU."""
    mod = _triton("triton_layers", x)
    if mod is not None:
        return mod.rms_norm_fp8(x, weight, eps, residual)
    y, res = ref_rms_norm(x, weight, eps, residual)
    q, s = ref_per_token_quant_fp8(y)
    return q, s, res


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 2I]
    """:func:`silu_and_mul` quantized per token for an FP8 W8A8 layer: (e4m3 [T, I], float32
    scales [T, 1]); one kernel on a GPU."""
    mod = _triton("triton_layers", x)
    if mod is not None:
        return mod.silu_and_mul_fp8(x)
    return ref_per_token_quant_fp8(ref_silu_and_mul(x))


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
) -> None:
    mod = _triton("triton_layers", q)
    (mod.rotary_embedding if mod else ref_rotary_embedding)(positions, q, k, cos_sin_cache)


def moe_routing(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 ids)
    """The router's choice (softmax and top-k over E values per token): one Triton launch on a
    GPU (:mod:`kernels.triton_routing`), torch elsewhere."""
    mod = _triton("triton_routing", router_logits)
    e = router_logits.shape[-1]
    if mod is not None and router_logits.dim() == 2 and 0 < top_k <= e <= mod.MAX_EXPERTS:
        return mod.moe_routing(router_logits, top_k, renormalize)
    return ref_moe_routing(router_logits, top_k, renormalize)


def grouped_topk(
    router_logits: torch.Tensor,  # [T, E] float32
    top_k: int,
    *,
    sigmoid: bool = False,
    correction_bias: torch.Tensor | None = None,  # [E]
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = False,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 ids)
    """DeepSeek's group-limited router (:func:`kernels.moe.ref_grouped_topk`): torch
    everywhere, as :func:`moe_routing`."""
    return ref_grouped_topk(
        router_logits, top_k, sigmoid=sigmoid, correction_bias=correction_bias,
        num_groups=num_groups, topk_groups=topk_groups, renormalize=renormalize, scaling=scaling,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # [T, top_k]
    *,
    b13: torch.Tensor | None = None,  # [E, 2I]: gate half, then up half
    b2: torch.Tensor | None = None,  # [E, H]
    clamp: ClampedSwiGLU | None = None,  # gpt-oss's activation; None: silu(gate) * up
    fp8: Fp8Scales | None = None,  # e4m3 w13 and w2: their scales
    int4: Int4Scales | None = None,  # packed int4 w13 and w2 (AWQ, GPTQ): their groups
) -> torch.Tensor:  # [T, H]
    """The experts' gated MLPs, weighted and summed (:mod:`kernels.moe`). FP8 experts' scales
    come as ``fp8`` or attached to ``w13`` (its ``fp8_scales``, set by the model's experts
    module), int4 experts' groups as ``int4`` or attached (``int4_scales``): callers that pass
    only the weights get them too. FP8 runs the Triton kernel on sm89+ GPUs, int4 on any;
    elsewhere the reference dequantizes each routed expert at every call."""
    fp8 = scales_of(w13, fp8)
    int4 = int4_scales_of(w13, int4)
    mod = _triton("triton_moe", x)
    if fp8 is not None and not fp8_supported(x.device):
        mod = None
    if int4 is not None:
        return (mod.fused_moe if mod else ref_fused_moe)(
            x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, clamp=clamp, int4=int4
        )
    return (mod.fused_moe if mod else ref_fused_moe)(
        x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, clamp=clamp, fp8=fp8
    )


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    mod = _triton("triton_block_copy", kv_caches[0]) if kv_caches else None
    return (mod.gather_blocks if mod else ref_gather_blocks)(kv_caches, block_ids)


def scatter_blocks(
    buffer: torch.Tensor, kv_caches: list[torch.Tensor], block_ids: torch.Tensor
) -> None:
    mod = _triton("triton_block_copy", buffer)
    (mod.scatter_blocks if mod else ref_scatter_blocks)(buffer, kv_caches, block_ids)


def fence_cas(word: torch.Tensor, expected: int, new: int) -> int:
    """Atomic compare-and-swap of ``word[0]`` (int64), returning what it held; on a GPU one
    atomic against a fenced block push running beside it (waits for the device)."""
    mod = _triton("triton_block_copy", word)
    return (mod.fence_cas if mod else ref_fence_cas)(word, expected, new)


def checksum(data: torch.Tensor) -> torch.Tensor:  # [N] uint8 -> [] int64
    """The KV-transfer checksum of a byte buffer, left on its device (:mod:`kernels.checksum`):
    the same bits from the Triton kernel and the reference, so either end may use either."""
    mod = _triton("triton_checksum", data)
    return (mod.checksum if mod else ref_checksum)(data)


def add_lora(
    y: torch.Tensor,  # [T, N], updated in place
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R, K]
    lora_b: torch.Tensor,  # [S, N, R]
    seg_rows: torch.Tensor,  # [P]
    seg_starts: torch.Tensor,  # [G]
    seg_lens: torch.Tensor,  # [G]
    seg_slots: torch.Tensor,  # [G]
    max_seg_len: int,
) -> torch.Tensor:  # y
    """Each segment's adapter update added to its rows of ``y`` (``kernels.lora``)."""
    mod = _triton("triton_lora", x)
    fn = mod.add_lora if mod is not None else ref_add_lora
    return fn(y, x, lora_a, lora_b, seg_rows, seg_starts, seg_lens, seg_slots, max_seg_len)


def expand_lora(
    y_ext: torch.Tensor,  # [T, N + S * R]: base output, then every slot's x @ A^T
    lora_b: torch.Tensor,  # [S, N, R]
    row_slots: torch.Tensor,  # [T] int32, -1: no adapter
) -> torch.Tensor:  # [T, N], new
    """The fused path's expand: each adapter row's update added to a copy of the base columns
    (``kernels.lora.ref_expand_lora``)."""
    mod = _triton("triton_lora", y_ext)
    fn = mod.expand_lora if mod is not None else ref_expand_lora
    return fn(y_ext, lora_b, row_slots)
