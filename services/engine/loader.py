"""Build a model and fill its weights: HF safetensors (sharded or not), GGUF (via a cached
conversion), or random weights from a config (``--load-format dummy``)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kernels import ops
from services.config import ConfigError, ModelConfig
from services.engine.gpt_oss_weights import gpt_oss_tensors
from services.engine.model_config import (
    FUSED_CHECKPOINT_TYPES,
    VISION_TOWERS,
    ArchConfig,
    gemma3_name,
    language_model_name,
    mistral3_name,
)
from services.engine.models.cohere import CohereForCausalLM
from services.engine.models.deepseek import (
    DeepseekForCausalLM,
    Glm4MoeForCausalLM,
    checkpoint_tensor,
)
from services.engine.models.gemma3 import Gemma3ForCausalLM
from services.engine.models.gemma3_vision import Gemma3VLForCausalLM
from services.engine.models.glm4 import Glm4ForCausalLM
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.mistral3 import Mistral3ForCausalLM
from services.engine.models.olmo2 import Olmo2ForCausalLM
from services.engine.models.qwen2_vl import Qwen2VLForCausalLM
from services.engine.models.qwen3_vl import Qwen3VLForCausalLM
from services.engine.models.starcoder2 import ArceeForCausalLM, Starcoder2ForCausalLM
from services.engine.quantization import (
    QuantConfig,
    QuantLinear,
    dummy_quantized,
    fuse_fp8_inputs,
    quantize_loaded,
    quantize_model,
    quantized_modules,
    resolve_quantization,
)
from services.engine.quantization.apply import expert_modules, held_expert_layers
from services.engine.quantization.experts import ExpertDequantizer, describe_held
from services.engine.rope import halves_from_pairs
from services.engine.tp_group import TPGroup
from services.engine.tp_layers import apply_tp
from services.engine.tp_layout import TPLayout
from services.model_files import ModelFiles, prepare_model

_STACKED = {  # HF name piece -> (our fused parameter, shard index)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
# one expert's tensor (Qwen3-MoE's names, or Mixtral's w1/w3/w2 once block_sparse_moe is mlp):
# its weight, or an FP8 checkpoint's scales of it (experts held in FP8), or an int4 one's
# packed weight, scales, zeros and act-order permutation (converted by quantization.experts:
# experts held int4)
_EXPERT = re.compile(
    r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.(weight|weight_scale_inv|weight_scale|weight_zeros|weight_perm)$"
)
_EXPERT_SUFFIX = {"weight_zeros": "_zeros", "weight_perm": "_perm"}  # else: scales
_EXPERT_PIECES = {  # -> (our stacked parameter, shard of its rows; None: all of them)
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}

# Granite MoE's names, once block_sparse_moe is mlp: its experts stored stacked ([E, 2I, H],
# gate rows then up rows; [E, H, I]) as our parameters are, its shared MLP's gate and up as one
_GRANITE_MOE_NAMES = (
    (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
    (".mlp.router.layer.weight", ".mlp.gate.weight"),
    (".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj."),
    (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."),
)
_STACKED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# ERNIE 4.5 MoE's names: its shared experts (one MLP), its correction bias ([1, E] as the
# checkpoint holds it; transformers 5's own name has the router in it)
_ERNIE_MOE_NAMES = (
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.gate.moe_statics.e_score_correction_bias", ".mlp.e_score_correction_bias"),
    (".mlp.moe_statics.e_score_correction_bias", ".mlp.e_score_correction_bias"),
)

log = logging.getLogger(__name__)

# the families built on the Llama layers with their own layer (or model) class
_FAMILY_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "olmo2": Olmo2ForCausalLM,
    "olmo3": Olmo2ForCausalLM,
    "glm4": Glm4ForCausalLM,
    "starcoder2": Starcoder2ForCausalLM,
    "cohere": CohereForCausalLM,
    "exaone4": Olmo2ForCausalLM,
    "arcee": ArceeForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: ModelConfig, arch: ArchConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    return (
        torch.bfloat16
        if arch.torch_dtype in ("float32", "bfloat16")
        else DTYPES.get(arch.torch_dtype, torch.bfloat16)
    )


def _shard_sizes(arch: ArchConfig, fused: str) -> list[int]:
    if fused == "qkv_proj":
        return [
            arch.num_heads * arch.head_dim,
            arch.num_kv_heads * arch.head_dim,
            arch.num_kv_heads * arch.head_dim,
        ]
    return [arch.intermediate_size, arch.intermediate_size]


@contextlib.contextmanager
def _checkpoint_file(file: Path) -> Iterator[Any]:
    """``safe_open`` of one weights file; a file safetensors cannot read (truncated by an
    interrupted download or copy, or no safetensors at all) is a ConfigError that names it."""
    try:
        with safe_open(str(file), framework="pt") as fh:
            yield fh
    except SafetensorError as e:
        raise ConfigError(
            f"{file} is not a readable safetensors file ({e}): was its download or copy "
            "interrupted? Fetch the checkpoint's files again"
        ) from None


def iter_safetensors(
    directory: Path, layout: TPLayout | None = None, language_only: bool = False,
    rename: Callable[[str], str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """Every tensor of the checkpoint; with a tensor-parallel ``layout``, only the rank's slice
    of each, read from the file as a slice (the whole tensor never exists in this process).
    ``language_only``: a multimodal checkpoint's language model, by its text-only names;
    ``rename``: each tensor's name as the model holds it (Mistral 3's)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {directory}")
    for file in files:
        with _checkpoint_file(file) as fh:
            for stored in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = language_model_name(stored) if language_only else stored
                if rename is not None and name is not None:
                    name = rename(name)
                if name is None:
                    continue
                part = fh.get_slice(stored)
                shape = tuple(part.get_shape())
                cut = layout.checkpoint_slice(name, shape) if layout is not None else None
                if cut is None:
                    yield name, fh.get_tensor(stored)
                    continue
                if cut.skip:
                    continue
                if cut.runs:  # a fused projection: the rank's run of each piece
                    yield name, torch.cat([part[a:b] for a, b in cut.runs])
                    continue
                tensor = part[cut.start : cut.end] if cut.dim == 0 else part[:, cut.start : cut.end]
                if cut.pad_to is not None and tensor.shape[0] < cut.pad_to:  # the last shard
                    pad = tensor.new_zeros(cut.pad_to - tensor.shape[0], *tensor.shape[1:])
                    tensor = torch.cat([tensor, pad])
                yield name, tensor


