"""Mixture-of-Experts layers: the pure-torch references of routing and of the expert MLPs.

``kernels.triton_moe.fused_moe`` has the same signature as :func:`ref_fused_moe` and is tested
against it. Each token goes through ``top_k`` experts, each a SiLU-gated MLP
(``down(silu(gate(x)) * up(x))``), and the results are summed weighted by the router.

gpt-oss's experts add two things, both optional keyword arguments: biases on both projections
(``b13`` [E, 2I], gate half then up half like ``w13``'s rows; ``b2`` [E, H]) and its clamped
SwiGLU (:class:`ClampedSwiGLU`) in place of ``silu(gate) * up``. Its checkpoints interleave the
gate and up columns; the loader de-interleaves them into this stacked layout.

Rounding follows transformers' ``Qwen3MoeExperts`` / ``MixtralExperts``: every projection is
rounded to the activation dtype, the weighted contribution ``down * weight`` is rounded to it, and
a token's contributions are added one expert at a time in ascending expert order, each sum rounded
(``index_add_`` into a tensor of the activation dtype, experts visited in index order). In float32
every rounding is the identity and only the order of the additions remains.

FP8 experts (``w13``/``w2`` in e4m3, each with its scales: :class:`Fp8Scales`) and int4 ones
(AWQ's and GPTQ's w4a16, packed with their groups: :class:`Int4Scales`; act-order ones with
their columns' permutations) are dequantized expert by expert (only the routed ones) to the
activation dtype, their columns back in the input's order, then computed as above: the weights
a float checkpoint dequantized at load would hold.

With biases the rounded projection plus the bias is rounded again (``GptOssExperts`` computes
``x @ W + b`` as two ops in the activation dtype). The clamped SwiGLU is computed in fp32 from the
rounded projections and rounded once, as the kernel does in registers; transformers instead rounds
each of its ops (``gate * alpha``, the sigmoid, two products, ``up + 1``) in a 16-bit dtype, so
in bfloat16 about half the activations differ from its, by up to ~5 units in the last place. In
float32 they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.layers import ref_silu_and_mul
from kernels.quant import pack_cols, unpack_cols


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation, of the gate and up projections (each [..., I]):
    ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``. Frozen, as the constants it holds are: the
    Triton kernel compiles ``alpha`` and ``limit`` in (one compilation per pair of values)."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class Fp8Scales:
    """The scales of FP8 expert weights ``w13`` [E, 2I, H] and ``w2`` [E, H, I] (e4m3):
    ``w[e, n, k] * scale[e, row(n), k // block_k]``. ``block`` (block_n, block_k): block scales
    (DeepSeek-V3's and Qwen3's FP8 checkpoints: 128x128), ``w13_scale`` [E, 2 * ceil(I / bn),
    ceil(H / bk)] (the gate's blocks, then the up's: each half blocked on its own) and
    ``w2_scale`` [E, ceil(H / bn), ceil(I / bk)]; None: per output channel (compressed-tensors,
    ``--quantization fp8``), ``w13_scale`` [E, 2I, 1] and ``w2_scale`` [E, H, 1]. float32."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int] | None = None

    def blocks(self, k: int) -> tuple[int, int]:
        """(block_n, block_k) of a weight with ``k`` input features: per channel (1, k)."""
        return self.block if self.block is not None else (1, max(k, 1))


def fp8_scale_shapes(
    e: int, h: int, inter: int, block: tuple[int, int] | None
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of ``Fp8Scales.w13_scale`` and ``w2_scale`` for E experts of [2I, H], [H, I]."""
    if block is None:
        return (e, 2 * inter, 1), (e, h, 1)
    bn, bk = block
    return (e, 2 * -(-inter // bn), -(-h // bk)), (e, -(-h // bn), -(-inter // bk))


def scale_rows(rows: int, block_n: int, halves: bool, device: torch.device) -> torch.Tensor:
    """Each weight row's scale row: ``n // block_n``; with ``halves`` (w13's gate and up, each
    blocked on its own) the up rows' count on from the gate's last block."""
    n = torch.arange(rows, device=device)
    if not halves:
        return n // block_n
    half = rows // 2
    return torch.where(n < half, n // block_n, -(-half // block_n) + (n - half) // block_n)


def dequant_fp8_expert(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn: one expert's w13 or w2
    scale: torch.Tensor,  # [SN, SK] its scales (Fp8Scales)
    block: tuple[int, int],  # (block_n, block_k): Fp8Scales.blocks
    halves: bool,  # w13: the gate's and up's blocks apart
) -> torch.Tensor:  # [N, K] float32
    n, k = weight.shape
    rows = scale_rows(n, block[0], halves, weight.device)
    cols = torch.arange(k, device=weight.device) // block[1]
    return weight.float() * scale.float()[rows][:, cols]


def quantize_fp8_experts(
    w: torch.Tensor,  # [E, N, K] float: w13 (``halves``) or w2
    block: tuple[int, int] | None,  # None: one scale per output row
    halves: bool,
    amax: torch.Tensor | None = None,  # [E, N, 1] per-row magnitudes to use (tensor parallel)
) -> tuple[torch.Tensor, torch.Tensor]:  # ([E, N, K] e4m3, Fp8Scales' scale of it)
    """Stacked expert weights to e4m3, each block's (or row's) largest magnitude to 448."""
    e, n, k = w.shape
    wf = w.float()
    if block is None:
        mag = wf.abs().amax(dim=2, keepdim=True) if amax is None else amax.float()
        scale = (mag / 448.0).clamp(min=1e-12)  # [E, N, 1]
        return (wf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale
    bn, bk = block
    rows = scale_rows(n, bn, halves, w.device)  # [N]
    kb = -(-k // bk)
    cols = torch.arange(k, device=w.device) // bk
    mag = torch.zeros((e, int(rows.max()) + 1 if n else 0, kb), device=w.device)
    idx = (rows[:, None] * kb + cols[None, :]).reshape(-1)  # [N * K] block of each element
    flat = wf.abs().reshape(e, -1)
    mag.view(e, -1).scatter_reduce_(1, idx.expand(e, -1), flat, "amax", include_self=True)
    scale = (mag / 448.0).clamp(min=1e-12)
    q = (wf / scale[:, rows][:, :, cols]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


@dataclass(frozen=True)
class Int4Scales:
    """The groups of int4 expert weights (AWQ's and GPTQ's w4a16, converted at load): ``w13``
    [E, 2I, H / 8] and ``w2`` [E, H, I / 8] int32, each output row's K packed eight to a word in
    order (nibble ``j`` of word ``c`` holds column ``8c + j``: the dense serving layout of
    ``kernels.quant`` transposed, one row of words per output row); ``w[e, n, k] = (q - z) * s``
    with ``s = scale[e, n, k // G]`` (float32) and ``z = zeros[e, n, k // G]`` (uint8, 0..16:
    GPTQ's zero points plus one), ``w13_scale`` [E, 2I, H / G] and ``w2_scale`` [E, H, I / G]
    (zeros alike). ``group_size`` G; None: one group as wide as K (per channel).

    ``w13_perm`` [E, H] and ``w2_perm`` [E, I] (int32 or int64; None: the groups in order):
    act-order checkpoints (GPTQ desc_act, compressed-tensors actorder "group"), whose ``g_idx``
    assigns each input feature its group out of order, are held with each expert's K columns
    sorted by group at load (so every group is contiguous, as the kernels read them): packed
    column ``j`` of expert ``e`` holds input feature ``perm[e, j]``, and the kernels take the
    activations' columns through it (``x[:, perm[e]]``, a row a pair:
    ``kernels.triton_moe_pairs.permuted_rows``), as the dense act-order layer permutes its
    input (``quantization.int4``). A served model keeps no ``w2_perm``: ``Experts`` folds it
    into w13's rows at load."""

    w13_scale: torch.Tensor
    w13_zeros: torch.Tensor
    w2_scale: torch.Tensor
    w2_zeros: torch.Tensor
    group_size: int | None = None
    w13_perm: torch.Tensor | None = None
    w2_perm: torch.Tensor | None = None

    def group(self, k: int) -> int:
        """The group width of a weight with ``k`` input features."""
        return self.group_size if self.group_size is not None else max(k, 1)


