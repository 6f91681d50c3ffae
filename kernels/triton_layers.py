"""Element-wise layers of the Llama family in Triton: fused add + RMSNorm, SiLU-and-mul, RoPE.

``rms_norm_fp8`` and ``silu_and_mul_fp8`` end with the per-token FP8 quantization of an FP8
W8A8 layer's input (``kernels.quant.ref_per_token_quant_fp8`` of the 16-bit output): the layer's
input is written once, in e4m3, instead of written in 16 bits and read back by a quantization
kernel. The SiLU's is bit for bit the two kernels run one after the other. The norm's is under
the interpreter, but compiled its sum of squares may add in another order than ``rms_norm``'s
(the compiler lays the kernel out for its one-byte store: 16 elements a thread, not 8), so its
rstd can be an ulp apart and a rare normalized value a bf16 step apart before quantization: on an
H200 0 to 9 of 33.5 M e4m3 values a step apart at 8192 x 4096, no scale apart.

Same signatures and semantics as :mod:`kernels.layers`. All three are memory-bound: each reads
its inputs and writes its outputs once, with fp32 arithmetic in registers, rounded to the
activation dtype where the references (and transformers' Llama code) round:
``.to(dtype).to(tl.float32)``, an identity in float32. They launch with ``enable_fp_fusion=False``:
otherwise the compiler turns a rounded product followed by a sum into one bf16 FMA (seen in the
sm_90 PTX: ``fma.rn.bf16``), which skips the product's rounding and drifts from torch by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layers import check_rotary_width
from kernels.quant import INV_FP8_MAX
from kernels.triton_common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_tensor,
    fp8_row_scale,
    fp8_rows,
    interpreting,
    next_pow2,
    pdl,
    pdl_enter,
    quantize_row,
    to_e4m3,
)

MAX_NORM_WIDTH = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, s_ptr, s_x, s_r, s_o, s_ro, width, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, FP8: tl.constexpr,
    INV_MAX: tl.constexpr, SOFT_FP8: tl.constexpr, GEMMA: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(r_ptr + row * s_r + offs, mask=mask, other=0.0).to(tl.float32)
        x_io = x.to(rout_ptr.dtype.element_ty)  # the reference rounds the sum to x's dtype
        tl.store(rout_ptr + row * s_ro + offs, x_io, mask=mask)
        x = x_io.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / width + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:  # as Gemma3RMSNorm: 1 + weight, the product in fp32, rounded once
        y = (x * rstd * (1.0 + w)).to(x_ptr.dtype.element_ty)
    else:  # as LlamaRMSNorm: round the normalized value to x's dtype, then weight * it, rounded once
        normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (w * normed).to(x_ptr.dtype.element_ty)
    if FP8:  # out_ptr is the e4m3 copy: the 16-bit values quantized per token
        quantize_row(y.to(tl.float32), out_ptr + row * s_o, s_ptr, row, offs, mask, INV_MAX,
                      SOFT_FP8)  # fmt: skip
    else:
        tl.store(out_ptr + row * s_o + offs, y, mask=mask)


@triton.jit
def act_and_mul(gate, up, DTYPE: tl.constexpr, GELU: tl.constexpr):
    """``act_fn(gate) * up`` from float32 ``gate`` and ``up`` (each already in ``DTYPE``'s
    values), in ``DTYPE``: the activation rounded to it, then the product rounded (as the
    reference). SiLU, or with ``GELU`` transformers' ``gelu_pytorch_tanh`` (Gemma's),
    0.5 g (1 + tanh(u)) computed as g / (1 + exp(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3):
    the same function, within fp32 rounding. Also the epilogue of the GEMVs that fuse it."""
    if GELU:
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = tl.div_rn(gate, 1.0 + tl.exp(tl.minimum(-2.0 * u, 88.0)))  # no inf: e^88 < 2^128
    else:
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate))
    return (act.to(DTYPE).to(tl.float32) * up).to(DTYPE)


@triton.jit
def _silu_mul(x_row, offs, mask, inter, DTYPE: tl.constexpr, GELU: tl.constexpr):
    """:func:`act_and_mul` of one row's ``offs``: gate at ``offs``, up ``inter`` after it."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    return act_and_mul(gate, up, DTYPE, GELU)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, s_x, s_o, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    GELU: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    y = _silu_mul(x_ptr + row * s_x, offs, mask, inter, out_ptr.dtype.element_ty, GELU)
    tl.store(out_ptr + row * s_o + offs, y, mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, s_ptr, s_x, s_q, inter, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr, INV_MAX: tl.constexpr, SOFT_FP8: tl.constexpr,
):  # fmt: skip
    """One program a row: the row's products, their largest magnitude, then e4m3. A row wider
    than one block is computed twice (its input read twice) rather than stored in 16 bits."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row, q_row = x_ptr + row * s_x, q_ptr + row * s_q
    if ONE_PASS:
        mask = offs < inter
        y = _silu_mul(x_row, offs, mask, inter, x_ptr.dtype.element_ty, False).to(tl.float32)
        quantize_row(y, q_row, s_ptr, row, offs, mask, INV_MAX, SOFT_FP8)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK):
            ks = k0 + offs
            y = _silu_mul(x_row, ks, ks < inter, inter, x_ptr.dtype.element_ty, False).to(
                tl.float32
            )
            amax = tl.maximum(amax, tl.abs(y))
        inv = fp8_row_scale(tl.max(amax, axis=0), s_ptr, row, INV_MAX)
        for k0 in range(0, inter, BLOCK):
            ks = k0 + offs
            k_mask = ks < inter
            y = _silu_mul(x_row, ks, k_mask, inter, x_ptr.dtype.element_ty, False).to(tl.float32)
            tl.store(q_row + ks, to_e4m3(y * inv, SOFT_FP8), mask=k_mask)


@triton.jit
def rotate_half_pair(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """NeoX rotation of the halves (x1, x2), fp32 in and out, rounded like transformers'
    ``q * cos + rotate_half(q) * sin`` in ``DTYPE``: cos and sin rounded to it, then each product
    and each sum (an identity when DTYPE is float32). Returns (o1, o2), still to be stored."""
    c = cos.to(DTYPE).to(tl.float32)
    s = sin.to(DTYPE).to(tl.float32)
    o1 = (x1 * c).to(DTYPE).to(tl.float32) - (x2 * s).to(DTYPE).to(tl.float32)
    o2 = (x2 * c).to(DTYPE).to(tl.float32) + (x1 * s).to(DTYPE).to(tl.float32)
    return o1, o2


@triton.jit
def _rotate_heads(x_ptr, s_h, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs < HALF)[None, :]
    p1 = x_ptr + offs_h[:, None] * s_h + offs[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_half_pair(x1, x2, cos[None, :], sin[None, :], x_ptr.dtype.element_ty)
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr, s_qt, s_qh, s_kt, s_kh, s_cs, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    cos = tl.load(cs_ptr + pos * s_cs + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * s_qt, s_qh, num_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * s_kt, s_kh, num_k_heads, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kernels.layers.ref_rms_norm`: (norm(x + residual), x + residual)."""
    _check_rms_norm(x, weight, residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out) if residual is not None else x
    _launch_rms_norm(x, weight, eps, residual, out, res_out, None)
    return out, res_out


def gemma_rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], an offset from 1
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kernels.layers.ref_gemma_rms_norm`: (norm(x + residual),
    x + residual), the weight applied as ``1 + weight`` in fp32."""
    _check_rms_norm(x, weight, residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(out) if residual is not None else x
    _launch_rms_norm(x, weight, eps, residual, out, res_out, None, gemma=True)
    return out, res_out


def _check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    width = x.shape[1]
    if weight.shape[0] != width:
        raise ValueError(f"weight has {weight.shape[0]} entries for width {width}")
    if width > MAX_NORM_WIDTH:
        raise ValueError(f"rms_norm width {width} > {MAX_NORM_WIDTH} is not supported")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        check_devices(x=x, weight=weight, residual=residual)
    else:
        check_devices(x=x, weight=weight)


def _launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
    out: torch.Tensor, res_out: torch.Tensor, scale: torch.Tensor | None, gemma: bool = False,
) -> None:  # fmt: skip
    rows, width = x.shape
    if rows == 0:
        return
    block = next_pow2(width)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out,
        scale if scale is not None else x,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), res_out.stride(0), width, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_warps(block),
        FP8=scale is not None, INV_MAX=INV_FP8_MAX, SOFT_FP8=interpreting(),
        GEMMA=gemma, enable_fp_fusion=False, **pdl(x.device, rows),
    )  # fmt: skip


def rms_norm_fp8(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` whose output is quantized per token in the same kernel: (e4m3 [T, H],
    float32 scales [T, 1], x + residual), what ``per_token_quant_fp8`` makes of its output, up to
    the summation order of the module docstring."""
    _check_rms_norm(x, weight, residual)
    rows, width = x.shape
    q, scale = fp8_rows(rows, width, x.device)
    res_out = (
        torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    )
    if width > 0:
        _launch_rms_norm(x, weight, eps, residual, q, res_out, scale)
    return q, scale, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Triton version of :func:`kernels.layers.ref_silu_and_mul`."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Triton version of :func:`kernels.layers.ref_gelu_tanh_and_mul` (Gemma's MLP), the same
    kernel as :func:`silu_and_mul` with the activation switched: equal to the reference within
    an ulp of x's dtype (the GELU's fp32 value may differ in its last bit)."""
    return _act_and_mul(x, gelu=True)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x's last dim must be even, shape {tuple(x.shape)}")
    check_devices(x=x)
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(4096, next_pow2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            num_warps=_row_warps(block),
            enable_fp_fusion=False,
            GELU=gelu,
            **pdl(x.device, x2.shape[0]),
        )
    return out.view(*x.shape[:-1], inter)


