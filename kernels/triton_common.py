"""What the Triton launchers share: argument checks, device facts, and the dot helper.

Every launcher validates shapes, strides, dtypes and devices up front and raises ``ValueError``
with a message naming the argument, so a bad call fails in Python instead of reading or writing
out of bounds on the GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.attention import FP8_KV_DTYPES

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# a KV cache holds the model's dtype, or FP8 (e4m3) under --kv-cache-dtype fp8
KV_DTYPES = FLOAT_DTYPES + FP8_KV_DTYPES


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    inner_contiguous: bool = True,
) -> torch.Tensor:
    """Check one argument: a tensor of ``ndim`` dims, one of ``dtypes``, unit last stride."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {dtypes}")
    if inner_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, strides {t.stride()}")
    return t


def check_devices(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and that device is CUDA unless the interpreter runs."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{k} on {t.device}" for k, t in tensors.items())
        raise ValueError(f"tensors are on different devices: {where}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); use kernels.ops for CPU tensors"
        )
    return device


def cuda_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


# TANDEM_PDL=0 launches every kernel plainly (for measuring what programmatic launch saves)
_PDL_ENV = os.environ.get("TANDEM_PDL", "1").strip().lower() not in ("0", "false", "off", "no")


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


# rows (tokens) of a launch up to which it is programmatic: the Triton GEMVs' most
# (kernels.gemv.GEMV_MAX_ROWS). bf16 batches of 2-8 run cuBLAS GEMMs unless TANDEM_GEMV_ROWS
# says otherwise, and FP8/int4 batches up to 8 our GEMVs and GEMMs; on one H100 bf16 batches 4
# and 8 took the same time either way (6.60 / 6.83 ms plain, 6.61 / 6.82 programmatic)
PDL_MAX_ROWS = 8


def pdl(device: torch.device, rows: int) -> dict[str, bool]:
    """Launch arguments for programmatic dependent launch (Hopper and later): the kernel is
    launched while the one before it on the stream still runs, and waits for it on the device
    (:func:`pdl_enter`) instead of in the launch queue. What it saves is the launch and ramp of
    each small kernel of a batch-1 decode step (~2-4 us each, ~330 of them a step). The kernel
    must take ``USE_PDL`` and call :func:`pdl_enter` before it reads anything an earlier kernel
    writes and before it writes anything at all. Off on older GPUs, in the interpreter, and for
    launches of more than ``PDL_MAX_ROWS`` rows: there the matmuls between our kernels are
    cuBLAS's, which let a dependent launch early, and our programs waiting on the device took
    SMs from them (the 8B decode step at batch 64: 9.46 -> 9.60 ms on an H100). Off on ROCm."""
    if device.type != "cuda" or not _PDL_ENV or rows > PDL_MAX_ROWS or interpreting():
        return {"USE_PDL": False}
    if not _pdl_capable(cuda_index(device)):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one on the stream has finished and its writes are
    visible, then let the next kernel launch (it waits the same way, so a kernel two places
    later still sees this one's predecessor done). A no-op without ``USE_PDL``."""
    pdl_wait(USE_PDL, True)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr, RELEASE: tl.constexpr):
    """:func:`pdl_enter`, or with ``RELEASE`` false only its wait: the kernel then lets the
    next one launch later (:func:`pdl_release`), for a dependent whose programs would otherwise
    sit resident, waiting, while this one still has waves to run."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr, RELEASE: tl.constexpr):
    """Let the next kernel launch, where :func:`pdl_wait` did not (``RELEASE`` false there)."""
    if USE_PDL and not RELEASE:
        tl.extra.cuda.gdc_launch_dependents()


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a nominal 132 under the interpreter)."""
    if device.type != "cuda":
        return 132
    return num_sms(cuda_index(device))


SMALL_SMEM = 99 * 1024  # the least any recent GPU offers a block (Ada); used when unknown


