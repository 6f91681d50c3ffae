"""A config.json that leaves keys out reads as transformers reads it: each supported model type's
minimal config (the sizes a checkpoint must give) read by ``ArchConfig`` and by transformers'
own config class from the same file, their values compared key by key (the norms' eps, the rope
base, the maximum length, KV heads, head_dim, tied embeddings, vocabulary, MLP widths, experts,
window, ...); the same with every key of ``CLASS_DEFAULTS`` given, unlike its default (what the
file says stands); the table's entries against transformers' config classes' defaults; and two
tiny random checkpoints whose configs lack those keys, generated greedily against
transformers."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from protos.sampling_params import SamplingParams
from services.engine.arch_families import CLASS_DEFAULTS
from services.engine.deepseek_config import _DEFAULTS as DEEPSEEK_DEFAULTS
from services.engine.llm import LLM
from services.engine.model_config import SUPPORTED, VL_TYPES, ArchConfig
from tests.services.engine.conftest import BESIDE, save_test_tokenizer, token_prompts

transformers = pytest.importorskip("transformers")

# the sizes every checkpoint's config gives (4 layers: DeepSeek-V3's first 3 are dense)
GIVEN = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
# what a family needs beyond them where transformers' default would build no model
NEEDS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"num_experts_per_tok": 2},  # transformers' default: None (no router)
    # Gemma 3's published tower (transformers' default one does not tile 256 image tokens)
    "gemma3": {"vision_config": {"image_size": 896, "patch_size": 14}},
}
# the multimodal types whose language model's keys sit in text_config (transformers 5's saves)
NESTED = (*VL_TYPES, "gemma3", "mistral3")
# given values unlike every default (tie_word_embeddings: the other of its default)
OTHER = {
    "vocab_size": 300, "intermediate_size": 80, "moe_intermediate_size": 24,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 3e-6, "rope_theta": 12345.0,
    "max_position_embeddings": 777, "num_experts": 6, "num_local_experts": 6,
    "num_experts_per_tok": 3, "image_token_id": 7, "original_max_position_embeddings": 333,
}  # fmt: skip


def _text_class(model_type: str) -> Any:
    """transformers' config class of ``model_type``'s language model."""
    cls = transformers.CONFIG_MAPPING[model_type]
    if model_type in VL_TYPES:
        return cls.sub_configs["text_config"]
    return cls


def _mrope(head_dim: int) -> list[int]:
    """An M-RoPE split of head_dim / 2 frequencies into t, h, w sections."""
    third = head_dim // 6
    return [head_dim // 2 - 2 * third, third, third]


def _config(model_type: str, given: dict[str, Any]) -> dict[str, Any]:
    """A config.json of ``model_type`` holding ``GIVEN``, what the family needs, and ``given``;
    the language model's keys in text_config for the multimodal types."""
    text = {**GIVEN, **given}
    top: dict[str, Any] = {}
    if model_type in VL_TYPES:  # M-RoPE must split the head's frequencies
        head_dim = (text.get("head_dim") or CLASS_DEFAULTS[model_type].get("head_dim")
                    or text["hidden_size"] // text["num_attention_heads"])  # fmt: skip
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": _mrope(head_dim)}
        top = {k: text.pop(k) for k in ("image_token_id",) if k in text}
    if model_type == "mistral3":
        text["model_type"] = "mistral"
    if model_type in NESTED:
        top["text_config"] = text
    else:
        top = text
    return {"model_type": model_type, **top, **NEEDS.get(model_type, {})}


def _read_both(tmp_path: Path, cfg: dict[str, Any]) -> tuple[ArchConfig, Any]:
    """``cfg`` written as a config.json and read by ``ArchConfig`` and by transformers."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    return ArchConfig.from_file(tmp_path / "config.json"), theirs


def _first(config: Any, *keys: str) -> Any:
    return next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)


def _theirs(model_type: str, full: Any) -> dict[str, Any]:
    """The values transformers' config ``full`` holds for what ``_ours`` reads."""
    hf = full.get_text_config()
    rope = dict(hf.rope_parameters or {})
    local = rope.get("sliding_attention")
    rope = rope.get("full_attention", rope)
    heads = hf.num_attention_heads
    window = getattr(hf, "sliding_window", None) or None
    types = getattr(hf, "layer_types", None)
    got = {
        "eps": _first(hf, "rms_norm_eps", "layer_norm_eps", "norm_epsilon"),
        "theta": float(rope["rope_theta"]),
        "partial_rotary": float(rope.get("partial_rotary_factor") or 1.0),
        "max_positions": hf.max_position_embeddings,
        "kv_heads": hf.num_key_value_heads or heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "tied": full.tie_word_embeddings,
        "vocab": hf.vocab_size,
        "intermediate": hf.intermediate_size,
        "window": window,
    }
    if window is not None and types is not None and model_type not in ("mistral", "mixtral"):
        got["windowed"] = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if local is not None:
        got["local_theta"] = float(local["rope_theta"])
    experts = _first(hf, "n_routed_experts", "moe_num_experts", "num_local_experts", "num_experts")
    if experts is not None:
        got["experts"] = (
            experts,
            _first(hf, "moe_k", "num_experts_per_tok"),
            getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size,
        )
    if model_type.startswith("deepseek"):  # MLA: one latent KV head of its own width
        del got["kv_heads"], got["head_dim"]
        got["mla"] = (hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim,
                      hf.q_lora_rank or 0)  # fmt: skip
    if model_type in VL_TYPES:
        got["image_token"] = full.image_token_id
    if model_type in ("granite", "granitemoe", "granitemoeshared"):
        got["granite"] = (hf.embedding_multiplier, hf.residual_multiplier,
                          hf.attention_multiplier, hf.logits_scaling)  # fmt: skip
    return got


def _ours(model_type: str, arch: ArchConfig, want: dict[str, Any]) -> dict[str, Any]:
    """``arch``'s values for the keys of ``want`` (``_theirs``)."""
    local = arch.gemma.local_rope_theta if arch.gemma else arch.local_rope_theta or arch.rope_theta
    got = {
        "eps": arch.rms_norm_eps,
        "theta": arch.rope_theta,
        "partial_rotary": arch.partial_rotary_factor,
        "max_positions": arch.max_position_embeddings,
        "kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "tied": arch.tie_word_embeddings,
        "vocab": arch.vocab_size,
        "intermediate": arch.intermediate_size,
        "window": arch.sliding_window,
        "windowed": arch.sliding_layers,
        "local_theta": local,
        "image_token": arch.vision.image_token_id if arch.vision else None,
        "granite": (
            arch.embedding_multiplier,
            arch.residual_multiplier,
            arch.attention_multiplier,
            arch.logits_scaling,
        ),
    }
    if arch.moe is not None:
        got["experts"] = (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size)
    if arch.mla is not None:
        mla = arch.mla
        got["mla"] = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                      mla.v_head_dim, mla.q_lora_rank)  # fmt: skip
    return {key: got.get(key) for key in want}