# SiLU-and-mul quantized per token, one program a row: a step of at most ``FP8_ONE_PASS_ROWS``
# rows holds each row in registers (16 warps; a short grid wants wide programs), a longer one
# walks rows ``FP8_TWO_PASS_BLOCK`` outputs at a time, computing them twice (their largest
# magnitude, then e4m3). On an H200 at 14336 outputs a row: 8192 rows 252 us against 330 (one
# pass, 16 warps) and 282 us for SiLU then the quantization kernel; 2048 rows 73 against 90
# and 105; 224 rows one pass 16 us against 31 (kernels.bench.quant --fused-rows, do_bench).
FP8_ONE_PASS_ROWS = 1024
FP8_TWO_PASS_BLOCK = 2048
FP8_ROW_BLOCK = 16384  # the widest row one program holds


def silu_and_mul_fp8(
    x: torch.Tensor,  # [T, 2I]
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (e4m3 [T, I], float32 [T, 1])
    """:func:`silu_and_mul` quantized per token in the same kernel, bit for bit
    ``per_token_quant_fp8(silu_and_mul(x))``. ``block`` and ``num_warps`` override the launch
    chosen above (``block`` forces the two-pass loop; for tests and tuning)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x's last dim must be even, shape {tuple(x.shape)}")
    check_devices(x=x)
    rows, inter = x.shape[0], x.shape[1] // 2
    q, scale = fp8_rows(rows, inter, x.device)
    if rows == 0 or inter == 0:
        return q, scale
    if block is not None and (block < 1 or block & (block - 1)):
        raise ValueError(f"block must be a power of two, got {block}")
    whole = next_pow2(inter)
    one_pass = block is None and whole <= FP8_ROW_BLOCK
    one_pass &= rows <= FP8_ONE_PASS_ROWS or whole <= FP8_TWO_PASS_BLOCK
    bl = whole if one_pass else min(block or FP8_TWO_PASS_BLOCK, whole)
    warps = num_warps or (_row_warps(bl) if one_pass else 8)
    _silu_and_mul_fp8_kernel[(rows,)](
        x, q, scale, x.stride(0), q.stride(0), inter, BLOCK=bl, ONE_PASS=one_pass,
        INV_MAX=INV_FP8_MAX, SOFT_FP8=interpreting(), num_warps=warps,
        enable_fp_fusion=False, **pdl(x.device, rows),
    )  # fmt: skip
    return q, scale


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, R] float32: cos in [:, :R/2], sin in [:, R/2:]
) -> None:
    """Triton version of :func:`kernels.layers.ref_rotary_embedding` (in place, NeoX halves of
    the first R dims; the others untouched).

    q and k may be strided views (e.g. slices of a fused qkv tensor); positions are not
    bounds-checked against the cache.
    """
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if positions.shape[0] != t:
        raise ValueError(f"positions has {positions.shape[0]} entries for {t} tokens")
    half = check_rotary_width(cos_sin_cache, d) // 2
    check_devices(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    if t == 0:
        return
    _rope_kernel[(t,)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0), hq, k.shape[1],
        HALF=half, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(k.shape[1]),
        BLOCK_HALF=next_pow2(half), num_warps=4 if next_pow2(hq) * next_pow2(half) >= 2048 else 1,
        enable_fp_fusion=False,
    )  # fmt: skip