@functools.cache
def _max_smem(device_index: int) -> int:
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # an older or different driver API: stay conservative
        return SMALL_SMEM


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device`` (opt-in limit)."""
    if device.type != "cuda":
        return SMALL_SMEM
    return _max_smem(cuda_index(device))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 dots (tf32 would cost ~1e-3 relative error)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether :func:`mma` must upcast its operands: Triton's interpreter multiplies bf16 tiles
    as their raw uint16 bits (seen with triton 3.9), so under it bf16 dots run in fp32."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``tl.dot(a, b)`` with fp32 accumulation; see :func:`dot_upcast` for ``UPCAST``. K of at
    least 16 asserted, so the interpreter refuses what a GPU's compiler would."""
    tl.static_assert(a.shape[1] >= 16, "tl.dot needs K >= 16")
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def soft_cap_log2(s, SOFTCAP: tl.constexpr):
    """Attention scores ``s`` in log2 units (scaled by ``scale * log2(e)``) soft-capped as
    transformers' Gemma 2 caps the natural ones, ``cap * tanh(x / cap)``, still in log2 units
    (``L * tanh(s / L)`` with ``L = cap * log2(e)``); -inf (a masked score) stays -inf. tanh as
    ``1 - 2 / (exp(2t) + 1)``: exact at both ends, with no overflow."""
    lim: tl.constexpr = SOFTCAP * 1.4426950408889634
    t = s / lim
    th = 1.0 - 2.0 / (tl.math.exp2(t * 2.8853900817779268) + 1.0)  # 2t * log2(e)
    return tl.where(s == float("-inf"), s, lim * th)


