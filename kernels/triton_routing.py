"""The MoE router's choice in one launch: softmax, top-k and renormalization a token per program.

Same signature and results as :func:`kernels.moe.ref_moe_routing` (weights within float32
rounding; ids equal except between logits that tie exactly). In torch the router is a softmax,
a top-k (itself a gather and a sort) and, renormalized, a sum and a division: on an H200 ~0.6
ms of Qwen3-30B-A3B's 4.5 ms batch-1 decode step over its 48 layers, for ``T x E`` floats a
layer. Here one program a token holds its ``E`` logits in registers (``BLOCK_E``, E's next power
of two), takes the ``top_k`` largest one at a time (the largest left, the lowest index among
equals), and writes their softmax weights, divided by their sum where asked.

The experts are chosen on the logits themselves, not on their softmax: the softmax is monotonic,
so the choice is the same, without the exponentials' rounding in it (an expert's -inf logit
ranks below every finite one and is taken once, weight 0, where ``top_k`` reaches it). The weights are computed as
the reference's: ``exp(l - max) / sum(exp(l - max))`` in float32, then each over the chosen
weights' sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import next_pow2

MAX_EXPERTS = 4096  # a token's logits in one program's registers; more: the torch reference


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, s_lt, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
    BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    logits = tl.load(logits_ptr + t * s_lt + offs, mask=mask, other=float("-inf")).to(tl.float32)
    peak = tl.max(logits, axis=0)
    ex = tl.where(mask, tl.exp(logits - peak), 0.0)
    total = tl.sum(ex, axis=0)
    slots = tl.arange(0, TOP_K_P2)
    chosen_w = tl.zeros([TOP_K_P2], dtype=tl.float32)
    chosen_id = tl.zeros([TOP_K_P2], dtype=tl.int64)
    # chosen on keys where an expert's -inf logit is the lowest finite float: only the taken
    # and the padding are -inf, so a top-k that reaches the -inf experts takes each once
    left = tl.where(mask & (logits == float("-inf")), -3.4028234663852886e38, logits)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=0, tie_break_left=True)
        here = offs == best
        prob = tl.sum(tl.where(here, ex, 0.0), axis=0) / total
        chosen_w = tl.where(slots == j, prob, chosen_w)
        chosen_id = tl.where(slots == j, best.to(tl.int64), chosen_id)
        left = tl.where(here, float("-inf"), left)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=0)
    out = t * TOP_K + slots
    tl.store(weights_ptr + out, chosen_w, mask=slots < TOP_K)
    tl.store(ids_ptr + out, chosen_id, mask=slots < TOP_K)


def moe_routing(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 ids)
    """Triton version of :func:`kernels.moe.ref_moe_routing` (``E`` up to
    :data:`MAX_EXPERTS`, ``top_k`` up to ``E``; the caller checks)."""
    t, e = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    dev = router_logits.device
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    if t == 0 or top_k == 0:
        return weights, ids
    block_e = max(2, next_pow2(e))
    _route_kernel[(t,)](
        router_logits, weights, ids, e, router_logits.stride(0), TOP_K=top_k,
        TOP_K_P2=max(2, next_pow2(top_k)), BLOCK_E=block_e, RENORMALIZE=renormalize,
        num_warps=4 if block_e >= 512 else 1,
    )  # fmt: skip
    return weights, ids
