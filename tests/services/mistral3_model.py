"""A tiny random Mistral 3 checkpoint, offline: transformers' ``Mistral3ForConditionalGeneration``
from a ``Mistral3Config`` with a small Pixtral vision tower and a small Mistral language model,
the embedded model's tokenizer with Pixtral's image tokens and a chat template that places an
image's ``[IMG]`` placeholder, and Pixtral's image processor with a small ``longest_edge`` (at
most 4x4 merged patches an image). Shared by the engine parity tests and the serving
end-to-end tests.

transformers' ``PixtralProcessor`` needs torchvision (not installable beside this torch build),
so the reference prompt is built as it builds one (``processor_prompt``): the image
processor's resized sizes, each ``[IMG]`` of the text replaced by ``[IMG]`` per merged patch,
``[IMG_BREAK]`` after each row and ``[IMG_END]`` last (``PixtralProcessor.replace_image_token``),
then tokenized."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from services.engine.llm_engine import load_tokenizer
from tests.services.engine.conftest import tokenizer_dir
from tests.services.vl_model import png

__all__ = ["build", "hf_greedy", "png", "processor_prompt"]

SPECIAL = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
VOCAB = 49152 + 8  # the embedded tokenizer's, the special tokens after it
PATCH, MERGE = 14, 2
LONGEST_EDGE = 112  # 8x8 patches, 4x4 merged: at most 20 tokens an image
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}[IMG]"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(path: Path) -> Any:
    """Writes the checkpoint, tokenizer and image processor into ``path``; returns
    transformers' model (float32, eval)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    tok = load_tokenizer(tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = CHAT_TEMPLATE
    text = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "eos_token_id": None, "bos_token_id": None, "initializer_range": 0.2,
    }  # fmt: skip
    # silu as Mistral Small 3.1's tower (Pixtral's default is gelu; the projector's gelu)
    vision = {
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 2, "head_dim": 16, "patch_size": PATCH,
        "image_size": LONGEST_EDGE, "hidden_act": "silu", "initializer_range": 0.2,
    }  # fmt: skip
    cfg = Mistral3Config(
        text_config=text, vision_config=vision, spatial_merge_size=MERGE,
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    PixtralImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, patch_size={"height": PATCH, "width": PATCH}
    ).save_pretrained(path)
    return model


def _pixels(path: Path, images: list[bytes]) -> dict[str, Any]:
    """The image processor's output as transformers' Mistral 3 processor asks for it (sized in
    merged patches)."""
    from PIL import Image
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    proc = PixtralImageProcessorPil.from_pretrained(str(path))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    side = PATCH * MERGE
    return proc(images=pil, patch_size={"height": side, "width": side}, return_tensors="pt")


def processor_prompt(path: Path, text: str, images: list[bytes]) -> list[int]:
    """The ids transformers' Pixtral processor gives ``text`` (a rendered chat, one ``[IMG]``
    per image) with ``images``."""
    pieces = text.split("[IMG]")
    assert len(pieces) == len(images) + 1
    side = PATCH * MERGE
    sizes = _pixels(path, images)["image_sizes"].tolist() if images else []
    out = pieces[0]
    for (height, width), piece in zip(sizes, pieces[1:], strict=True):
        run = (["[IMG]"] * (width // side) + ["[IMG_BREAK]"]) * (height // side)
        run[-1] = "[IMG_END]"
        out += "".join(run) + piece
    return load_tokenizer(path)(out, add_special_tokens=False)["input_ids"]


def hf_greedy(model: Any, path: Path, ids: list[int], images: list[bytes], new: int) -> list[int]:
    """transformers' greedy tokens after ``ids`` (placeholders already expanded)."""
    kwargs: dict[str, Any] = {}
    if images:
        feat = _pixels(path, images)
        kwargs = {"pixel_values": feat["pixel_values"], "image_sizes": feat["image_sizes"]}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()
