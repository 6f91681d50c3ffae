"""A tiny random Qwen2-VL checkpoint, offline: transformers' model from a config with a small
vision tower, the embedded model's tokenizer with Qwen2-VL's special tokens and a chat template
that places an image's placeholder, and an image processor with small pixel bounds (a few dozen
image tokens per image). Shared by the engine parity tests and the serving end-to-end tests."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.llm_engine import load_tokenizer
from tests.services.engine.conftest import tokenizer_dir

SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB = 49152 + 8  # the embedded tokenizer's, the special tokens after it
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 24  # at most 24 image tokens per image
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(path: Path, kind: str = "qwen2_vl") -> Any:
    """Writes the checkpoint, tokenizer and processor into ``path``; returns transformers' model.
    ``kind``: qwen2_vl, qwen2_5_vl (windows of 2x2 merged patches, block 1 of 3 full), or
    qwen3_vl (16-pixel patches, a 4x4 table of learned positions, DeepStack from blocks 0 and 1
    into decoder layers 0 and 1 of 3, interleaved M-RoPE)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = load_tokenizer(tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "eos_token_id": None, "bos_token_id": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [2, 3, 3]},
    }  # fmt: skip
    vision: dict[str, Any] = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2}
    config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    pixels: dict[str, Any] = {
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    }  # of the image processor
    if kind == "qwen2_5_vl":
        vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                  "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1]}  # fmt: skip
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    if kind == "qwen3_vl":
        # transformers' Qwen3-VL takes each part's initializer_range from that part's config
        text = {**text, "num_hidden_layers": 3, "head_dim": 16, "initializer_range": 0.2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                    "mrope_section": [4, 2, 2], "mrope_interleaved": True}}  # fmt: skip
        vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                  "out_hidden_size": 64, "num_position_embeddings": 16,
                  "deepstack_visual_indexes": [0, 1], "initializer_range": 0.2}  # fmt: skip
        config_class, model_class = Qwen3VLConfig, Qwen3VLForConditionalGeneration
        area = 32 * 32  # one merged token: 2x2 patches of 16 pixels
        pixels = {"size": {"shortest_edge": area * 4, "longest_edge": area * 24}, "patch_size": 16,
                  "image_mean": [0.5] * 3, "image_std": [0.5] * 3}  # fmt: skip
    cfg = config_class(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_class(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(**pixels).save_pretrained(path)
    return model


def png(seed: int, width: int = 64, height: int = 48) -> bytes:
    """A random RGB image, PNG-encoded."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def hf_greedy(model: Any, path: Path, ids: list[int], images: list[bytes], new: int) -> list[int]:
    """transformers' greedy tokens after ``ids`` (placeholders already expanded)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    kwargs: dict[str, Any] = {}
    if images:
        proc = Qwen2VLImageProcessorPil.from_pretrained(str(path))
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        feat = proc(images=pil, return_tensors="pt")
        kwargs = {"pixel_values": feat["pixel_values"], "image_grid_thw": feat["image_grid_thw"]}
    image_id = json.loads((path / "config.json").read_text())["image_token_id"]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids, mm_token_type_ids=(input_ids == image_id).int(), max_new_tokens=new,
            min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()