def _assert_read_as_transformers(model_type: str, tmp_path: Path, given: dict[str, Any]) -> None:
    arch, full = _read_both(tmp_path, _config(model_type, given))
    want = _theirs(model_type, full)
    got = _ours(model_type, arch, want)
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not wrong, f"{model_type}: (ours, transformers') differ: {wrong}"


@pytest.mark.parametrize("model_type", list(SUPPORTED))
def test_a_minimal_config_reads_as_transformers_reads_it(model_type: str, tmp_path: Path) -> None:
    """Only the sizes given: every other value is transformers' class default."""
    _assert_read_as_transformers(model_type, tmp_path, {})


def _unlike_defaults(model_type: str) -> dict[str, Any]:
    """Each key of ``model_type``'s ``CLASS_DEFAULTS`` given unlike its default; an experts
    count under the other name transformers reads it by, where it has one."""
    out: dict[str, Any] = {}
    aliases = getattr(transformers.CONFIG_MAPPING[model_type], "attribute_map", {})
    for key, default in CLASS_DEFAULTS.get(model_type, {}).items():
        value = (not default) if key == "tie_word_embeddings" else OTHER[key]
        name = next((a for a, real in aliases.items() if real == key), None)
        name = name or aliases.get(key) or key
        out[name] = value
    return out


@pytest.mark.parametrize("model_type", list(CLASS_DEFAULTS))
def test_what_the_config_says_stands_over_the_defaults(model_type: str, tmp_path: Path) -> None:
    given = _unlike_defaults(model_type)
    if model_type == "phi3":  # its original length read with LongRoPE alone
        half = GIVEN["hidden_size"] // GIVEN["num_attention_heads"] // 2
        given["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0] * half,
                                 "long_factor": [2.0] * half}  # fmt: skip
    _assert_read_as_transformers(model_type, tmp_path, given)
    if model_type == "phi3":
        arch = ArchConfig.from_file(tmp_path / "config.json")
        assert arch.rope_scaling["original_max_position_embeddings"] == 333


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_a_flat_qwen_vl_config_reads_as_transformers_reads_it(
    model_type: str, tmp_path: Path
) -> None:
    """The older Qwen2(.5)-VL configs: the language model's keys at the top level."""
    cfg = _config(model_type, {})
    cfg = {**cfg, **cfg.pop("text_config")}
    arch, full = _read_both(tmp_path, cfg)
    want = _theirs(model_type, full)
    assert _ours(model_type, arch, want) == want


