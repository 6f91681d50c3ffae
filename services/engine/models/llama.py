"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) in plain PyTorch over a paged KV cache,
and its Mixture-of-Experts variants (Qwen3-MoE, Mixtral): the same layers with a sparse MLP.

Tokens of all sequences in a step are flattened into one ``[T]`` batch; attention finds each
sequence's context through the metadata's block tables. Optimizations (CUDA graphs, Triton
kernels) are applied from outside through ``kernels.ops``; quantization replaces the ``Linear``
modules after the model is built (``services.engine.quantization``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels import ops
from services.engine.attention_metadata import AttentionMetadata
from services.engine.model_config import ArchConfig, scaling_kind
from services.engine.models.moe import SparseMoeBlock
from services.engine.rope import cos_sin_cache, longrope_tables


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Linear(nn.Linear):
    # its weight is also read as a tensor elsewhere: it keeps the dense layout (no oneDNN one
    # on the CPU, kernels/cpu_linear.py)
    keep_dense_weight = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return ops.linear(x, self.weight, self.bias)

    def fused_act(
        self, act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor | None:
        """``act(self(x))`` in one kernel where one exists (``ops.linear_act``): SiLU-and-mul
        of a gate_up projection at batch 1. None for a subclass with its own ``forward``."""
        if act is not ops.silu_and_mul or type(self).forward is not Linear.forward:
            return None
        return ops.silu_and_mul_linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nq, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, (self.nq + 2 * self.nkv) * self.d, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.nq * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        # per head (Qwen3's), or over the whole projection (OLMo 2's: qk_norm_whole)
        self.qk_norm_whole = cfg.qk_norm_whole
        whole = self.qk_norm_whole
        q_width, k_width = (self.nq * self.d, self.nkv * self.d) if whole else (self.d, self.d)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip = cfg.clip_qkv  # OLMoE's: q, k and v clamped to +-clip; 0: not clipped
        self.scale = cfg.attention_multiplier or self.d**-0.5  # Granite's: its own
        self.window = cfg.window(layer)  # a sliding window's keys (Mistral v0.1); 0: all
        self.softcap = 0.0  # scores soft-capped to (-softcap, softcap) (Gemma 2); 0: none
        # gpt-oss's sinks: a learned logit per query head in every softmax, its value zero
        self.sinks = nn.Parameter(torch.empty(self.nq)) if cfg.attention_sinks else None
        # an FP8 KV cache holds k / k_scale and v / v_scale (--kv-cache-dtype fp8: 1.0, as vLLM
        # without calibrated scales); reading multiplies them back, folded into the softmax scale
        # and the output. A 16-bit cache ignores them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [max_pos, R]: R = D but for partial rotary
        kv_cache: torch.Tensor,  # [2, N, bs, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q = q.reshape(T, self.nq, self.d)
        k = k.reshape(T, self.nkv, self.d)
        v = v.reshape(T, self.nkv, self.d)
        if self.q_norm is not None and self.k_norm is not None:
            rows = (T, -1) if self.qk_norm_whole else (-1, self.d)  # [T, H D] or [T H, D]
            q = self.q_norm(q.reshape(rows))[0].view(T, self.nq, self.d)
            k = self.k_norm(k.reshape(rows))[0].view(T, self.nkv, self.d)
        if self.clip:  # after the norms, as transformers' OLMoE
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        scaled = k_cache.element_size() == 1  # FP8: the scales apply
        # whole prompts on a GPU (no cached prefix in the step, enough of them) read their own
        # keys and values contiguously, not through the block table: 91% of SDPA's rate against
        # 74% on an H200 (docs/benchmarks.md, W3); an FP8 cache's rounding must be what attention
        # sees, so it reads them from the cache
        k_new = None
        whole = meta.prefill_no_prefix and T - meta.num_decodes >= ops.NEW_KV_MIN_TOKENS
        if ops.reads_new_kv(x.device) and whole and k_cache.dtype == q.dtype:
            k_new = torch.empty((T, self.nkv, self.d), dtype=k.dtype, device=k.device)
        # one launch: rotate q (into a new tensor) and k, write k and v into their slots
        q = ops.rotary_write_kv(
            positions, q, k, v, cos_sin, k_cache, v_cache, meta.slot_mapping,
            self.k_scale, self.v_scale, k_out=k_new, memo=meta.memo,
        )  # fmt: skip
        if meta.on_kv_written is not None:  # this layer's KV can leave now (a prefill hand-off)
            meta.on_kv_written(self.layer)
        scale = self.scale * (self.k_scale if scaled else 1)
        o = paged_attention(
            q, k_cache, v_cache, meta, scale, k_new, v if k_new is not None else None,
            self.window, self.softcap, self.sinks,
        )  # fmt: skip
        if scaled and self.v_scale != 1.0:
            o = o * self.v_scale
        return self.o_proj(o.reshape(T, self.nq * self.d))  # [T, hidden]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D], decode rows first
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_new: torch.Tensor | None = None,  # [T, Hkv, D]: every row's rotated key (prefill reads)
    v_new: torch.Tensor | None = None,  # [T, Hkv, D]
    window: int = 0,  # keys each query sees, itself included (a sliding window); 0: all
    softcap: float = 0.0,  # scores soft-capped (Gemma 2's attn_logit_softcapping); 0: none
    sinks: torch.Tensor | None = None,  # [Hq]: a logit per head in each softmax (gpt-oss)
) -> torch.Tensor:  # [T, Hq, D]
    """Decode rows through the decode kernel, prefill rows through the prefill kernel (which
    reads the chunks' own keys and values from ``k_new``/``v_new`` when given)."""
    nd = meta.num_decodes
    if meta.decode_only:
        return ops.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window=window,
            softcap=softcap, sinks=sinks, memo=meta.memo,
        )  # fmt: skip
    spans = meta.span_last  # Gemma 3's image tokens: bidirectional within each image
    if nd == 0:
        return ops.prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
            scale, k_new=k_new, v_new=v_new, no_prefix=k_new is not None, window=window,
            softcap=softcap, sinks=sinks, span_last=spans,
        )  # fmt: skip
    assert meta.prefill_start_loc is not None
    o = torch.empty_like(q)
    # the decode rows' tables and lengths: the same views for every layer, so that the memo
    # knows them again
    tables, lens = meta.memo.get(
        ("decode_rows", nd), (meta.block_tables, meta.context_lens),
        lambda: (meta.block_tables[:nd], meta.context_lens[:nd]),
    )  # fmt: skip
    ops.paged_decode_attention(
        q[:nd], k_cache, v_cache, tables, lens, scale, out=o[:nd], window=window,
        softcap=softcap, sinks=sinks, memo=meta.memo,
    )  # fmt: skip
    ops.prefill_attention(
        q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.prefill_start_loc,
        meta.context_lens[nd:], scale, out=o[nd:],
        k_new=k_new[nd:] if k_new is not None else None,
        v_new=v_new[nd:] if v_new is not None else None, no_prefix=k_new is not None,
        window=window, softcap=softcap, sinks=sinks,
        span_last=spans[nd:] if spans is not None else None,
    )  # fmt: skip
    return o


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = ops.silu_and_mul  # [T, 2I] -> [T, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # act_fn(gate_up_proj(x)): [T, 2I] -> [T, I], one kernel where the layer has one
        return self.down_proj(ops.linear_act(self.gate_up_proj, self.act_fn, x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        moe = cfg.moe  # a sparse MLP on the layers it names, the dense one elsewhere
        self.mlp = SparseMoeBlock(moe, cfg.hidden_size) if moe and layer in moe.layers else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope_table = 0  # which of the model's rotary tables (rope_tables) it rotates by
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1 for the others

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta)
        if self.residual_multiplier != 1.0:  # each branch scaled before it joins the stream
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    cos_sin: torch.Tensor  # a buffer (register_buffer), which nn.Module types as Tensor | Module

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the rotary table, [max_positions, rotary_dim]: the loader fills it (fill_rope)
        table = torch.empty(max_positions, cfg.rotary_dim, dtype=torch.float32)
        self.register_buffer("cos_sin", table, persistent=False)
        self.cos_sin_nope: torch.Tensor | None = None  # SmolLM3's NoPE layers': no rotation
        # LongRoPE (Phi-3.5, Phi-4-mini): cos_sin holds two tables of this many rows each, the
        # first short below the original length and long from it, the second long throughout;
        # a request whose prompt is longer than the original length has its positions moved
        # by this (its ``position_offset``) into the second. 0: one table.
        self.long_rope_offset = 0
        for i in cfg.nope_layers:
            layer: DecoderLayer = self.model.layers[i]  # type: ignore[assignment]
            layer.rope_table = 1

    def fill_rope(self, max_positions: int, device: torch.device) -> None:
        """The rotary tables' rows for positions below ``max_positions`` (the loader, once the
        model is on ``device``)."""
        cfg = self.cfg
        rope = (cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                cfg.max_position_embeddings)  # fmt: skip
        if scaling_kind(cfg.rope_scaling) == "longrope":  # both of its tables, one buffer
            table, self.long_rope_offset = torch.cat(longrope_tables(*rope)), max_positions
        else:
            table = cos_sin_cache(*rope)
        self.cos_sin = table.to(device)
        if cfg.nope_layers:  # cos 1, sin 0: the rotation that leaves q and k as they are
            nope = torch.zeros_like(table)
            nope[:, : cfg.rotary_dim // 2] = 1.0
            self.cos_sin_nope = nope.to(device)

    def trim_rope(self, positions: int) -> None:
        """Only the rows of the positions this worker can reach, not the 128k it was built for."""
        if self.long_rope_offset:  # both tables' first rows
            start = self.long_rope_offset
            rows = torch.cat([self.cos_sin[:positions], self.cos_sin[start : start + positions]])
            self.cos_sin, self.long_rope_offset = rows, positions
        else:
            self.cos_sin = self.cos_sin[:positions].clone()
        if self.cos_sin_nope is not None:
            self.cos_sin_nope = self.cos_sin_nope[:positions].clone()

    def rope_tables(self) -> tuple[torch.Tensor, ...]:
        """The rotary tables; a decoder layer's ``rope_table`` indexes them."""
        if self.cos_sin_nope is not None:
            return (self.cos_sin, self.cos_sin_nope)
        return (self.cos_sin,)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        x = self.model.embed_tokens(input_ids)
        if self.cfg.embedding_multiplier != 1.0:  # Granite
            x = x * self.cfg.embedding_multiplier
        return x

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope_table: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """``embeds``: (rows [n], values [n, hidden]) that replace those rows' token embeddings
        (an image's); values [n, hidden * (1 + k)] carry k DeepStack levels after them (Qwen3-VL),
        added to those rows' hidden states after decoder layers 0 .. k-1. ``rope_table``: each
        token's own cos/sin row [T, D] (M-RoPE)."""
        x = self.embed(input_ids)
        deepstack = None
        if embeds is not None:
            rows = embeds[0]
            values = embeds[1].to(x.dtype).reshape(rows.shape[0], -1, x.shape[1])  # [n, 1 + k, h]
            x[rows] = values[:, 0]
            deepstack = values[:, 1:]  # [n, k, hidden]
        residual: torch.Tensor | None = None
        rope_pos, tables = positions, self.rope_tables()
        if rope_table is not None or not input_ids.is_cuda:
            # gather cos/sin once per step, not once per layer: [T, D] rows
            tables = (
                (rope_table,) if rope_table is not None else tuple(t[positions] for t in tables)
            )
            rope_pos = torch.arange(positions.shape[0], device=positions.device)
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            table = tables[layer.rope_table]  # type: ignore[index]
            x, residual = layer(x, residual, rope_pos, table, cache, meta)
            if deepstack is not None and i < deepstack.shape[1]:
                x.index_add_(0, rows, deepstack[:, i])  # the residual stream is x + residual
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, V] fp32
        logits = self.lm_head(hidden)
        if self.cfg.logits_scaling != 1.0:  # Granite: in the model's dtype, as transformers
            logits = logits / self.cfg.logits_scaling
        return logits.float()