def load_weights(
    model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]],
    layout: TPLayout | None = None, whole: ArchConfig | None = None,
) -> None:  # fmt: skip
    """The checkpoint's tensors into the model; with a tensor-parallel ``layout`` (of the
    ``whole`` model), those read whole are cut to this rank's part here."""
    params = dict(model.named_parameters())
    quantized = quantized_modules(model)  # their tensors are buffers: not in params
    arch = model.cfg
    loaded: set[str] = set()
    if arch.model_type == "gpt_oss":  # experts and sinks read whole, cut after conversion
        weights = gpt_oss_tensors(weights, model.lm_head.weight.dtype)
        if layout is not None and whole is not None:
            weights = ((n, _rank_part(layout, n, t, whole)) for n, t in weights)
    deepseek_moe = arch.mla is not None or (arch.moe is not None and arch.moe.grouped is not None)
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        if arch.tie_word_embeddings and name == "lm_head.weight":
            # the embedding's values (ArchConfig.from_file unties one that differs): read into
            # it, as transformers ties a checkpoint that stores only its lm_head
            name = "model.embed_tokens.weight"
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's sparse MLP
        if arch.model_type in ("granitemoe", "granitemoeshared"):
            for theirs, ours in _GRANITE_MOE_NAMES:
                name = name.replace(theirs, ours)
            if name.endswith(_STACKED_EXPERTS) and layout is not None and whole is not None:
                tensor = _rank_part(layout, name, tensor, whole)  # read whole: the rank's rows
        if arch.model_type == "ernie4_5_moe":
            for theirs, ours in _ERNIE_MOE_NAMES:
                name = name.replace(theirs, ours)
            if name.endswith(".mlp.e_score_correction_bias"):
                tensor = tensor.reshape(-1)  # [1, E] -> [E]
        if arch.model_type == "arcee":  # its ungated MLP's up and down: not a gate/up pair
            name = name.replace(".mlp.up_proj.", ".mlp.c_fc.").replace(
                ".mlp.down_proj.", ".mlp.c_proj."
            )
        if arch.vision is not None:  # transformers 5's names of a VL checkpoint, or the older
            name = name.replace("model.language_model.", "model.").replace(
                "model.visual.", "visual."
            )
        if deepseek_moe:  # DeepSeek-V3's and GLM-4.5's multi-token-prediction layers
            if _beyond_layers(name, arch.num_layers):
                continue
            if ".mlp.shared_experts." in name and tensor.numel() == 0:  # n_shared_experts 0
                continue
        if arch.mla is not None:  # q, kv_a, kv_b: not stacked; their rotary rows in halves
            tensor = checkpoint_tensor(arch.mla, name, tensor)
        expert = _EXPERT.search(name)
        if expert:
            loaded.add(_load_expert(params, arch, name, expert, tensor))
            continue
        # the vision tower's tensors load as they are (Qwen2.5-VL's gate_proj is not stacked)
        unstacked = name.startswith(VISION_TOWERS) or (
            arch.mla is not None and ".self_attn." in name
        )
        match = None if unstacked else _NAME.search(name)
        if quantized and _load_quantized(quantized, name, tensor, match):
            continue
        if match:
            fused, shard = _STACKED[match.group(1)]
            target = name.replace(match.group(1), fused)
            if target not in params:
                raise ConfigError(f"unexpected weight {name!r} for a {arch.model_type} model")
            # gate and up: halves of the stacked tensor (the dense MLP's, or Qwen2-MoE's shared
            # expert's of its own width)
            sizes = (
                _shard_sizes(arch, fused)
                if fused == "qkv_proj"
                else [params[target].shape[0] // 2] * 2
            )
            start = sum(sizes[:shard])
            if arch.rotary_interleaved and fused == "qkv_proj" and shard < 2:  # q or k rows
                tensor = halves_from_pairs(tensor, arch.head_dim, arch.rotary_dim)
            _copy(name, tensor, params[target].data[start : start + sizes[shard]])
            loaded.add(f"{target}#{shard}")
            continue
        if name not in params:
            raise ConfigError(f"unexpected weight {name!r} for a {arch.model_type} model")
        if arch.rotary_interleaved and name.endswith(_HEAD_NORMS) and tensor.dim() == 2:
            # Cohere's q/k LayerNorm weights [H, D]: each head's dims in the rows' new order
            tensor = halves_from_pairs(tensor.T, arch.head_dim, arch.rotary_dim).T
        _copy(name, tensor, params[name].data)
        loaded.add(name)
    shards = Counter(k.partition("#")[0] for k in loaded if "#" in k)
    missing = [n for n in params if n not in loaded and shards[n] < _num_shards(arch, n)]
    if arch.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        named = [
            piece
            for n in missing[:5]
            for piece in _missing_pieces(n, loaded) or [_missing_expert(n, loaded, arch) or n]
        ]
        raise ConfigError(f"weights missing from the checkpoint: {named} ...")
    for module_name, module in quantized.items():
        module.finish_loading(module_name)
    for experts in expert_modules(model).values():
        experts.finish_loading()


# families whose quantized checkpoints are refused, and why
_UNQUANTIZED_CHECKPOINTS = {
    **dict.fromkeys(
        ("glm", "glm4", "cohere", "ernie4_5", "ernie4_5_moe"),
        "their q and k rows are reordered as they load",
    ),
    **dict.fromkeys(
        ("starcoder2", "arcee"), "the projections of its ungated MLP are not quantized layers yet"
    ),
}
# MoE families whose checkpoints store each layer's experts stacked (quantized: refused)
_STACKED_EXPERT_TYPES = ("gpt_oss", "granitemoe", "granitemoeshared")
_HEAD_NORMS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _beyond_layers(name: str, layers: int) -> bool:
    """A tensor of a decoder layer past the model's (DeepSeek-V3's and GLM-4.5's checkpoints add
    their multi-token-prediction module as layer ``num_hidden_layers``; transformers skips
    it)."""
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= layers


def _rank_part(
    layout: TPLayout, name: str, tensor: torch.Tensor, whole: ArchConfig
) -> torch.Tensor:
    """This rank's part of our parameter ``name`` if it was read whole (gpt-oss's experts and
    sinks, converted to our layout first); the others were cut as they were read."""
    if ".mlp.experts." not in name and not name.endswith(".self_attn.sinks"):
        return tensor
    if layout.on_one_rank(name) and layout.rank != 0:
        return torch.zeros_like(tensor)
    cut = layout.param_slice(name, whole)
    return tensor if cut is None else _spans(tensor, cut[0], cut[2])


def _spans(tensor: torch.Tensor, dim: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The runs ``[a, b)`` of ``tensor`` along ``dim``, concatenated: a rank's part of a whole
    tensor (``TPLayout.param_slice``)."""
    return torch.cat([tensor.narrow(dim, a, b - a) for a, b in spans], dim)


def _copy(name: str, tensor: torch.Tensor, dst: torch.Tensor) -> None:
    if tensor.shape != dst.shape:  # with tensor parallelism: the rank's slice of it
        raise ConfigError(
            f"checkpoint tensor {name!r} is {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(tensor)


def _load_expert(
    params: dict[str, torch.nn.Parameter], arch: ArchConfig, name: str, match: re.Match[str],
    tensor: torch.Tensor,
) -> str:  # fmt: skip
    """Copy one expert's tensor into its slice of the stacked parameter; returns the shard key.
    FP8 experts (``Experts.hold_fp8``): the e4m3 weight, and its scales into the stacked
    scales (block rows of the gate, then of the up; per channel, or one per tensor repeated).
    Int4 ones (``Experts.hold_int4``): the packed weight, its scales and its zeros, each row's
    groups as they come; an act-order one's permutation of its input columns, the gate's and
    the up's (the same: ``quantization.experts`` compares them) each into the expert's one."""
    expert, (stacked, shard) = int(match.group(1)), _EXPERT_PIECES[match.group(2)]
    piece = match.group(3)
    scale = piece != "weight"
    suffix = "" if not scale else _EXPERT_SUFFIX.get(piece, "_scale")
    target = f"{name[: match.start()]}.mlp.experts.{stacked}{suffix}"
    if target not in params or arch.moe is None or expert >= arch.moe.num_experts:
        raise ConfigError(f"unexpected weight {name!r} for a {arch.model_type} model")
    held = params[target.removesuffix(suffix)].dtype
    held_as = {torch.float8_e4m3fn: "in fp8", torch.int32: "as packed int4"}
    alike = tensor.dtype == held if held in held_as else tensor.dtype not in held_as
    if not scale and not alike:
        what = held_as.get(held)
        raise ConfigError(
            f"checkpoint tensor {name!r} is {tensor.dtype}, but its layer's experts are held "
            f"{what or 'dequantized'}: every expert of a layer must be quantized alike"
        )
    rows = params[target].data[expert]  # [2I, H] or [H, I]; scales [2 SN, SK] or [SN, SK]
    if piece == "weight_perm":  # [H] or [I]: gate and up read one input, in one order
        _copy(name, tensor, rows)
        return f"{target}#{expert}.{shard}"
    if shard is not None:
        size = rows.shape[0] // 2
        rows = rows[shard * size : (shard + 1) * size]
    if scale and rows.shape[1] == 1 and tensor.numel() in (1, rows.shape[0]):
        tensor = tensor.reshape(-1, 1).expand(rows.shape)  # per channel [n, 1] or [n]; one
    if tensor.shape != rows.shape:
        raise ConfigError(
            f"checkpoint tensor {name!r} is {tuple(tensor.shape)}, expected {tuple(rows.shape)}"
        )
    rows.copy_(tensor)
    return f"{target}#{expert}.{shard}"


_PIECES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _missing_pieces(param: str, loaded: set[str]) -> list[str]:
    """The checkpoint's names of what a stacked q/k/v or gate/up parameter lacks, where the
    checkpoint stores that kind split (q_proj, k_proj, v_proj as the others it gave): our
    fused name is in none of its files."""
    for fused, pieces in _PIECES.items():
        if f".{fused}." not in param or not any(f".{fused}." in k and "#" in k for k in loaded):
            continue
        return [param.replace(f".{fused}.", f".{piece}.") for i, piece in enumerate(pieces)
                if f"{param}#{i}" not in loaded]  # fmt: skip
    return []


def _missing_expert(param: str, loaded: set[str], arch: ArchConfig) -> str | None:
    """Which expert's piece a stacked expert parameter lacks (its first), in words."""
    if arch.moe is None or not param.endswith(_STACKED_PARAMS):
        return None
    halves = (0, 1) if ".gate_up_proj" in param else (None,)
    for expert in range(arch.moe.num_experts):
        for shard in halves:
            if f"{param}#{expert}.{shard}" not in loaded:
                what = {0: "gate", 1: "up", None: "down"}[shard]
                pieces = {"_scale": " scales", "_zeros": " zeros", "_perm": " permutation"}
                piece = next((v for k, v in pieces.items() if param.endswith(k)), "")
                return f"{param} (expert {expert}'s {what} projection{piece})"
    return None


_STACKED_PARAMS = (
    "experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_scale",
    "experts.down_proj_scale", "experts.gate_up_proj_zeros", "experts.down_proj_zeros",
    "experts.gate_up_proj_perm", "experts.down_proj_perm",
)  # fmt: skip


def _num_shards(arch: ArchConfig, param: str) -> int:
    """How many pieces of the checkpoint make up one of our stacked parameters."""
    experts = arch.moe.num_experts if arch.moe else 0
    if param.endswith(("experts.gate_up_proj", "experts.gate_up_proj_scale",
                       "experts.gate_up_proj_zeros", "experts.gate_up_proj_perm")):  # fmt: skip
        return 2 * experts
    if param.endswith(("experts.down_proj", "experts.down_proj_scale",
                       "experts.down_proj_zeros", "experts.down_proj_perm")):  # fmt: skip
        return experts
    if ".qkv_proj." in param:
        return 3
    return 2 if ".gate_up_proj." in param else 1


def _load_quantized(
    quantized: dict[str, QuantLinear], name: str, tensor: torch.Tensor, match: re.Match[str] | None
) -> bool:
    """Hand a tensor of a quantized layer to that layer (a stacked shard with its index)."""
    module, _, piece = name.rpartition(".")
    shard = None
    if match:
        fused, shard = _STACKED[match.group(1)]
        module = module.replace(match.group(1), fused)
    if module not in quantized:
        return False
    try:
        quantized[module].load(piece, tensor, shard)
    except ConfigError as e:
        raise ConfigError(f"checkpoint tensor {name!r}: {e}") from None
    return True


def dummy_weights(
    model: LlamaForCausalLM, seed: int, layout: TPLayout | None = None,
    arch: ArchConfig | None = None,
) -> None:  # fmt: skip
    """Random weights of realistic scale (never zeros), norms at one. A tensor-parallel rank
    (``layout`` of the whole model's ``arch``) draws each tensor whole and keeps its part."""
    for i, (name, p) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        if p.dtype in (torch.float8_e4m3fn, torch.int32, torch.uint8) or name.endswith(
            ("_proj_scale", "_proj_zeros")
        ):
            continue  # FP8 and int4 experts: drawn by quantization.dummy_quantized
        gen = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
        cut = layout.param_slice(name, arch) if layout is not None and arch is not None else None
        if cut is None:
            p.data.uniform_(-0.02, 0.02, generator=gen)
            if layout is not None and layout.on_one_rank(name) and layout.rank != 0:
                p.data.zero_()  # a bias the ranks' sum must count once
            continue
        dim, whole, spans = cut
        shape = list(p.shape)
        shape[dim] = whole
        drawn = torch.empty(shape, dtype=p.dtype, device=p.device).uniform_(
            -0.02, 0.02, generator=gen
        )
        part = _spans(drawn, dim, spans)
        p.data.zero_()  # a padded vocabulary shard's last rows
        p.data.narrow(dim, 0, part.shape[dim]).copy_(part)


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "ones_", "zeros_")


@contextlib.contextmanager
def _no_param_init() -> Iterator[None]:
    """Modules built on the meta device skip their random initialisation: the weights are
    loaded (or made by dummy_weights) afterwards, and torch runs the initialisers of meta
    tensors through its Python references, which import torch._dynamo (~140 MB resident)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def read_arch(config: ModelConfig) -> tuple[ModelFiles, ArchConfig]:
    files = prepare_model(config.model)
    config_path = (
        files.path if files.kind == "named" else (files.hf_dir or files.path) / "config.json"
    )
    return files, ArchConfig.from_file(config_path)


def _random_weights(config: ModelConfig, files: ModelFiles) -> bool:
    """``--load-format dummy``, or a named config (which has no weights)."""
    return config.load_format == "dummy" or files.kind == "named"


def _quantization(config: ModelConfig, arch: ArchConfig, dummy: bool) -> QuantConfig | None:
    return resolve_quantization(
        arch.quantization_config, config.quantization, has_weights=not dummy
    )


def check_tp_split(config: ModelConfig, size: int) -> None:
    """ConfigError, before any rank starts, when the model cannot be split over ``size``
    ranks (its heads, or a quantized checkpoint's blocks or groups)."""
    files, arch = read_arch(config)
    TPLayout.of(arch, 0, size, _quantization(config, arch, _random_weights(config, files)))


def load_model(
    config: ModelConfig, device: torch.device, max_positions: int, tp: TPGroup | None = None
) -> tuple[LlamaForCausalLM, ArchConfig, ModelFiles]:
    """The model (with ``tp``, this rank's shard of it) and the whole model's ArchConfig."""
    files, arch = read_arch(config)
    dtype = resolve_dtype(config, arch, device)
    dummy = _random_weights(config, files)
    qcfg = _quantization(config, arch, dummy)
    if qcfg is not None and qcfg.serialized and arch.model_type in FUSED_CHECKPOINT_TYPES:
        raise ConfigError(
            f"quantized {arch.model_type} checkpoints (q, k and v in one qkv_proj tensor) are not "
            "supported yet: serve the bf16 checkpoint, with --quantization fp8 for FP8"
        )
    why = _UNQUANTIZED_CHECKPOINTS.get(arch.model_type)
    if qcfg is not None and qcfg.serialized and why is not None:
        raise ConfigError(
            f"quantized {arch.model_type} checkpoints are not supported yet ({why}): serve the "
            "bf16 checkpoint, with --quantization fp8 for FP8"
        )
    if qcfg is not None and not qcfg.serialized and arch.mla is not None:
        raise ConfigError(
            f"quantized {arch.model_type} models from --quantization fp8 (multi-head latent "
            "attention) are not supported yet: serve its FP8 checkpoint (DeepSeek-V3's own "
            "128x128 blocks load), or the bf16 one without --quantization"
        )
    if qcfg is not None and arch.vision is not None and arch.vision.model_type in (
        "mistral3", "gemma3",
    ):  # fmt: skip
        # its tower is not built quantized: the language model alone, as before it had images
        kind = arch.vision.model_type
        log.warning("%s quantized: its language model is served, images refused", kind)
        arch = replace(arch, vision=None, language_of=kind)
    if qcfg is not None and arch.vision is not None:
        raise ConfigError(
            f"quantized {arch.model_type} (vision-language) models are not supported yet"
        )
    if qcfg is not None and qcfg.serialized and arch.model_type in _STACKED_EXPERT_TYPES:
        raise ConfigError(
            f"quantized {arch.model_type} checkpoints are not supported yet (their experts are "
            "stored stacked, not one tensor per expert): serve the bf16 checkpoint, with "
            "--quantization fp8 for FP8"
        )
    # Gemma 3 quantized: its layers' FP8 inputs are quantized by the layers themselves (its norms
    # and GELU are not in the fused paths of quantization.apply.fuse_fp8_inputs)
    layout = TPLayout.of(arch, tp.rank, tp.size, qcfg) if tp is not None else None
    model_class: type[LlamaForCausalLM] = LlamaForCausalLM
    if arch.vision is not None:
        model_class = Qwen3VLForCausalLM if arch.vision.qwen3 else Qwen2VLForCausalLM
        if arch.vision.model_type == "mistral3":
            model_class = Mistral3ForCausalLM
    if arch.gemma is not None:
        model_class = Gemma3ForCausalLM
        if arch.vision is not None:  # Gemma 3 with its SigLIP tower
            model_class = Gemma3VLForCausalLM
    model_class = _FAMILY_MODELS.get(arch.model_type, model_class)
    with torch.device("meta"), _no_param_init():
        model = model_class(layout.local_arch(arch) if layout else arch, max_positions)
        if tp is not None and layout is not None:
            apply_tp(model, tp, layout, arch.vocab_size)
        model = model.to(dtype)
        if qcfg is not None and qcfg.serialized:
            local = layout.local_arch(arch) if layout else arch  # a rank's shards are its own
            stacked = {fused: _shard_sizes(local, fused) for fused in ("qkv_proj", "gate_up_proj")}
            float_experts = frozenset() if dummy else _float_expert_layers(files.hf_dir)
            quantize_model(model, qcfg, dtype, stacked, _fp8_experts(device), float_experts)
    if arch.mla is not None:
        m = arch.mla
        log.info(
            "%s: multi-head latent attention served latent (absorbed, as vLLM's MLA): the KV "
            "cache holds one %d-dim row a token and layer (%d rotary key + %d latent dims, one "
            "plane, the keys are the values) read by all %d query heads, not %d dims of "
            "expanded keys and values", arch.model_type, arch.head_dim, m.qk_rope_head_dim,
            m.kv_lora_rank, arch.num_heads, 2 * arch.num_heads * m.qk_head_dim,
        )  # fmt: skip
    if device.type == "cpu":
        check_host_memory(model, config.model, dtype)
    # Module.to_empty's empty_like on meta tensors goes through torch's Python reference ops,
    # whose first call imports torch.fx's symbolic shapes and sympy: ~0.7 s of every start
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fill_rope(max_positions, device)
    if dummy:
        dummy_weights(model, config.weights_seed, layout, arch)
        dummy_quantized(model, config.weights_seed)
    else:
        assert files.hf_dir is not None
        kind = arch.vision.model_type if arch.vision is not None else ""
        rename = {"mistral3": mistral3_name, "gemma3": gemma3_name}.get(kind)
        read = iter_safetensors(files.hf_dir, layout, bool(arch.language_of), rename)
        experts = None
        if qcfg is not None and qcfg.serialized and arch.moe is not None:
            experts = ExpertDequantizer(
                qcfg, dtype, device, held_expert_layers(model), mla=arch.mla is not None
            )
            read = experts.stream(read)
        load_weights(model, read, layout, arch)
        if experts is not None and experts.projections:
            log.info(experts.describe())
        if arch.moe is not None and arch.moe.mxfp4:
            log.info(
                "%s: the checkpoint's MXFP4 experts were dequantized to %s as they loaded (no "
                "MXFP4 kernels yet: they hold 4x their bytes in the checkpoint)",
                arch.model_type, str(dtype).removeprefix("torch."),
            )  # fmt: skip
    if qcfg is not None:
        _finish_quantization(model, qcfg, tp)
    held = describe_held(list(expert_modules(model).values()), dtype, qcfg)
    if held is not None:
        log.info(held)
    return model.eval(), arch, files


_STORED_EXPERT = re.compile(r"layers\.(\d+)\..*\.experts\.\d+\.\w+\.weight$")


def _float_expert_layers(directory: Path | None) -> frozenset[int]:
    """The decoder layers where the checkpoint stores an expert's weight unquantized (not
    e4m3), read from the files' headers: their experts are not held in FP8."""
    layers: set[int] = set()
    for file in sorted(directory.glob("*.safetensors")) if directory else []:
        with _checkpoint_file(file) as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                match = _STORED_EXPERT.search(key)
                if match and fh.get_slice(key).get_dtype() != "F8_E4M3":
                    layers.add(int(match.group(1)))
    return frozenset(layers)


def _fp8_experts(device: torch.device) -> bool:
    """Whether FP8 experts are held in FP8 here: on the CPU (the reference dequantizes each
    routed expert at every call) and sm89+ GPUs (the Triton kernel); older GPUs dequantize
    them as they load (Triton has no e4m3 there)."""
    return device.type != "cuda" or ops.fp8_supported(device)


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(model: torch.nn.Module, name: str, dtype: torch.dtype) -> None:
    """ConfigError, before any weight is allocated, when the model (still on the meta device)
    would not fit the host's available memory: the kernel's OOM killer would end the process
    half-way through with no word of why (an 8B model in float32 is 32 GB)."""
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(t.numel() * t.element_size() for t in tensors)
    avail = available_host_bytes()
    if avail is None or need <= avail:
        return
    gib = 1 << 30
    raise ConfigError(
        f"model {name!r} needs {need / gib:.1f} GiB for its weights in {dtype} on the CPU, but "
        f"only {avail / gib:.1f} GiB of memory are available: serve a smaller model, a 16-bit "
        "--dtype (bfloat16 halves float32), or use a GPU (--device cuda)"
    )


def _finish_quantization(model: LlamaForCausalLM, qcfg: QuantConfig, tp: TPGroup | None) -> None:
    if not qcfg.serialized:
        quantize_loaded(model, tp, fp8_experts=_fp8_experts(model.lm_head.weight.device))
    if qcfg.method == "fp8":
        fuse_fp8_inputs(model)
    log.info(qcfg.describe())
    device = model.lm_head.weight.device
    if qcfg.method == "fp8" and device.type == "cuda" and not ops.fp8_supported(device):
        log.warning(
            "this GPU has no FP8 support (sm89+): fp8 weights are dequantized at every call "
            "(weight-only, slower than the float model); prefer bf16 or an int4 checkpoint here"
        )
