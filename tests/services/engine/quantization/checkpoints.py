"""Tiny random Llama checkpoints in each quantized on-disk format, written the way the real
quantizers write them (packing done here independently of kernels.quant), each with the float
weights it dequantizes to, for a reference model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

G = 128  # group size (int4) and block size (fp8)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
# which projections read the same input (and so share a GPTQ act-order permutation)
SAME_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
              "mlp.up_proj": "mlp.gate_proj"}  # fmt: skip
Weights = dict[str, torch.Tensor]


# Gemma 3 (model_type="gemma3_text"): a sliding layer with its own rotary base, then a global
# one; the softmax scale from query_pre_attn_scalar; GELU MLP; scaled tied embeddings
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "query_pre_attn_scalar": 24, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
}  # fmt: skip


def tiny_config(**extra: Any) -> dict[str, Any]:
    """K of every projection a multiple of 128 (hidden 128, intermediate 256); k/v shards of
    64 rows, so a 128-row fp8 block straddles no shard but covers half of one."""
    if extra.get("model_type") == "gemma3_text":
        extra = {**GEMMA3, **extra}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
        "eos_token_id": 2, **extra,
    }  # fmt: skip


def random_weights(cfg: dict[str, Any], seed: int = 0) -> Weights:
    gen = torch.Generator().manual_seed(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
              "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}  # fmt: skip
    gemma = cfg["model_type"] == "gemma3_text"
    norms = ["input_layernorm", "post_attention_layernorm"]
    if gemma:  # its norms scale by 1 + weight; q and k normed per head
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    w: Weights = {
        "model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=gen),
        "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
    }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = torch.randn(cfg["vocab_size"], h, generator=gen) / h**0.5
    else:  # the head is the embedding: scaled down so the logits stay moderate
        w["model.embed_tokens.weight"] /= h**0.5
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for norm in norms:
            w[p + norm + ".weight"] = (0 if gemma else 1) + 0.1 * torch.randn(h, generator=gen)
        if gemma:
            for norm in ("q_norm", "k_norm"):
                w[p + f"self_attn.{norm}.weight"] = 0.1 * torch.randn(d, generator=gen)
        for name, (n, k) in shapes.items():
            w[p + name + ".weight"] = torch.randn(n, k, generator=gen) / k**0.5
        if cfg["model_type"] == "qwen2":  # q, k and v have biases
            for name in ("q_proj", "k_proj", "v_proj"):
                n = shapes[f"self_attn.{name}"][0]
                w[p + f"self_attn.{name}.bias"] = 0.1 * torch.randn(n, generator=gen)
    return w


def linear_names(weights: Weights) -> list[str]:
    """``model.layers.L.self_attn.q_proj`` etc.: the layers that get quantized."""
    return [n.removesuffix(".weight") for n in weights if n.endswith(LINEARS_SUFFIXES)]


LINEARS_SUFFIXES = tuple(f"{name}.weight" for name in LINEARS)


def write(path: Path, cfg: dict[str, Any], tensors: Weights) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    """int64 holding 32 bits -> int32 with the same bits (what the int32 packers store)."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


# --- fp8 ---------------------------------------------------------------------------------------


