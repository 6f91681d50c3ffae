"""Mixture-of-Experts layers: the pure-torch references of routing and of the expert MLPs.

``kernels.triton_moe.fused_moe`` has the same signature as :func:`ref_fused_moe` and is tested
against it. Each token goes through ``top_k`` experts, each a SiLU-gated MLP
(``down(silu(gate(x)) * up(x))``), and the results are summed weighted by the router.

Rounding follows transformers' ``Qwen3MoeExperts`` / ``MixtralExperts``: every projection is
rounded to the activation dtype, the weighted contribution ``down * weight`` is rounded to it, and
a token's contributions are added one expert at a time in ascending expert order, each sum rounded
(``index_add_`` into a tensor of the activation dtype, experts visited in index order). In float32
every rounding is the identity and only the order of the additions remains.
"""

from __future__ import annotations

import torch

from kernels.layers import ref_silu_and_mul


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


def sort_by_expert(
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # [T, top_k]
) -> tuple[torch.Tensor, torch.Tensor]:  # the same, each row in ascending expert order
    """Each token's experts in ascending order: the order its contributions are summed in."""
    ids, perm = torch.sort(topk_ids, dim=-1, stable=True)
    return topk_weights.gather(-1, perm), ids


def check_moe_shapes(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> tuple[int, int, int, int]:  # fmt: skip
    """(T, H, E, I) of a fused-MoE call; ``ValueError`` naming the argument that disagrees."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    t, h = x.shape
    e, two_i, h13 = w13.shape
    inter = two_i // 2
    if h13 != h or two_i % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} must be [E, 2I, H] with H = {h}")
    if tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"w2 {tuple(w2.shape)} must be [E, H, I] = {(e, h, inter)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
            f"must both be [T, top_k] with T = {t}"
        )
    return t, h, e, inter


def ref_fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float (fp32, or x's dtype)
    topk_ids: torch.Tensor,  # [T, top_k] int, in [0, E)
) -> torch.Tensor:  # [T, H]
    """``sum_j weight[t, j] * expert[ids[t, j]](x[t])`` with transformers' rounding."""
    t, h, _, _ = check_moe_shapes(x, w13, w2, topk_weights, topk_ids)
    dt = x.dtype
    weights, ids = sort_by_expert(topk_weights, topk_ids.long())
    contrib = torch.zeros((t, ids.shape[1], h), dtype=dt, device=x.device)  # [T, top_k, H]
    for expert in ids.unique().tolist():
        rows, slots = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = (x[rows].float() @ w13[expert].float().T).to(dt)  # [n, 2I]
        down = (ref_silu_and_mul(gate_up).float() @ w2[expert].float().T).to(dt)  # [n, H]
        contrib[rows, slots] = (down.float() * weights[rows, slots, None].float()).to(dt)
    return sum_contributions(contrib)


def sum_contributions(contrib: torch.Tensor) -> torch.Tensor:  # [T, top_k, H] -> [T, H]
    """The contributions added in order, each sum rounded to their dtype."""
    out = contrib[:, 0]
    for j in range(1, contrib.shape[1]):
        out = (out.float() + contrib[:, j].float()).to(contrib.dtype)
    return out.clone() if contrib.shape[1] == 1 else out
