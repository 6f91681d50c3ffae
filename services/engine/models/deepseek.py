"""DeepSeek-V2 and V3 (Moonlight, Kimi-K2) in plain PyTorch over a paged KV cache: the Llama
decoder layer with multi-head latent attention and DeepSeek's MoE; and GLM-4.5/4.6, the Llama
layers with DeepSeek's MoE (``Glm4MoeForCausalLM``).

- Attention (MLA): q from ``q_proj``, or a low-rank ``q_a_proj`` -> RMSNorm -> ``q_b_proj``;
  ``kv_a_proj_with_mqa`` gives a latent (RMSNormed; ``kv_b_proj`` would expand it into each
  head's nope key and value) and one rotary key part every head shares. The paged cache holds
  the latent, as vLLM's: a token and layer is one row ``[k_rope (rotated) | latent]`` of
  ``qk_rope_head_dim + kv_lora_rank`` values (576 for V2/V3) in one KV head, in one plane
  (``ArchConfig.kv_planes``: no separate values). Attention runs absorbed: each head's nope
  query times its W_UK (kv_b_proj's key rows) joins its rotated rope query, so q . row is the
  expanded q . k; every query head attends over the one KV head (MQA), the cache tensor given
  as both keys and values (written once, keys only: ``ops.rotary_write_kv`` with v None); the
  output's latent part times each head's W_UV (the value rows) is that head's value. The
  expanded form (``2 * heads * (nope + rope)`` values a token: 49,152 for V3 against 576) is
  gone from the cache. Prompt chunks attend in the expanded form (vLLM's MLA prefill:
  ``kv_b_proj`` expands latents into keys and values of 192 and 128 dims, ~3x fewer FLOPs than
  576, a cached prefix's from the cache; :meth:`MLAttention._forward_expanded`); decode rows and
  FP8 caches absorbed, decode rows through ``ops.mla_decode_attention`` (the latent decode
  kernel: each key tile's latent columns are its values too, the attended latent out).
- Rotary pairs: V2 (and V3 with ``rope_interleave``) rotates dims (0, 1), (2, 3), ...; the
  loader reorders those rows of the q and kv_a projections into halves (``rope_halves``).
- MoE: the router in float32 (transformers keeps it there), ``ops.grouped_topk`` (V2's softmax,
  V3's sigmoid with the correction bias), the experts through ``ops.fused_moe``, and the shared
  experts' MLP added unweighted.
- Tensor parallelism (``tp_layers``, ``TPLayout._mla_slice``): each rank its heads' q, kv_b
  and o_proj rows or columns, the latent projections whole; the MoE block's output (routed
  and shared experts, each rank their rows) summed over the ranks in one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops
from kernels.attention import pad_head_dim
from services.engine.attention_metadata import AttentionMetadata
from services.engine.model_config import ArchConfig, MlaConfig, MoeConfig
from services.engine.models.llama import (
    MLP,
    DecoderLayer,
    Linear,
    LlamaForCausalLM,
    RMSNorm,
    paged_attention,
)
from services.engine.models.moe import Experts, SharedExpert

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its default
# prompt chunks in the expanded form (MLAttention._forward_expanded); False runs them absorbed
# too (measurement: scripts/device/mla_moe.sh patches it to compare)
EXPANDED_PREFILL = True
# the most bytes the expanded keys and values of a step's cached prefixes may take (each head's
# keys and values of every prefix token, made from the cached latents); past it the chunks
# after a prefix attend absorbed over the latent cache
EXPANDED_PREFIX_BYTES = 512 << 20


class MLAttention(nn.Module):
    """Multi-head latent attention over a cache of the latent (module docstring): each token's
    ``[rotary key | normed latent]`` once, read by every query head (MQA over one KV head of
    ``kv_lora_rank + qk_rope_head_dim`` dims) as its key and as its value, in the absorbed
    form: ``kv_b_proj``'s key rows turn each head's nope query into the latent space, its value
    rows turn each head's attended latent into that head's value."""

    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        assert cfg.mla is not None
        mla: MlaConfig = cfg.mla
        self.layer, self.mla = layer, mla
        self.nq = cfg.num_heads
        hidden, bias, qk = cfg.hidden_size, cfg.attention_bias, mla.qk_head_dim
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, self.nq * qk, bias=False)
        else:
            self.q_proj = Linear(hidden, self.nq * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        kv_width = mla.qk_nope_head_dim + mla.v_head_dim
        # read as a plain [H (nope + v), kv_lora] weight: W_UK and W_UV per head (_absorbed)
        self.kv_b_proj = Linear(mla.kv_lora_rank, self.nq * kv_width, bias=False)
        self.kv_b_proj.keep_dense_weight = True  # read as W_UK and W_UV too (_absorb)
        self.o_proj = Linear(self.nq * mla.v_head_dim, hidden, bias=cfg.o_proj_bias)
        self.scale = mla.softmax_scale
        # an FP8 cache's one scale: the keys and the values are the same bytes
        self.kv_scale = 1.0

    def _query(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, H qk]
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:  # [H, nope, L], [H, v, L]
        """Each head's W_UK (its nope key rows of kv_b_proj) and W_UV (its value rows)."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.nq, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each head's query [T, H, nope + rope], the token's normed latent [T, L] and its
        rotary key part [T, R] (not rotated yet)."""
        m = self.mla
        q = self._query(x).view(x.shape[0], self.nq, m.qk_head_dim)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        return q, self.kv_a_layernorm(latent.contiguous())[0], k_rope

    def _absorb(self, q: torch.Tensor) -> torch.Tensor:  # [T, H, nope + rope] -> [T, H, R + L]
        """Each head's query in the cache's space, ``[q_rope | q_nope W_UK]``."""
        nope = self.mla.qk_nope_head_dim
        w_uk, _ = self._absorbed()
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        return torch.cat([q[..., nope:], q_latent], dim=-1)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [max_pos, rope]
        kv_cache: torch.Tensor,  # [1, N, bs, 1, R + L]: one plane, the keys are the values
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T, m = x.shape[0], self.mla
        cache = kv_cache[0]
        # prompt chunks attend in the expanded form (a cache of q's dtype: attention must see
        # the cache's rounding, as Llama's k_new), when the step says which have a prefix
        known = meta.prefill_no_prefix or meta.prefix_prefills > 0
        if (
            EXPANDED_PREFILL
            and known
            and meta.num_decodes < T
            and meta.span_last is None
            and cache.dtype == x.dtype
        ):
            return self._forward_expanded(x, positions, cos_sin, cache, meta)
        q, latent, k_rope = self._project(x)
        q = self._absorb(q)
        k = torch.cat([k_rope, latent], dim=-1)[:, None, :]  # the cache row [k_rope | latent]
        scaled = cache.element_size() == 1  # FP8: the scale applies
        # rotate q's and k's rope dims, write k once (v None: the values are the keys)
        q = ops.rotary_write_kv(
            positions, q, k, None, cos_sin, cache, cache, meta.slot_mapping,
            self.kv_scale, self.kv_scale,
        )  # fmt: skip
        if meta.on_kv_written is not None:
            meta.on_kv_written(self.layer)
        scale = self.scale * (self.kv_scale if scaled else 1)
        rope, nd = m.qk_rope_head_dim, meta.num_decodes
        if meta.decode_only:  # the latent decode kernel: the attended latent alone
            o = ops.mla_decode_attention(
                q, cache, meta.block_tables, meta.context_lens, scale, rope
            )
        elif nd == 0:  # [T, H, R + L]: the rope columns dropped
            o = paged_attention(q, cache, cache, meta, scale)[..., rope:]
        else:  # decode rows as in a decode step, then the prompt rows through the prefill kernel
            assert meta.prefill_start_loc is not None
            o = q.new_empty((T, self.nq, m.kv_lora_rank))
            ops.mla_decode_attention(
                q[:nd], cache, meta.block_tables[:nd], meta.context_lens[:nd], scale, rope,
                out=o[:nd],
            )  # fmt: skip
            spans = meta.span_last
            o[nd:] = ops.prefill_attention(
                q[nd:], cache, cache, meta.block_tables[nd:], meta.prefill_start_loc,
                meta.context_lens[nd:], scale, span_last=spans[nd:] if spans is not None else None,
            )[..., rope:]  # fmt: skip
        if scaled and self.kv_scale != 1.0:
            o = o * self.kv_scale
        out = self._values(o)  # [T, H, v]
        return self.o_proj(out.reshape(T, self.nq * m.v_head_dim))  # [T, hidden]

    def _values(self, o_latent: torch.Tensor) -> torch.Tensor:  # [T, H, L] -> [T, H, v]
        """Each head's value from its attended latent (W_UV)."""
        _, w_uv = self._absorbed()
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _forward_expanded(
        self,
        x: torch.Tensor,  # [T, hidden]: decode rows, chunks after a prefix, then new chunks
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        cache: torch.Tensor,  # [N, bs, 1, R + L], of x's dtype
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """A step with prompt chunks (the model runner lays the chunks after a cached prefix
        out before the new ones). The cache gets every token's latent row as in
        :meth:`forward`; decode rows attend absorbed over the cache; prompt chunks attend in the
        expanded form, as transformers computes (vLLM's MLA prefill): ``kv_b_proj`` turns each
        latent into every head's nope key and value, and each head attends over ``nope + rope``
        dims (192 for V2/V3) with ``v_head_dim`` values, where the absorbed form reads
        ``kv_lora_rank + rope`` (576) twice: ~3x fewer FLOPs. A chunk after a prefix reads the
        prefix's keys and values expanded from its cached latents (:meth:`_expanded_prefix`);
        past ``EXPANDED_PREFIX_BYTES`` of them those chunks attend absorbed."""
        m, T, H, nd = self.mla, x.shape[0], self.nq, meta.num_decodes
        nope, v_dim = m.qk_nope_head_dim, m.v_head_dim
        npre, old = meta.prefix_prefills, nd + meta.prefix_prefill_rows
        blocks = -(-meta.prefix_prefill_longest // cache.shape[1])  # a prefix's, at most
        width = max(m.qk_head_dim, v_dim)
        prefix_bytes = npre * blocks * cache.shape[1] * H * 2 * width * x.element_size()
        absorbed = old if npre and prefix_bytes > EXPANDED_PREFIX_BYTES else nd  # rows [0, it)
        q, latent, k_rope = self._project(x)
        rows = torch.cat([k_rope, latent], dim=-1)[:, None, :]  # [T, 1, R + L], rope unrotated
        out = x.new_empty((T, H, v_dim))
        q_abs = None
        if absorbed:  # their queries in the cache's space, rotated as their rows are written
            q_abs = ops.rotary_write_kv(
                positions[:absorbed], self._absorb(q[:absorbed]), rows[:absorbed], None,
                cos_sin, cache, cache, meta.slot_mapping[:absorbed],
            )  # fmt: skip
        ex = slice(absorbed, T)
        # the expanded rows' latents into the cache (the rotated copy it returns is not needed)
        ops.rotary_write_kv(
            positions[ex], rows[ex], rows[ex], None, cos_sin, cache, cache, meta.slot_mapping[ex]
        )
        if meta.on_kv_written is not None:
            meta.on_kv_written(self.layer)
        seqs = slice(nd, nd + npre)  # the chunks after a prefix
        assert meta.prefill_start_loc is not None  # from the prefill rows' first
        if q_abs is not None:
            rope = m.qk_rope_head_dim
            o = q_abs.new_empty((absorbed, H, m.kv_lora_rank))  # the attended latents
            if nd:
                ops.mla_decode_attention(
                    q_abs[:nd], cache, meta.block_tables[:nd], meta.context_lens[:nd],
                    self.scale, rope, out=o[:nd],
                )  # fmt: skip
            if absorbed > nd:
                o[nd:] = ops.prefill_attention(
                    q_abs[nd:], cache, cache, meta.block_tables[seqs],
                    meta.prefill_start_loc[: npre + 1], meta.context_lens[seqs], self.scale,
                )[..., rope:]  # fmt: skip
            out[:absorbed] = self._values(o)
        # expanded: [rope | nope] for queries and keys alike (a dot product's order is free)
        kv = self.kv_b_proj(latent[ex]).view(T - absorbed, H, nope + v_dim)
        q_ex = torch.cat([q[ex, :, nope:], q[ex, :, :nope]], dim=-1)
        k_ex = torch.cat([k_rope[ex, None, :].expand(-1, H, -1), kv[..., :nope]], dim=-1)
        ops.rotary_embedding(positions[ex], q_ex, k_ex, cos_sin)  # in place, both
        after = old - absorbed  # the expanded rows of chunks after a prefix
        if after:
            k_cache, v_cache, tables = self._expanded_prefix(
                cache, meta.block_tables[seqs, :blocks], width
            )
            o = ops.prefill_attention(
                pad_head_dim(q_ex[:after], width), k_cache, v_cache, tables,
                meta.prefill_start_loc[: npre + 1], meta.context_lens[seqs], self.scale,
                k_new=pad_head_dim(k_ex[:after], width),
                v_new=pad_head_dim(kv[:after, :, nope:], width),
            )  # fmt: skip
            out[absorbed:old] = o[..., :v_dim]
        if old < T:
            starts = meta.prefill_start_loc[npre:] - (old - nd)  # the new chunks'
            ops.varlen_attention(
                q_ex[after:], k_ex[after:], kv[after:, :, nope:], starts, self.scale,
                out=out[old:],
            )  # fmt: skip
        return self.o_proj(out.reshape(T, H * v_dim))  # [T, hidden]

    def _expanded_prefix(
        self, cache: torch.Tensor, blocks: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cached prefixes of a step's chunks, expanded: their ``blocks`` [B, W] of latent
        rows gathered, each head's key ``[rotated k_rope | nope key]`` and value made by
        ``kv_b_proj``, zero-padded to ``width``, in blocks of the cache's size ([B * W, bs, H,
        width] each), and the table [B, W] that reads them (block i of sequence b at row
        b * W + i). A block past a prefix holds whatever the cache held (its slots are never
        read: the new tokens come from k_new)."""
        m, H = self.mla, self.nq
        n, bs = blocks.numel(), cache.shape[1]
        rows = cache.index_select(0, blocks.flatten()).view(n * bs, -1)  # [n bs, R + L]
        rope = m.qk_rope_head_dim
        kv = self.kv_b_proj(rows[:, rope:]).view(n * bs, H, m.qk_nope_head_dim + m.v_head_dim)
        k = torch.cat([rows[:, None, :rope].expand(-1, H, -1), kv[..., : m.qk_nope_head_dim]], -1)
        k_cache = pad_head_dim(k, width).view(n, bs, H, width)
        v_cache = pad_head_dim(kv[..., m.qk_nope_head_dim :], width).view(n, bs, H, width)
        tables = torch.arange(n, dtype=torch.int32, device=cache.device).view(blocks.shape)
        return k_cache, v_cache, tables


class Router(nn.Module):
    """The router's weight [E, H] and V3's correction bias [E], kept in float32 whatever the
    model's dtype (transformers' ``_keep_in_fp32_modules_strict``): a 16-bit bias would move
    which experts win. The model is cast before its weights load (on the meta device), so
    nothing is rounded on the way."""

    def __init__(self, experts: int, hidden: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(experts)) if correction_bias else None
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out.float() if t.is_floating_point() and out.is_floating_point() else out

        return super()._apply(keep_fp32, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] float32
        return F.linear(x.float(), self.weight)


class DeepseekMoe(nn.Module):
    def __init__(self, moe: MoeConfig, hidden: int) -> None:
        super().__init__()
        assert moe.grouped is not None
        self.moe, self.routing = moe, moe.grouped
        self.gate = Router(moe.num_experts, hidden, correction_bias=moe.grouped.sigmoid)
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size)
        self.shared_experts: SharedExpert | None = None
        if moe.shared_intermediate_size:
            self.shared_experts = SharedExpert(hidden, moe.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        r = self.routing
        weights, ids = ops.grouped_topk(
            self.gate(x), self.moe.top_k, sigmoid=r.sigmoid,
            correction_bias=self.gate.e_score_correction_bias, num_groups=r.num_groups,
            topk_groups=r.topk_groups, renormalize=self.moe.renormalize, scaling=r.scaling,
        )  # fmt: skip
        out = ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_experts is not None:  # always on, unweighted
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(DecoderLayer):
    """The Llama layer (a norm before each branch) with MLA and, from
    ``first_k_dense_replace`` on, DeepSeek's MoE."""

    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = MLAttention(cfg, layer)  # type: ignore[assignment]
        moe = cfg.moe
        sparse = moe is not None and layer in moe.layers
        mlp: nn.Module = DeepseekMoe(moe, cfg.hidden_size) if moe and sparse else MLP(cfg)
        self.mlp = mlp  # type: ignore[assignment]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope_table = 0
        self.residual_multiplier = 1.0


class DeepseekForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        layers = (DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.layers = nn.ModuleList(layers)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5/4.6: the Llama layers (the config gives their attention its partial rotary,
    per-head q/k norms and q/k/v biases) with DeepSeek's MoE on the sparse layers."""

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        moe = cfg.moe
        for i, layer in enumerate(self.model.layers):
            if moe is not None and i in moe.layers:
                layer.mlp = DeepseekMoe(moe, cfg.hidden_size)


def rope_halves(rows: torch.Tensor, width: int, rope: int) -> torch.Tensor:
    """The rows of a projection (weight [n width, K] or bias [n width]) with the last ``rope``
    rows of each run of ``width`` reordered from rotary pairs (0, 1), (2, 3), ... to halves
    (0, 2, 4, ..., 1, 3, 5, ...): the engine's rotation of the first half with the second then
    turns each pair as the checkpoint's model does; q and k alike leave q . k as it was."""
    nope = width - rope
    order = torch.cat([torch.arange(nope), nope + torch.arange(0, rope, 2),
                       nope + torch.arange(1, rope, 2)])  # fmt: skip
    runs = rows.reshape(-1, width, *rows.shape[1:])  # [n, width, ...]
    return runs[:, order].reshape(rows.shape)


def checkpoint_tensor(mla: MlaConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as this model holds it: the rotary rows of q (``q_proj``,
    ``q_b_proj``: each head's last ``qk_rope_head_dim``) and of ``kv_a_proj_with_mqa`` (its
    last ones) in halves where the checkpoint pairs them."""
    if not mla.rope_pairs:
        return tensor
    rope = mla.qk_rope_head_dim
    if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight")):
        return rope_halves(tensor, mla.qk_head_dim, rope)
    if ".self_attn.kv_a_proj_with_mqa." in name:
        return rope_halves(tensor, mla.kv_lora_rank + rope, rope)
    return tensor