def fp8_block(w: torch.Tensor, b: int = G) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """b x b blocks (the last ones partial), scale_inv = amax / 448 per block (what HF's FP8
    quantizer stores): (e4m3, [ceil(N / b), ceil(K / b)] weight_scale_inv, the dequantized
    float32)."""
    n, k = w.shape
    bn, bk = -(-n // b), -(-k // b)
    scale = torch.empty(bn, bk)
    deq = torch.empty(n, k)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for r in range(bn):
        for c in range(bk):
            block = w[r * b : (r + 1) * b, c * b : (c + 1) * b]
            s = block.abs().max() / 448.0
            qb = (block / s).to(torch.float8_e4m3fn)
            scale[r, c] = s
            q[r * b : (r + 1) * b, c * b : (c + 1) * b] = qb
            deq[r * b : (r + 1) * b, c * b : (c + 1) * b] = qb.float() * s
    return q, scale, deq


def fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, scale, q.float() * scale


def fp8_checkpoint(path: Path, scheme: str, seed: int = 0, **extra: Any) -> tuple[Path, Weights]:
    """scheme: "block" (HF fp8, 128x128 weight_scale_inv), "channel" (compressed-tensors
    FP8_DYNAMIC, weight_scale [N, 1]) or "tensor" (fp8 without blocks, one weight_scale each)."""
    cfg = tiny_config(torch_dtype="bfloat16", **extra)
    w = random_weights(cfg, seed)
    tensors, deq = dict(w), dict(w)
    for name in linear_names(w):
        weight = w[name + ".weight"]
        if scheme == "tensor":
            scale = weight.abs().max() / 448.0  # a 0-dim tensor
            q = (weight / scale).to(torch.float8_e4m3fn)
            deq[name + ".weight"] = q.float() * scale
        else:
            q, scale, deq[name + ".weight"] = (fp8_block if scheme == "block" else fp8_channel)(
                weight
            )
        tensors[name + ".weight"] = q
        tensors[name + (".weight_scale_inv" if scheme == "block" else ".weight_scale")] = scale
    if scheme == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "fmt": "e4m3", "weight_block_size": [G, G]}  # fmt: skip
    elif scheme == "tensor":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    else:  # compressed-tensors, as llm-compressor writes FP8_DYNAMIC
        scheme_cfg = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                  "symmetric": True, "dynamic": False},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                            "symmetric": True, "dynamic": True},
                      "targets": ["Linear"]}  # fmt: skip
        cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                      "format": "float-quantized", "ignore": ["lm_head"],
                                      "config_groups": {"group_0": scheme_cfg}}  # fmt: skip
    return write(path, cfg, tensors), deq


# --- int4 --------------------------------------------------------------------------------------