def rounds_bf16_in_kernel(dtype: torch.dtype) -> bool:
    """Whether a kernel writing ``dtype`` must round to bf16 itself (:func:`round_to_bf16`):
    Triton's interpreter truncates its float32 -> bfloat16 casts (1.005 -> 1.0, seen with triton
    3.9) where the GPU's cast and torch's round to nearest even."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def round_to_bf16(x, ROUND: tl.constexpr):
    """float32 ``x`` rounded to the nearest bf16 value (ties to even), still as float32, when
    ``ROUND`` (:func:`rounds_bf16_in_kernel`); the cast to bf16 after it is then exact. ``x``
    itself otherwise. For finite values (a carry into the exponent is the right rounding)."""
    if ROUND:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def round_to_e4m3(x):
    """float32 ``x`` rounded to the nearest e4m3fn value (ties to even), saturated at +-448, as
    float32: the cast to ``tl.float8e4nv`` after it is then exact. The same as torch's
    ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``, in plain float arithmetic: Triton's
    interpreter casts float -> fp8 wrongly when rounding carries into the exponent (1.98 -> 1.0)."""
    a = tl.minimum(tl.abs(x), 448.0)
    exp = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # -6: subnormals
    quantum = ((exp + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exp - 3): 3 mantissa bits
    inverse = ((130 - exp) << 23).to(tl.float32, bitcast=True)  # 1 / quantum, exactly
    r = ((a * inverse + 8388608.0) - 8388608.0) * quantum  # + 2^23 - 2^23: round half to even
    # x's sign bit on r (a negation would turn -0.0 into +0.0 on the GPU)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, SOFT: tl.constexpr):
    """float32 ``x`` as e4m3fn, rounded to nearest even and saturated at +-448, as torch's
    ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``: one hardware conversion on a GPU; with
    ``SOFT`` (Triton's interpreter, see :func:`round_to_e4m3`) rounded in float arithmetic
    first, about a dozen more instructions an element."""
    if SOFT:
        return round_to_e4m3(x).to(tl.float8e4nv)
    else:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def fp8_row_scale(amax, s_ptr, row, INV_MAX: tl.constexpr):
    """A row's per-token FP8 scale from its largest magnitude (float32), as
    ``kernels.quant.ref_per_token_quant_fp8``: ``max(amax * INV_MAX, 1e-12)``, stored at
    ``s_ptr[row]``; returns its correctly rounded reciprocal (as torch's), the values' factor."""
    scale = tl.maximum(amax * INV_MAX, 1e-12)
    tl.store(s_ptr + row, scale)
    return tl.math.div_rn(1.0, scale)


@triton.jit
def quantize_row(y, q_row, s_ptr, row, offs, mask, INV_MAX: tl.constexpr, SOFT_FP8: tl.constexpr):
    """A whole row held in registers (float32, zero where masked) quantized per token: its
    scale to ``s_ptr[row]``, e4m3 to ``q_row``."""
    inv = fp8_row_scale(tl.max(tl.abs(y), axis=0), s_ptr, row, INV_MAX)
    tl.store(q_row + offs, to_e4m3(y * inv, SOFT_FP8), mask=mask)


def fp8_rows(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a per-token FP8 quantization: e4m3 ``[rows, width]`` and float32 scales
    ``[rows, 1]``, the scales already those of empty rows (1e-12) when ``width`` is 0."""
    q = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=device)
    return q, scale.fill_(1e-12) if width == 0 else scale


@triton.jit
def to_kv(x, inv_scale, FP8: tl.constexpr):
    """A K or V value as the cache stores it: ``x * inv_scale`` (float32) rounded to e4m3 for an
    FP8 cache (cast to the cache's dtype after), ``x`` unchanged otherwise. A product, not a
    quotient: float division is approximate in compiled Triton and in torch's CUDA kernels alike,
    while a float32 product rounds the same everywhere."""
    if FP8:
        return round_to_e4m3(x.to(tl.float32) * inv_scale)
    else:
        return x


# the widest head the attention kernels take: a 1024-wide tile (half_d: two of 512); the widest
# served is DeepSeek's latent cache head, 512 latent + 64 rotary dims (``models.deepseek``)
MAX_HEAD_DIM = 1024


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Paged caches ``[num_blocks, block_size, Hkv, D]``; returns (num_blocks, block_size, Hkv, D)."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    n, bs, hkv, d = k_cache.shape
    if bs < 1 or hkv < 1 or d < 1:
        raise ValueError(f"empty KV cache shape {tuple(k_cache.shape)}")
    return n, bs, hkv, d


def check_q_for_cache(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Attention reads the cache in q's dtype: the same dtype, or FP8 converted on load."""
    if q.dtype != k_cache.dtype and k_cache.dtype not in FP8_KV_DTYPES:
        raise ValueError(f"q dtype {q.dtype} != KV cache dtype {k_cache.dtype}")


def check_heads(q_heads: int, kv_heads: int, q_dim: int, kv_dim: int) -> int:
    """Query and KV head layouts agree (GQA/MQA); returns the group size Hq // Hkv."""
    if q_dim != kv_dim:
        raise ValueError(f"q head_dim {q_dim} != KV cache head_dim {kv_dim}")
    if q_heads % kv_heads != 0:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if kv_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {kv_dim} > {MAX_HEAD_DIM} is not supported")
    return q_heads // kv_heads


def check_out(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The output to write: ``out`` when given (checked against the shape, dtype and device the
    kernel produces; any strides with a unit last one), else a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor("out", out, ndim=len(shape), dtypes=(dtype,))
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {shape}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}; expected {device}")
    return out


@triton.jit
def seq_of_tile(qsl_ptr, num_seqs, tile, TOKENS: tl.constexpr):
    """The sequence query tile ``tile`` belongs to, with tiles of ``TOKENS`` tokens and every
    sequence starting a new one: the last sequence whose first tile (its start // TOKENS plus
    its index) is <= ``tile`` (a binary search of ``query_start_loc``; the first tiles strictly
    increase). Returns (the sequence, its start, its length, the tile's first token in it); that
    token is past the length when the grid's bound overshoots (the program then exits)."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid).to(tl.int32) // TOKENS + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    start = tl.load(qsl_ptr + lo).to(tl.int32)
    length = tl.load(qsl_ptr + lo + 1).to(tl.int32) - start
    return lo, start, length, (tile - (start // TOKENS + lo)) * TOKENS