@pytest.mark.parametrize(
    "rope",
    [
        {},
        {"rope_theta": 30000.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
        {"rope_parameters": {"rope_type": "default"}},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": {"type": "linear", "factor": 2.0, "rope_theta": 40000.0}},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 30000.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
         "rope_theta": 30000.0},
    ],
)  # fmt: skip
@pytest.mark.parametrize("model_type", ["mixtral", "smollm3", "qwen3_vl"])
def test_a_default_rope_base_only_where_the_config_gives_none(
    model_type: str, rope: dict[str, Any], tmp_path: Path
) -> None:
    """Mixtral's default base is 1e6, SmolLM3's 2e6, Qwen3-VL's 5e5: a base given at the top
    or in rope_parameters or rope_scaling stands, the default fills in only without one."""
    cfg = _config(model_type, {})
    text = cfg.get("text_config", cfg)
    for key in ("rope_parameters", "rope_scaling"):
        if key in rope:  # Qwen3-VL's M-RoPE split kept
            text[key] = {**text.pop("rope_parameters", {}), **rope[key]}
    if "rope_theta" in rope:
        text["rope_theta"] = rope["rope_theta"]
    arch, full = _read_both(tmp_path, cfg)
    assert arch.rope_theta == _theirs(model_type, full)["theta"]
    given = [r.get("rope_theta") for r in (rope.get("rope_parameters"), rope.get("rope_scaling"),
                                           rope) if r and r.get("rope_theta")]  # fmt: skip
    assert arch.rope_theta == (given[0] if given else CLASS_DEFAULTS[model_type]["rope_theta"])


def _class_default(cls: Any, key: str) -> Any:
    """The default of ``cls``'s field ``key`` (or of the field it names by another name)."""
    if key == "rope_theta":
        return cls.default_theta
    aliases = getattr(cls, "attribute_map", {})
    names = (key, aliases.get(key), *(a for a, real in aliases.items() if real == key))
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    return fields[next(name for name in names if name in fields)]


@pytest.mark.parametrize("model_type", list(CLASS_DEFAULTS))
def test_the_table_holds_transformers_config_classes_defaults(model_type: str) -> None:
    """Each entry is its class's default (the Qwen-VL models' image token: the outer config's),
    whether or not a key of the minimal configs above reaches it."""
    assert set(CLASS_DEFAULTS) <= set(SUPPORTED)
    for key, value in CLASS_DEFAULTS[model_type].items():
        owner = transformers.CONFIG_MAPPING[model_type] if key == "image_token_id" else None
        cls = owner or _text_class(model_type)
        assert _class_default(cls, key) == value, f"{model_type}: {key}"


@pytest.mark.parametrize("model_type", list(DEEPSEEK_DEFAULTS))
def test_deepseeks_own_defaults_are_transformers(model_type: str) -> None:
    """The MLA and MoE keys deepseek_config defaults itself (routing, shared experts, ...)."""
    cls = transformers.CONFIG_MAPPING[model_type]
    for key, value in DEEPSEEK_DEFAULTS[model_type].items():
        assert _class_default(cls, key) == value, f"{model_type}: {key}"


# two tiny random checkpoints whose config.json leaves out what their class defaults (eps, rope
# base, experts, tied embeddings), generated greedily against transformers from the same file
PARITY: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "mixtral": ("mixtral", {"intermediate_size": 48, "num_local_experts": 4,
                            "num_experts_per_tok": 2},
                ["rms_norm_eps", "rope_parameters", "rope_theta", "num_experts_per_tok"]),
    "smollm3": ("smollm3", {"intermediate_size": 96, "tie_word_embeddings": True,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 2e6}},
                ["tie_word_embeddings", "rope_parameters", "rope_theta"]),
}  # fmt: skip


@pytest.mark.usefixtures("tokenizers_loaded_once")
@pytest.mark.parametrize("name", list(PARITY))
def test_a_trimmed_checkpoint_generates_as_transformers(name: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra, dropped = PARITY[name]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms off 1 and small embeddings: the eps and every weight matter
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)
        model.get_input_embeddings().weight.mul_(0.01)
    model.save_pretrained(tmp_path)
    save_test_tokenizer(tmp_path)
    path = tmp_path / "config.json"
    written = json.loads(path.read_text())
    assert any(k in written for k in dropped)
    path.write_text(json.dumps({k: v for k, v in written.items() if k not in dropped}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = token_prompts(len(name), [5, 19])
    with LLM(str(tmp_path), **BESIDE) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1 :]
        assert ids == logits.argmax(-1).tolist(), f"{name}: diverged on {len(prompt)} tokens"