def int4_groups(
    wt: torch.Tensor, g_idx: torch.Tensor, sym: bool, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``wt [K, N]`` (input rows first) -> (q [K, N], zeros [K/G, N], fp16 scales [K/G, N],
    dequantized [K, N]); row k in group g_idx[k]. Asymmetric: min/max over 15 steps (AWQ);
    symmetric: zero point 8 (GPTQ sym)."""
    k, n = wt.shape
    groups = k // group
    zeros = torch.empty(groups, n, dtype=torch.int64)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        rows = wt[g_idx == g]
        if sym:
            s = (2 * rows.abs().amax(0) / 15).clamp(min=1e-5)
            z = torch.full((n,), 8)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-5)
            z = (-lo / s).round().clamp(0, 15).long()
        scales[g], zeros[g] = s.half(), z
    s_rows, z_rows = scales[g_idx].float(), zeros[g_idx]
    q = ((wt / s_rows).round() + z_rows).clamp(0, 15).long()
    return q, zeros, scales, (q - z_rows).float() * s_rows


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """[R, C] -> [R, C/8] int32: nibble i of each int32 holds column [0,2,4,6,1,3,5,7][i] of its
    eight (AutoAWQ's GEMM packing)."""
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
        out |= q[:, col::8] << (4 * i)
    return _to_int32(out)


def gptq_pack_rows(q: torch.Tensor) -> torch.Tensor:  # [K, N] -> [K/8, N]: row 8r+i in nibble i
    out = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for i in range(8):
        out |= q[i::8, :] << (4 * i)
    return _to_int32(out)


def gptq_pack_cols(z: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C/8]: column 8c+i in nibble i
    out = torch.zeros(z.shape[0], z.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        out |= (z[:, i::8] & 0xF) << (4 * i)
    return _to_int32(out)


def int4_pieces(
    method: str, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> Weights:
    """One projection's ``int4_groups`` output as its checkpoint stores it (``qweight``,
    ``qzeros``, ``scales``; GPTQ's ``g_idx``), keyed by piece."""
    if method == "awq":
        return {"qweight": awq_pack(q), "qzeros": awq_pack(zeros), "scales": scales}
    return {"qweight": gptq_pack_rows(q), "scales": scales,
            "qzeros": gptq_pack_cols(zeros - 1),  # v1: zero points minus one
            "g_idx": g_idx.to(torch.int32)}  # fmt: skip


def int4_quant_config(method: str, group: int, desc_act: bool = False) -> dict[str, Any]:
    """The quantization_config AutoAWQ (GEMM) or AutoGPTQ (v1, symmetric) writes."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
            "sym": True, "checkpoint_format": "gptq"}  # fmt: skip


def int4_checkpoint(
    path: Path, method: str, desc_act: bool = False, group: int = G, seed: int = 0,
    **extra: Any,
) -> tuple[Path, Weights]:  # fmt: skip
    cfg = tiny_config(torch_dtype="float16", **extra)
    w = random_weights(cfg, seed)
    tensors = {n: t for n, t in w.items() if not n.endswith(LINEARS_SUFFIXES)}
    deq = dict(w)
    gen = torch.Generator().manual_seed(seed + 1)
    perms: dict[str, torch.Tensor] = {}
    for name in linear_names(w):
        wt = w[name + ".weight"].T.contiguous()  # [K, N]
        k = wt.shape[0]
        layer, proj = name.rsplit(".", 2)[0], name.split(".", 3)[3]
        key = layer + "." + SAME_INPUT.get(proj, proj)
        if desc_act:  # act-order: groups follow a permutation of the input rows
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group
        else:
            g_idx = torch.arange(k) // group
        q, zeros, scales, wt_deq = int4_groups(wt, g_idx, method == "gptq", group)
        deq[name + ".weight"] = wt_deq.T.contiguous()
        for piece, t in int4_pieces(method, q, zeros, scales, g_idx).items():
            tensors[f"{name}.{piece}"] = t
    cfg["quantization_config"] = int4_quant_config(method, group, desc_act)
    return write(path, cfg, tensors), deq


def float_checkpoint(path: Path, weights: Weights, like: Path | None = None) -> Path:
    """The reference: the model of ``like`` (default: the tiny Llama) with these float32
    weights (the dequantized ones) and no quantization_config."""
    cfg = json.loads((like / "config.json").read_text()) if like else tiny_config()
    cfg.pop("quantization_config", None)
    return write(path, {**cfg, "torch_dtype": "float32"}, weights)


# --- Mixture-of-Experts ------------------------------------------------------------------------

# tiny MoE models with 128-wide projections (whole fp8 blocks and int4 groups): Qwen3-MoE with
# layer 1 dense (a quantized dense MLP beside the experts), Mixtral sparse everywhere
MOE = {
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "moe_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "mlp_only_layers": [1]},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2},
    # its shared expert (a dense MLP beside the experts, quantized as one) and the sigmoid gate
    # on it (float, as the quantizers leave it), q/k/v biases
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                  "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
                  "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False},
}  # fmt: skip
# the checkpoint's names of an expert's gate, up and down projections
_EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}  # fmt: skip
_SAME_INPUT_PROJ = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}


def moe_weights(cfg: dict[str, Any], seed: int = 0) -> Weights:
    """The tiny Llama's weights with each sparse layer's MLP replaced by a router and experts
    (under the family's names), and Qwen3's per-head q/k norms."""
    w = random_weights(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    block, gate, up, down = _EXPERT_NAMES[cfg["model_type"]]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        if cfg["model_type"] == "qwen3_moe":
            for norm in ("q_norm", "k_norm"):
                w[p + f"self_attn.{norm}.weight"] = 1 + 0.1 * torch.randn(d, generator=gen)
        if cfg["model_type"] == "qwen2_moe":
            for proj in ("q_proj", "k_proj", "v_proj"):
                rows = w[p + f"self_attn.{proj}.weight"].shape[0]
                w[p + f"self_attn.{proj}.bias"] = 0.1 * torch.randn(rows, generator=gen)
        if layer in cfg.get("mlp_only_layers", []):
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del w[p + f"mlp.{proj}.weight"]
        w[p + f"{block}.gate.weight"] = torch.randn(experts, h, generator=gen) / h**0.5
        for e in range(experts):
            x = p + f"{block}.experts.{e}."
            w[x + f"{gate}.weight"] = torch.randn(inter, h, generator=gen) / h**0.5
            w[x + f"{up}.weight"] = torch.randn(inter, h, generator=gen) / h**0.5
            w[x + f"{down}.weight"] = torch.randn(h, inter, generator=gen) / inter**0.5
        if shared := cfg.get("shared_expert_intermediate_size", 0):
            x = p + f"{block}.shared_expert."
            w[x + "gate_proj.weight"] = torch.randn(shared, h, generator=gen) / h**0.5
            w[x + "up_proj.weight"] = torch.randn(shared, h, generator=gen) / h**0.5
            w[x + "down_proj.weight"] = torch.randn(h, shared, generator=gen) / shared**0.5
            w[p + f"{block}.shared_expert_gate.weight"] = torch.randn(1, h, generator=gen) / h**0.5
    return w


def moe_linears(weights: Weights) -> list[str]:
    """Every projection a quantizer converts: attention, dense MLP and experts (not the router,
    the embeddings, lm_head or the norms)."""
    names = [n.removesuffix(".weight") for n in weights if n.endswith(".weight")]
    return [n for n in names if n.endswith(("_proj", ".w1", ".w2", ".w3"))]


def moe_checkpoint(
    path: Path, family: str, method: str, seed: int = 0, unquantized: tuple[str, ...] = (),
    config: dict[str, Any] | None = None,
) -> tuple[Path, Weights]:  # fmt: skip
    """A tiny ``family`` MoE checkpoint in ``method``'s format ("fp8-block", "fp8-channel" as
    compressed-tensors, "awq", "gptq", "gptq-act-order" in groups of 32, so that the order
    matters), with the float weights it dequantizes to; the projections named in ``unquantized`` stored as they are (and listed in the
    config, as the quantizers list them); ``config`` overrides the tiny model's shapes."""
    cfg = tiny_config(**{**MOE[family], **(config or {})})
    w = moe_weights(cfg, seed)
    tensors, deq = dict(w), dict(w)
    kind = method.split("-")[0]
    gen = torch.Generator().manual_seed(seed + 1)
    perms: dict[str, torch.Tensor] = {}
    group = 32 if method == "gptq-act-order" else G
    for name in moe_linears(w):
        if any(n in name for n in unquantized):
            continue
        weight = tensors.pop(name + ".weight")
        if kind == "fp8":
            blocks = method == "fp8-block"
            q, scale, deq[name + ".weight"] = (fp8_block if blocks else fp8_channel)(weight)
            tensors[name + ".weight"] = q
            tensors[name + (".weight_scale_inv" if blocks else ".weight_scale")] = scale
            continue
        wt = weight.T.contiguous()  # [K, N]
        k = wt.shape[0]
        g_idx = torch.arange(k) // group
        if method == "gptq-act-order":  # q/k/v and gate/up share their input's permutation
            parent, last = name.rsplit(".", 1)
            key = f"{parent}.{_SAME_INPUT_PROJ.get(last, last)}"
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group
        q, zeros, scales, wt_deq = int4_groups(wt, g_idx, kind == "gptq", group)
        deq[name + ".weight"] = wt_deq.T.contiguous()
        for piece, t in int4_pieces(kind, q, zeros, scales, g_idx).items():
            tensors[f"{name}.{piece}"] = t
    cfg["quantization_config"] = _moe_quant_config(method, list(unquantized), group)
    cfg["torch_dtype"] = "bfloat16" if kind == "fp8" else "float16"
    return write(path, cfg, tensors), deq


def _moe_quant_config(method: str, unquantized: list[str], group: int) -> dict[str, Any]:
    if method == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [G, G], "modules_to_not_convert": unquantized}  # fmt: skip
    if method == "fp8-channel":  # llm-compressor's FP8_DYNAMIC, the router left out by regex
        scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                        "dynamic": True}, "targets": ["Linear"]}  # fmt: skip
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "ignore": ["lm_head", "re:.*mlp.gate$", *unquantized],
                "config_groups": {"group_0": scheme}}  # fmt: skip
    if method == "awq":
        return {**int4_quant_config("awq", G), "modules_to_not_convert": ["gate", *unquantized]}
    gptq = int4_quant_config("gptq", group, method == "gptq-act-order")
    return {**gptq, "modules_to_not_convert": unquantized} if unquantized else gptq


