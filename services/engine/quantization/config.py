"""Which quantization to serve: from the checkpoint's ``quantization_config`` or ``--quantization``.

Torch-free. Everything this engine cannot run exactly as the checkpoint means it is refused here
with a ``ConfigError`` that says what to change, never silently served differently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from services.config import QUANTIZATION_METHODS, ConfigError
from services.engine.model_config import language_model_name, multimodal_names

INT4_GROUP_SIZES = (32, 64, 128)  # the w4a16 kernel's chunk of K divides the group
UNQUANTIZED = "embed_tokens, lm_head and the norms stay unquantized"
NAMES = {"awq": "AWQ", "gptq": "GPTQ"}  # how messages spell a method


@dataclass(frozen=True)
class QuantConfig:
    method: str  # fp8 | awq | gptq | compressed-tensors (its int4 pack-quantized weights)
    serialized: bool = True  # False: fp8 weights quantized at load time from a float checkpoint
    group_size: int = 128  # awq/gptq: input rows sharing one scale and zero point
    desc_act: bool = False  # gptq act-order: g_idx shuffles the groups
    # fp8: (block_n, block_k) scales (weight_scale_inv); None: per-channel or per-tensor
    # weight_scale
    weight_block: tuple[int, int] | None = None
    # the checkpoint's modules left unquantized (modules_to_not_convert, ignored_layers,
    # ignore): names, dotted pieces of names, or "re:" patterns; lm_head is never quantized
    unquantized: tuple[str, ...] = ()
    # compressed-tensors int4: whether zero points are stored (asymmetric; symmetric ones are
    # 8), and per-channel scales (one group a row: served as groups of INT4_GROUP_SIZES, the
    # row's scale repeated, see channel_group)
    zero_points: bool = True
    channel: bool = False

    @property
    def is_int4(self) -> bool:
        return self.method in ("awq", "gptq", "compressed-tensors")

    def leaves_unquantized(self, module: str) -> bool:
        """Whether the checkpoint stores ``module`` (an HF module name such as
        ``model.layers.0.self_attn.q_proj``) unquantized: an entry that is the name or a
        run of its dotted pieces (``mlp.gate``, AWQ's ``gate``), or an ``re:`` pattern matching
        it from the start (compressed-tensors)."""
        dotted = f".{module}."
        # a pattern may be written against a multimodal checkpoint's own names
        # (model.language_model.layers...), which the loader reads as the text-only model's
        names = (module, *multimodal_names(module))
        for entry in self.unquantized:
            if entry.startswith("re:"):
                if any(re.match(entry[3:], name) for name in names):
                    return True
            elif f".{entry}." in dotted:
                return True
        return False

    def describe(self) -> str:
        """The start-up line: what is loaded and what stays unquantized."""
        if self.is_int4:
            order = ", act-order" if self.desc_act else ""
            group = "per-channel scales" if self.channel else f"group size {self.group_size}"
            kind = "w4a16"
            if self.method == "compressed-tensors":
                kind += ", pack-quantized, " + ("asymmetric" if self.zero_points else "symmetric")
            what = f"{self.method} int4 weights ({kind}), {group}{order}"
        elif not self.serialized:
            what = "fp8 e4m3 weights quantized at load time, per-channel scales"
        elif self.weight_block is not None:
            bn, bk = self.weight_block
            what = f"fp8 e4m3 weights, {bn}x{bk} block scales"
        else:
            what = "fp8 e4m3 weights, per-channel (or per-tensor) scales"
        kept = ", ".join(self.unquantized[:4]) + (", ..." if len(self.unquantized) > 4 else "")
        stored = f"; stored unquantized by the checkpoint: {kept}" if self.unquantized else ""
        return f"quantization: {what}; {UNQUANTIZED}{stored}"


def resolve_quantization(
    checkpoint: dict[str, Any] | None, flag: str | None, *, has_weights: bool = True
) -> QuantConfig | None:
    """The checkpoint's ``quantization_config`` (``checkpoint``) and ``--quantization`` (``flag``)
    reconciled; ``has_weights`` False for random weights (``--load-format dummy``, named configs),
    where any method can be made up."""
    if flag is not None and flag not in QUANTIZATION_METHODS:
        raise ConfigError(
            f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {flag!r}"
        )
    if not checkpoint:
        if flag is None:
            return None
        if flag == "fp8":
            return QuantConfig("fp8", serialized=False)
        if has_weights:
            raise ConfigError(
                f"--quantization {flag} needs a {NAMES.get(flag, flag)} checkpoint (its "
                "config.json has no quantization_config); --quantization fp8 quantizes a float "
                "checkpoint at load time"
            )
        return QuantConfig(flag)
    found = _from_checkpoint(checkpoint)
    stored = str(checkpoint.get("quant_method", "")).lower()
    if flag is not None and flag != found.method and flag != stored:
        raise ConfigError(
            f"--quantization {flag} does not match the checkpoint, which is quantized with "
            f"{found.method}: drop --quantization or pass --quantization {found.method}"
        )
    if not has_weights and found.method == "fp8":
        return QuantConfig("fp8", serialized=False)  # random weights: quantized as they are made
    return found


def _from_checkpoint(q: dict[str, Any]) -> QuantConfig:
    method = str(q.get("quant_method", "")).lower()
    unquantized = _unconverted(q)
    if method == "fp8":
        return replace(_fp8(q), unquantized=unquantized)
    if method == "compressed-tensors":
        return replace(_compressed_tensors(q), unquantized=unquantized)
    if method in ("awq", "gptq"):
        return replace(_int4(method, q), unquantized=unquantized)
    raise ConfigError(
        f"quantization_config quant_method {method!r} is not supported; supported: fp8, "
        "compressed-tensors (fp8, int4 w4a16), awq, gptq"
    )


def _unconverted(q: dict[str, Any]) -> tuple[str, ...]:
    """The modules the checkpoint leaves unquantized, as its config names them (lm_head, never
    quantized here, left out); a quantized lm_head is refused."""
    if q.get("lm_head") is True:
        raise ConfigError("quantization_config has a quantized lm_head, which is not supported")
    names: list[str] = []
    for key in ("modules_to_not_convert", "ignored_layers", "ignore"):
        names += [str(n) for n in q.get(key) or []]
    bad = [n for n in names if n.startswith("re:") and not _compiles(n[3:])]
    if bad:
        raise ConfigError(f"quantization_config: {bad[0]!r} is not a valid regular expression")
    # a multimodal checkpoint's names (served as its language model) as the loader reads them
    plain = [n if n.startswith("re:") else (language_model_name(n) or n) for n in names]
    return tuple(n for n in plain if n != "lm_head" and not n.endswith(".lm_head"))


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _fp8(q: dict[str, Any]) -> QuantConfig:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(
            f"fp8 activation_scheme {scheme!r} (static input scales) is not supported; only "
            "dynamic per-token activation scales are"
        )
    block = q.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8")
    if len(block) != 2 or min(block) < 1:
        raise ConfigError(f"fp8 weight_block_size must be [block_n, block_k], got {block}")
    bn, bk = int(block[0]), int(block[1])
    if bk % 16:
        raise ConfigError(f"fp8 weight_block_size block_k must be a multiple of 16, got {bk}")
    return QuantConfig("fp8", weight_block=(bn, bk))


def int4_pieces(method: str, zero_points: bool = True, desc_act: bool = False) -> tuple[str, ...]:
    """The checkpoint tensors of one int4 projection (a layer's shard, or an expert's): AWQ's
    and GPTQ's packed words, zero points, scales (and act-order g_idx), compressed-tensors'
    (zero points only when asymmetric)."""
    if method == "compressed-tensors":
        zeros = ("weight_zero_point",) if zero_points else ()
        return ("weight_packed", "weight_scale", *zeros, *(("weight_g_idx",) if desc_act else ()))
    return ("qweight", "qzeros", "scales", *(("g_idx",) if desc_act else ()))


def channel_group(in_features: int) -> int | None:
    """The serving group of a per-channel int4 layer with ``in_features`` inputs: the largest of
    INT4_GROUP_SIZES dividing it (each group repeats the row's one scale and zero point, so the
    values are the checkpoint's exactly); None if none does."""
    return next((g for g in sorted(INT4_GROUP_SIZES, reverse=True) if in_features % g == 0), None)


def _compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    """compressed-tensors: FP8 (float-quantized: per-channel, per-tensor or block e4m3 weights,
    dynamic per-token activations or none) or int4 weight-only (pack-quantized W4A16). Sparse
    weights stored compressed (a sparsity_config format other than "dense") and weights rotated
    by a transform_config (SpinQuant, QuIP: online Hadamard transforms) are refused."""
    sparsity = q.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ConfigError(
            f"compressed-tensors sparsity_config format {sparsity['format']!r} (sparse weights "
            "stored compressed) is not supported; serve the dense checkpoint"
        )
    if q.get("transform_config"):
        raise ConfigError(
            "compressed-tensors transform_config (rotated weights that need online transforms, "
            "SpinQuant / QuIP) is not supported; serve a checkpoint quantized without transforms"
        )
    fmt = q.get("format")
    groups = list((q.get("config_groups") or {}).values())
    if not groups or any(not isinstance(g, dict) for g in groups):
        raise ConfigError(
            "compressed-tensors config_groups must hold the schemes (weights, "
            "input_activations, targets), as llm-compressor saves them; preset names are not "
            "supported"
        )
    schemes = [{k: v for k, v in g.items() if k != "targets"} for g in groups]
    if any(scheme != schemes[0] for scheme in schemes):
        raise ConfigError(
            f"compressed-tensors config_groups with different schemes ({len(groups)} groups) "
            "are not supported; only one scheme for every quantized layer (re-quantize with "
            "one scheme, e.g. W4A16, or FP8_DYNAMIC)"
        )
    targets = {t for g in groups for t in g.get("targets") or []}
    if not targets <= {"Linear"}:
        raise ConfigError(
            f"compressed-tensors targets {sorted(targets)} are not supported; only 'Linear' "
            "(every linear layer, less the ignore list)"
        )
    scheme = groups[0]
    if fmt == "mixed-precision":  # each scheme names its own format
        fmt = scheme.get("format")
    weights = scheme.get("weights") or {}
    if fmt == "pack-quantized" or (fmt != "float-quantized" and weights.get("type") == "int"):
        return _ct_int4(fmt, scheme, q)
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ConfigError(
            f"compressed-tensors format {fmt!r} is not supported; only float-quantized (fp8) "
            "and pack-quantized (int4 weight-only, W4A16)"
        )
    acts = scheme.get("input_activations")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ConfigError("compressed-tensors weights must be 8-bit float (fp8) to be served")
    strategy = weights.get("strategy")
    if strategy == "block":
        block = weights.get("block_structure") or [128, 128]
        return _fp8({"weight_block_size": block})
    if strategy not in ("channel", "tensor"):
        raise ConfigError(f"compressed-tensors weight strategy {strategy!r} is not supported")
    if acts is not None and not (acts.get("dynamic") and acts.get("strategy") in ("token", None)):
        raise ConfigError(
            "compressed-tensors static input_activations scales are not supported; only "
            "dynamic per-token ones"
        )
    return QuantConfig("fp8")


def _ct_int4(fmt: Any, scheme: dict[str, Any], q: dict[str, Any]) -> QuantConfig:
    """compressed-tensors int4 weight-only (llm-compressor's W4A16, W4A16_ASYM): 4-bit integer
    weights packed eight a word along K (``weight_packed``), group or per-channel scales, zero
    points if asymmetric, ``weight_g_idx`` with actorder "group"."""
    weights = scheme.get("weights") or {}
    bits, kind = weights.get("num_bits"), weights.get("type")
    if fmt != "pack-quantized" or kind != "int" or bits != 4:
        raise ConfigError(
            f"compressed-tensors {bits}-bit {kind} weights in format {fmt!r} are not supported; "
            "only 4-bit int pack-quantized (W4A16) and 8-bit float (FP8): serve an FP8 or "
            "W4A16 checkpoint (int8 W8A16/W8A8 have no kernels here)"
        )
    if scheme.get("input_activations") is not None:
        raise ConfigError(
            "compressed-tensors int4 weights with quantized input_activations (W4A8, "
            "W4AFP8) are not supported; only weight-only W4A16"
        )
    if q.get("kv_cache_scheme") is not None:
        raise ConfigError(
            "compressed-tensors kv_cache_scheme (stored KV cache scales) is not supported; "
            "serve a checkpoint without it (--kv-cache-dtype fp8 quantizes the cache itself)"
        )
    if scheme.get("output_activations") is not None:
        raise ConfigError("compressed-tensors output_activations quantization is not supported")
    if weights.get("dynamic"):
        raise ConfigError("compressed-tensors dynamic weight quantization is not supported")
    strategy = weights.get("strategy") or ("channel" if weights.get("group_size") == -1 else None)
    if strategy == "group":
        group = int(weights.get("group_size") or 0)
        if group not in INT4_GROUP_SIZES:
            raise ConfigError(
                f"compressed-tensors group_size {group} is not supported; supported: "
                f"{', '.join(map(str, INT4_GROUP_SIZES))}, or strategy 'channel' "
                "(re-quantize with group_size 128)"
            )
    elif strategy == "channel":
        group = max(INT4_GROUP_SIZES)  # the serving groups: channel_group of each layer
    else:
        raise ConfigError(
            f"compressed-tensors int4 weight strategy {strategy!r} is not supported; only "
            "'group' (group_size 32, 64 or 128) and 'channel'"
        )
    actorder = weights.get("actorder")
    if actorder not in (None, False, "weight", "static", "group", "dynamic"):
        raise ConfigError(f"compressed-tensors actorder {actorder!r} is not supported")
    # "weight" (static) only reorders the calibration; "group" stores weight_g_idx
    desc_act = actorder in ("group", "dynamic") and strategy == "group"
    return QuantConfig(
        "compressed-tensors", group_size=group, desc_act=desc_act,
        zero_points=weights.get("symmetric", True) is False, channel=strategy == "channel",
    )  # fmt: skip


def _int4(method: str, q: dict[str, Any]) -> QuantConfig:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise ConfigError(f"{method} with {bits} bits is not supported; only 4-bit checkpoints")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    if group not in INT4_GROUP_SIZES:
        raise ConfigError(
            f"{method} group_size {group} is not supported; supported: "
            f"{', '.join(map(str, INT4_GROUP_SIZES))} (re-quantize with group_size 128)"
        )
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or q.get("zero_point", True) is not True:
            raise ConfigError(
                f"awq version {version!r} (zero_point={q.get('zero_point', True)}) is not "
                "supported; only GEMM packing with zero points"
            )
        return QuantConfig("awq", group_size=group)
    fmt = q.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        raise ConfigError(
            f"gptq checkpoint_format {fmt!r} is not supported; only the v1 'gptq' format"
        )
    if q.get("static_groups"):
        raise ConfigError("gptq static_groups is not supported")
    return QuantConfig("gptq", group_size=group, desc_act=bool(q.get("desc_act", False)))