def int4_scale_shapes(
    e: int, h: int, inter: int, group_size: int | None
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of ``Int4Scales.w13_scale`` (and zeros) and ``w2_scale`` for E experts of
    [2I, H], [H, I]."""
    g13, g2 = (group_size, group_size) if group_size else (h, inter)
    return (e, 2 * inter, h // max(g13, 1)), (e, h, inter // max(g2, 1))


def dequant_int4_expert(
    qweight: torch.Tensor,  # [N, K / 8] int32: one expert's w13 or w2 (Int4Scales)
    scale: torch.Tensor,  # [N, K / G] float32
    zeros: torch.Tensor,  # [N, K / G] uint8
    perm: torch.Tensor | None = None,  # [K]: the input feature of each packed column (act-order)
) -> torch.Tensor:  # [N, K] float32, columns in the input's order
    q = unpack_cols(qweight)  # eight K columns a word, in order
    cols = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // max(scale.shape[1], 1))
    w = (q - zeros.long()[:, cols]).float() * scale.float()[:, cols]
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm.long()] = w  # packed column j is input feature perm[j]
    return out


def ref_permuted_rows(
    src: torch.Tensor,  # [R, K]
    perm: torch.Tensor,  # [E, K]: each expert's input feature of each packed column
    ids: torch.Tensor,  # [P]: each row's expert
    top_k: int,  # row p reads src[p // top_k]
) -> torch.Tensor:  # [P, K]
    """``src[p // top_k, perm[ids[p]]]`` for each row ``p``: an act-order int4 expert's input
    with its columns in the order of its group-sorted packed weight (torch reference of
    ``kernels.triton_moe_pairs.permuted_rows``)."""
    rows = src[torch.arange(ids.numel(), device=src.device) // top_k]
    return rows.gather(1, perm[ids.long()].long())


def quantize_int4_experts(
    w: torch.Tensor,  # [E, N, K] float
    group_size: int | None,  # None: one group as wide as K
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [E, N, K/8] int32, scales, zeros
    """Asymmetric int4 (AWQ's min/max over 15 steps, zero points 0..15) in the layout of
    :class:`Int4Scales`: for tests and ``--load-format dummy``-like benchmarks."""
    e, n, k = w.shape
    g = group_size or k
    groups = w.float().reshape(e, n, k // g, g)
    lo = groups.amin(-1).clamp(max=0)
    hi = groups.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-5)  # [E, N, K/G]
    zeros = (-lo / scale).round().clamp(0, 15)
    q = (groups / scale[..., None]).round() + zeros[..., None]
    q = q.clamp(0, 15).reshape(e, n, k)
    return pack_cols(q), scale, zeros.to(torch.uint8)


def int4_scales_of(w13: torch.Tensor, int4: Int4Scales | None) -> Int4Scales | None:
    """``int4``, or the groups int32 ``w13`` carries (its ``int4_scales``, attached by the
    model's experts as FP8 ones are)."""
    if int4 is None and w13.dtype == torch.int32:
        return getattr(w13, "int4_scales", None)
    return int4


def check_int4_scales(
    w13: torch.Tensor, w2: torch.Tensor, int4: Int4Scales | None, x: torch.Tensor
) -> None:
    """ValueError unless int32 weights come with groups that fit them (and float or FP8 ones
    without)."""
    packed = w13.dtype == torch.int32
    if packed != (w2.dtype == torch.int32) or packed != (int4 is not None):
        raise ValueError(
            f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must both be int32 (packed int4) with int4 "
            f"scales, or neither ({'with' if int4 is not None else 'no'} int4 scales given)"
        )
    if int4 is None:
        return
    e, two_i, h = w13.shape[0], w13.shape[1], w13.shape[2] * 8
    inter = two_i // 2
    for k in (h, inter):
        g = int4.group(k)
        if k % g or not (g % 16 == 0 or g == k):
            raise ValueError(
                f"int4 group size {int4.group_size} must divide K = {k} and be a multiple of 16"
            )
    want = int4_scale_shapes(e, h, inter, int4.group_size)
    pairs = (
        ("w13_scale", int4.w13_scale, int4.w13_zeros, want[0]),
        ("w2_scale", int4.w2_scale, int4.w2_zeros, want[1]),
    )
    for name, scale, zeros, shape in pairs:
        if tuple(scale.shape) != shape or scale.dtype != torch.float32:
            raise ValueError(
                f"{name} is {tuple(scale.shape)} {scale.dtype}; expected {shape} float32"
            )
        if (
            zeros.shape != scale.shape
            or zeros.dtype != torch.uint8
            or zeros.stride() != scale.stride()
        ):
            raise ValueError(
                f"{name}'s zeros are {tuple(zeros.shape)} {zeros.dtype}; expected uint8 laid out "
                "as the scales"
            )
        if scale.device != x.device or zeros.device != x.device:
            raise ValueError(f"{name} is on {scale.device}; x is on {x.device}")
    for name, perm, k in (("w13_perm", int4.w13_perm, h), ("w2_perm", int4.w2_perm, inter)):
        if perm is None:
            continue
        if (
            tuple(perm.shape) != (e, k)
            or perm.dtype not in (torch.int32, torch.int64)
            or (k > 1 and perm.stride(1) != 1)
        ):
            raise ValueError(
                f"{name} is {tuple(perm.shape)} {perm.dtype}; expected {(e, k)} int32 or int64, "
                "contiguous along K"
            )
        if perm.device != x.device:
            raise ValueError(f"{name} is on {perm.device}; x is on {x.device}")


def scales_of(w13: torch.Tensor, fp8: Fp8Scales | None) -> Fp8Scales | None:
    """``fp8``, or the scales e4m3 ``w13`` carries (its ``fp8_scales``: the model's experts
    attach them, so a caller passing only the weights, as DeepSeek's MoE block does, gets them)."""
    if fp8 is None and w13.dtype == torch.float8_e4m3fn:
        return getattr(w13, "fp8_scales", None)
    return fp8


def check_fp8_scales(
    w13: torch.Tensor, w2: torch.Tensor, scales: Fp8Scales | None, x: torch.Tensor
) -> None:
    """ValueError unless the weights are float with no scales, or e4m3 with scales that fit."""
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8 != (w2.dtype == torch.float8_e4m3fn) or fp8 != (scales is not None):
        raise ValueError(
            f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must both be float8_e4m3fn with fp8 scales, "
            f"or both float without ({'with' if scales is not None else 'no'} scales given)"
        )
    if scales is None:
        return
    e, two_i, h = w13.shape
    want = fp8_scale_shapes(e, h, two_i // 2, scales.block)
    pairs = (("w13_scale", scales.w13_scale), ("w2_scale", scales.w2_scale))
    for (name, scale), shape in zip(pairs, want, strict=True):
        if tuple(scale.shape) != shape or scale.dtype != torch.float32:
            raise ValueError(
                f"{name} is {tuple(scale.shape)} {scale.dtype}; expected {shape} float32 "
                f"(block {scales.block})"
            )
        if scale.device != x.device:
            raise ValueError(f"{name} is on {scale.device}; x is on {x.device}")
    if scales.block is not None and (min(scales.block) < 1 or scales.block[1] % 16):
        raise ValueError(f"fp8 block {scales.block}: block_k must be a multiple of 16")


def ref_moe_routing(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 ids)
    """Softmax over all experts (in fp32), the ``top_k`` largest, optionally divided by their sum
    (Mixtral always; Qwen3-MoE with ``norm_topk_prob``): the weights are then a softmax over the
    top-k logits."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def ref_grouped_topk(
    router_logits: torch.Tensor,  # [T, E] (float32: transformers' routers compute in it)
    top_k: int,
    *,
    sigmoid: bool = False,  # DeepSeek-V3's scores; False: a softmax (DeepSeek-V2's)
    correction_bias: torch.Tensor | None = None,  # [E]: added to the scores to choose, only
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = False,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 ids)
    """DeepSeek's routers (transformers' ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``):
    experts in ``num_groups`` equal groups, the ``topk_groups`` best groups kept, the ``top_k``
    best experts of those chosen. V2 (softmax): a group ranks by its best score, the others'
    scores set to 0 (one group: ``greedy``). V3 (sigmoid, ``noaux_tc``): scores plus
    ``correction_bias`` choose, a group ranks by the sum of its two best, the others set to
    -inf; the weights are the chosen experts' scores without the bias. Then the weights divided
    by their sum (``renormalize``, + 1e-20 as transformers) and times ``scaling``
    (``routed_scaling_factor``)."""
    t, e = router_logits.shape
    logits = router_logits.float()
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        grouped = choice.view(t, num_groups, e // num_groups)  # [T, G, E/G]
        ranks = grouped.topk(2, dim=-1)[0].sum(dim=-1) if sigmoid else grouped.amax(dim=-1)
        best = torch.topk(ranks, topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
        kept = torch.zeros_like(ranks).scatter_(1, best, 1.0).bool()  # [T, G]
        kept = kept[:, :, None].expand(-1, -1, e // num_groups).reshape(t, e)
        choice = choice.masked_fill(~kept, float("-inf") if sigmoid else 0.0)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]  # [T, top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def sort_by_expert(
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # [T, top_k]
) -> tuple[torch.Tensor, torch.Tensor]:  # the same, each row in ascending expert order
    """Each token's experts in ascending order: the order its contributions are summed in."""
    ids, perm = torch.sort(topk_ids, dim=-1, stable=True)
    return topk_weights.gather(-1, perm), ids


def check_moe_shapes(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    packed: int = 1,
) -> tuple[int, int, int, int]:  # fmt: skip
    """(T, H, E, I) of a fused-MoE call; ``ValueError`` naming the argument that disagrees. The
    biases, where given, must also have x's dtype and device. ``packed``: weights whose last
    dimension holds that many elements a word (int4: 8)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    t, h = x.shape
    e, two_i, h13 = w13.shape
    h13 *= packed
    inter = two_i // 2
    if h13 != h or two_i % 2 or inter % packed:
        raise ValueError(f"w13 {tuple(w13.shape)} must be [E, 2I, H / {packed}] with H = {h}")
    if tuple(w2.shape) != (e, h, inter // packed):
        raise ValueError(
            f"w2 {tuple(w2.shape)} must be [E, H, I / {packed}] = {(e, h, inter // packed)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
            f"must both be [T, top_k] with T = {t}"
        )
    for name, bias, shape in (("b13", b13, (e, two_i)), ("b2", b2, (e, h))):
        if bias is None:
            continue
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} {tuple(bias.shape)} must be {shape}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(
                f"{name} is {bias.dtype} on {bias.device}; x is {x.dtype} on {x.device}"
            )
    return t, h, e, inter


def ref_fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float (fp32, or x's dtype)
    topk_ids: torch.Tensor,  # [T, top_k] int, in [0, E)
    *,
    b13: torch.Tensor | None = None,  # [E, 2I]: gate half, then up half; x's dtype
    b2: torch.Tensor | None = None,  # [E, H]; x's dtype
    clamp: ClampedSwiGLU | None = None,  # None: silu(gate) * up
    fp8: Fp8Scales | None = None,  # the scales of e4m3 w13 and w2
    int4: Int4Scales | None = None,  # the groups of packed int4 w13 and w2
) -> torch.Tensor:  # [T, H]
    """``sum_j weight[t, j] * expert[ids[t, j]](x[t])`` with transformers' rounding."""
    int4 = int4_scales_of(w13, int4)
    packed = 8 if w13.dtype == torch.int32 else 1
    t, h, _, inter = check_moe_shapes(
        x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, packed=packed
    )
    fp8 = scales_of(w13, fp8)
    check_int4_scales(w13, w2, int4, x)
    if int4 is None:
        check_fp8_scales(w13, w2, fp8, x)
    dt = x.dtype
    weights, ids = sort_by_expert(topk_weights, topk_ids.long())
    contrib = torch.zeros((t, ids.shape[1], h), dtype=dt, device=x.device)  # [T, top_k, H]
    for expert in ids.unique().tolist():
        rows, slots = torch.nonzero(ids == expert, as_tuple=True)
        w_up, w_down = w13[expert], w2[expert]
        if fp8 is not None:  # dequantized as a float checkpoint's, rounded to x's dtype
            w_up = dequant_fp8_expert(w_up, fp8.w13_scale[expert], fp8.blocks(h), True).to(dt)
            w_down = dequant_fp8_expert(w_down, fp8.w2_scale[expert], fp8.blocks(inter), False)
            w_down = w_down.to(dt)
        if int4 is not None:  # dequantized as at load (AWQ/GPTQ), rounded to x's dtype
            p13, p2 = (None if p is None else p[expert] for p in (int4.w13_perm, int4.w2_perm))
            w_up = dequant_int4_expert(w_up, int4.w13_scale[expert], int4.w13_zeros[expert], p13)
            w_up = w_up.to(dt)
            w_down = dequant_int4_expert(w_down, int4.w2_scale[expert], int4.w2_zeros[expert], p2)
            w_down = w_down.to(dt)
        gate_up = (x[rows].float() @ w_up.float().T).to(dt)  # [n, 2I]
        if b13 is not None:
            gate_up = (gate_up.float() + b13[expert].float()).to(dt)
        act = ref_silu_and_mul(gate_up) if clamp is None else ref_clamped_swiglu(gate_up, clamp)
        down = (act.float() @ w_down.float().T).to(dt)  # [n, H]
        if b2 is not None:
            down = (down.float() + b2[expert].float()).to(dt)
        contrib[rows, slots] = (down.float() * weights[rows, slots, None].float()).to(dt)
    return sum_contributions(contrib)


def ref_clamped_swiglu(
    gate_up: torch.Tensor,  # [n, 2I]: gate, then up
    clamp: ClampedSwiGLU,
) -> torch.Tensor:  # [n, I]
    """:class:`ClampedSwiGLU` in fp32 (in ``GptOssExperts._apply_gate``'s order of ops), rounded
    once to gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=clamp.limit)
    up = up.clamp(min=-clamp.limit, max=clamp.limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * clamp.alpha))).to(gate_up.dtype)


def sum_contributions(contrib: torch.Tensor) -> torch.Tensor:  # [T, top_k, H] -> [T, H]
    """The contributions added in order, each sum rounded to their dtype."""
    out = contrib[:, 0]
    for j in range(1, contrib.shape[1]):
        out = (out.float() + contrib[:, j].float()).to(contrib.dtype)
    return out.clone() if contrib.shape[1] == 1 else out