# --- compressed-tensors int4 (pack-quantized) ----------------------------------------------------


def ct_int4_scheme(group: int | None = G, sym: bool = True, actorder: str | None = None) -> dict[str, Any]:  # fmt: skip
    """llm-compressor's W4A16 (``sym``) or W4A16_ASYM config group, in groups of ``group``
    (None: per channel); ``actorder`` as older releases wrote it ("group" stores weight_g_idx),
    as compressed-tensors serializes it."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, **strategy)  # type: ignore[arg-type]
    scheme = QuantizationScheme(targets=["Linear"], weights=args).model_dump(mode="json")
    if actorder is not None:  # 0.20 refuses "group" (removed), which older checkpoints hold
        scheme["weights"]["actorder"] = actorder
    return scheme


def ct_int4_config(scheme: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    """The quantization_config llm-compressor saves: compressed-tensors' QuantizationConfig as
    the library dumps it, holding ``scheme``."""
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={}, format="pack-quantized", ignore=ignore,
                                quantization_status="compressed").model_dump(mode="json")  # fmt: skip
    return {**config, "config_groups": {"group_0": scheme}}


def ct_int4_pieces(
    w: torch.Tensor, group: int | None, sym: bool, g_idx: torch.Tensor | None = None
) -> tuple[Weights, torch.Tensor]:
    """One float weight ``[N, K]`` quantized (``int4_groups``: zero points 8 when symmetric) and
    stored as compressed-tensors' pack-quantized format, packed by the library itself
    (``pack_to_int32``: signed values plus 8, eight a word along K; asymmetric zero points eight
    a word along N): (pieces, the dequantized ``[N, K]``)."""
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    n, k = w.shape
    g = group or k
    order = torch.arange(k) // g if g_idx is None else g_idx
    q, zeros, scales, deq = int4_groups(w.T.contiguous(), order, sym, g)  # [K, N], [K/G, N]
    pieces = {
        "weight_packed": pack_to_int32((q - 8).T.contiguous().to(torch.int8), 4),
        "weight_scale": scales.T.contiguous(),
        "weight_shape": torch.tensor([n, k]),
    }
    if not sym:
        pieces["weight_zero_point"] = pack_to_int32((zeros - 8).T.to(torch.int8), 4, packed_dim=0)
    if g_idx is not None:
        pieces["weight_g_idx"] = g_idx.to(torch.int32)
    return pieces, deq.T.contiguous()


def ct_int4_checkpoint(
    path: Path, group: int | None = G, sym: bool = True, actorder: str | None = None,
    seed: int = 0, moe: str | None = None, **extra: Any,
) -> tuple[Path, Weights]:  # fmt: skip
    """A tiny Llama (or ``moe`` family's) checkpoint as llm-compressor writes W4A16 ("group"
    actorder: each input's groups follow a permutation, stored as weight_g_idx), with the float
    weights it dequantizes to; lm_head, and an MoE's router, in its ignore list."""
    cfg = tiny_config(torch_dtype="float16", **{**(MOE[moe] if moe else {}), **extra})
    w = moe_weights(cfg, seed) if moe else random_weights(cfg, seed)
    names = moe_linears(w) if moe else linear_names(w)
    tensors, deq = dict(w), dict(w)
    gen = torch.Generator().manual_seed(seed + 1)
    perms: dict[str, torch.Tensor] = {}
    for name in names:
        weight = tensors.pop(name + ".weight")
        g_idx = None
        if actorder == "group":  # the projections of one input share its permutation
            parent, last = name.rsplit(".", 1)
            key = f"{parent}.{_SAME_INPUT_PROJ.get(last, last)}"
            perm = perms.setdefault(key, torch.randperm(weight.shape[1], generator=gen))
            g_idx = torch.empty(weight.shape[1], dtype=torch.int64)
            g_idx[perm] = torch.arange(weight.shape[1]) // (group or weight.shape[1])
        pieces, deq[name + ".weight"] = ct_int4_pieces(weight, group, sym, g_idx)
        tensors.update({f"{name}.{piece}": t for piece, t in pieces.items()})
    ignore = ["lm_head", *(["re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"] if moe else [])]
    cfg["quantization_config"] = ct_int4_config(ct_int4_scheme(group, sym, actorder), ignore)
    return write(path, cfg, tensors), deq


# --- DeepSeek ----------------------------------------------------------------------------------

# tiny DeepSeek-V2/V3 and GLM-4.5 (first layer dense, then experts with a shared one); with FP8
# blocks of 32 every projection spans several, some partial (kv_lora_rank 24, kv_a's 24 + 8
# rows, V2's 96 q rows); blocks of 16 cut every rank's part of 2 ranks on whole blocks (its 2
# heads' 48 q rows, 32 kv_b rows and 32 o_proj columns; 16 rows of each expert and shared one)
DEEPSEEK = {
    "vocab_size": 49152, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
    "intermediate_size": 96, "moe_intermediate_size": 32, "kv_lora_rank": 24,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 2,
    "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "bos_token_id": None,
    "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip
DEEPSEEK_TYPES = {
    "deepseek_v3": {"q_lora_rank": 32, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    "deepseek_v2": {"q_lora_rank": None, "topk_method": "group_limited_greedy"},
    "glm4_moe": {"head_dim": 16, "num_key_value_heads": 2, "use_qk_norm": True,
                 "attention_bias": True},
}  # fmt: skip
# int4 (AWQ, GPTQ) in groups of 32 (the smallest the engine takes): kv_b_proj's input (the
# latent rank) a whole group, and each of 2 ranks' dense MLP, shared and routed experts' rows
# (64, 32 and 32) whole groups of their down projections' input
DEEPSEEK_INT4 = {"kv_lora_rank": 32, "intermediate_size": 128, "moe_intermediate_size": 64}
_DEEPSEEK_QUANTIZED = re.compile(r"(_proj|_proj_with_mqa)\.weight$")


def deepseek_checkpoints(
    root: Path, model_type: str, block: int = 32, fmt: str = "fp8"
) -> tuple[Path, Path]:
    """A tiny random transformers checkpoint of ``model_type`` quantized as real DeepSeek ones
    are (every projection, the router and norms as they are): ``fmt`` "fp8" is DeepSeek-V3's
    format (``block`` x ``block`` blocks), "awq" AutoAWQ's GEMM packing and "gptq" AutoGPTQ's
    (without act-order; "gptq-act-order" with, each input's groups following a permutation of
    its own), both in groups of ``block`` and the shapes of ``DEEPSEEK_INT4``; and the float32
    one of its dequantized weights; the test tokenizer in both."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.services.engine.conftest import save_test_tokenizer

    torch.manual_seed(0)
    shapes = {**DEEPSEEK, **DEEPSEEK_TYPES[model_type], **(DEEPSEEK_INT4 if fmt != "fp8" else {})}
    cfg = AutoConfig.for_model(model_type, **shapes)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(root / "hf")
    weights = load_file(str(root / "hf" / "model.safetensors"))
    config = json.loads((root / "hf" / "config.json").read_text())
    tensors, deq = dict(weights), dict(weights)
    kind, act_order = fmt.split("-")[0], fmt == "gptq-act-order"
    gen = torch.Generator().manual_seed(1)
    perms: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if not _DEEPSEEK_QUANTIZED.search(name) or name.startswith("lm_head"):
            continue
        module = name.removesuffix(".weight")
        if fmt == "fp8":
            q, scale, deq[name] = fp8_block(w, block)
            tensors[name] = q
            tensors[module + ".weight_scale_inv"] = scale
            continue
        del tensors[name]
        k = w.shape[1]
        g_idx = torch.arange(k) // block
        if act_order:  # gate and up (stacked) share their input's permutation
            key = module.replace(".up_proj", ".gate_proj")
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // block
        q, zeros, scales, wt_deq = int4_groups(w.T.contiguous(), g_idx, kind == "gptq", block)
        deq[name] = wt_deq.T.contiguous()
        for piece, t in int4_pieces(kind, q, zeros, scales, g_idx).items():
            tensors[f"{module}.{piece}"] = t
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "fmt": "e4m3", "weight_block_size": [block, block]}  # fmt: skip
    else:
        config["quantization_config"] = int4_quant_config(kind, block, act_order)
    dtype = "bfloat16" if fmt == "fp8" else "float16"
    quantized = write(root / fmt, {**config, "torch_dtype": dtype}, tensors)
    ref = float_checkpoint(root / "ref", deq, quantized)
    for path in (quantized, ref):
        save_test_tokenizer(path)
    return quantized, ref
