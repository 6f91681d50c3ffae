"""Tensor parallelism applied from outside the plain model (gpt-fast's ``apply_tp``).

The model is built from the rank's local ``ArchConfig`` (``TPLayout.local_arch``): its
attention has the rank's heads, its MLP the rank's intermediate rows, its embedding and
lm_head the rank's vocabulary shard, so qkv_proj and gate_up_proj are column-parallel as
built. :func:`apply_tp` then swaps, on the meta device before any weight exists, the layers
whose outputs need the other ranks: o_proj and down_proj all-reduce their partial sums, the
embedding looks up only its own rows (zeros elsewhere) and all-reduces, lm_head all-gathers
the logits. The swapped modules keep their parameter names, so the loader fills them as usual
with the rank's slices (``TPLayout.checkpoint_slice``). A Mixture-of-Experts block (each rank
every expert's share of the intermediate rows) sums its output over the ranks through a
forward hook: the block itself is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import ops
from services.engine.models.deepseek import DeepseekMoe, MLAttention
from services.engine.models.llama import MLP, Attention, Linear, LlamaForCausalLM, RMSNorm
from services.engine.models.moe import SparseMoeBlock
from services.engine.models.starcoder2 import UngatedMLP
from services.engine.tp_group import TPGroup
from services.engine.tp_layout import TPLayout


class RowParallelLinear(Linear):
    """Input features split by rank; the partial products are summed over the ranks."""

    def __init__(self, linear: nn.Linear, group: TPGroup) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the product (no bias): what the ranks' sum adds up."""
        return ops.linear(x, self.weight, None)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' sum of their ``partial`` products, then the bias (added once)."""
        y = self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


class SplitRowRMSNorm(RMSNorm):
    """An RMSNorm of rows each rank holds a part of (OLMo 2's q and k norms over every head):
    the ranks' sums of squares summed, over ``width``, the whole row's (a KV head replicated
    on several ranks counts on each, in the squares and in the width alike)."""

    def __init__(self, norm: RMSNorm, group: TPGroup, width: int) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.group, self.width = group, width

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H D / tp]
        assert residual is None
        xf = x.float()
        squares = self.group.all_reduce(xf.pow(2).sum(-1, keepdim=True))  # [T, 1]
        normed = (xf * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)
        return (self.weight.float() * normed.float()).to(x.dtype), x  # as ref_rms_norm rounds


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary; a token outside them is a zero row before the sum."""

    def __init__(self, embedding: nn.Embedding, group: TPGroup, rows: tuple[int, int]) -> None:
        super().__init__(embedding.num_embeddings, embedding.embedding_dim)
        self.group = group
        self.start, self.end = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        mine = (ids >= self.start) & (ids < self.end)  # [T]
        x = nn.functional.embedding((ids - self.start) * mine, self.weight)  # [T, hidden]
        return self.group.all_reduce(x * mine[:, None].to(x.dtype))


class GatheredLMHead(Linear):
    """This rank's vocabulary rows; every rank gets the whole logits, padding rows cut off."""

    def __init__(self, linear: nn.Linear, group: TPGroup, vocab_size: int) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.group = group
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, V]
        part = ops.linear(x, self.weight, None)  # [B, V / tp]
        return self.group.all_gather(part)[:, : self.vocab_size]


def apply_tp(model: LlamaForCausalLM, group: TPGroup, layout: TPLayout, vocab_size: int) -> None:
    """Swap the layers that talk to the other ranks (call on the meta device, before loading)."""
    q_rows, k_rows, _ = layout.whole_rows
    # the ranks' k rows: the whole k projection's, or one head each where heads are replicated
    k_width = max(k_rows, layout.size * layout.head_dim)
    for layer in model.model.layers:
        # Llama's layer or one built on its attention and MLP (Gemma 3's), or a sparse MLP
        attn = layer.self_attn
        assert isinstance(attn, Attention | MLAttention)  # MLA: q, kv_b by head, kv_a whole
        attn.o_proj = RowParallelLinear(attn.o_proj, group)
        if (
            isinstance(attn, Attention)
            and attn.qk_norm_whole
            and attn.q_norm is not None
            and attn.k_norm is not None
        ):
            attn.q_norm = SplitRowRMSNorm(attn.q_norm, group, q_rows)
            attn.k_norm = SplitRowRMSNorm(attn.k_norm, group, k_width)
        if isinstance(layer.mlp, SparseMoeBlock | DeepseekMoe):  # DeepSeek's shared experts'
            # rows split too: their partial sum joins the experts' in the one all-reduce
            layer.mlp.register_forward_hook(_summed_over(group))
        elif isinstance(layer.mlp, UngatedMLP):  # c_fc column-, c_proj row-parallel
            layer.mlp.c_proj = RowParallelLinear(layer.mlp.c_proj, group)
        else:
            assert isinstance(layer.mlp, MLP)
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, group, layout.vocab)
    model.lm_head = GatheredLMHead(model.lm_head, group, vocab_size)
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _summed_over(group: TPGroup) -> Any:
    """A forward hook that all-reduces a module's output (its partial sum on each rank)."""

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(out)

    return hook
