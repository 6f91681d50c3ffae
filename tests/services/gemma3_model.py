"""A tiny random Gemma 3 checkpoint with images, offline: transformers'
``Gemma3ForConditionalGeneration`` from a ``Gemma3Config`` with a small SigLIP vision tower (112
pixel images of 14-pixel patches: 8x8 patches pooled to 4x4, 16 image tokens) and a small Gemma 3
language model whose sliding layers' window (6) is narrower than an image, the embedded model's
tokenizer with Gemma 3's image tokens and a chat template that places ``<start_of_image>``, and
Gemma 3's image processor at that size. Shared by the engine parity tests and the serving
end-to-end tests.

The reference prompt is built as transformers' ``Gemma3Processor`` builds one
(``processor_prompt``): each ``<start_of_image>`` of the text replaced by ``\\n\\n`` +
``<start_of_image>`` + the image tokens + ``<end_of_image>`` + ``\\n\\n``, then tokenized; its
``token_type_ids`` (1 at the image tokens) make transformers' mask bidirectional within each
image (``hf_greedy``, eager attention)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from services.engine.llm_engine import load_tokenizer
from tests.services.engine.conftest import tokenizer_dir
from tests.services.vl_model import png

__all__ = ["build", "hf_greedy", "png", "processor_prompt"]

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
VOCAB = 49152 + 8  # the embedded tokenizer's, the special tokens after it
IMAGE_SIZE, PATCH, TOKENS = 112, 14, 16
WINDOW = 6
INIT = 0.02  # varied greedy tokens (0.2: one token repeated whatever the image)
CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] in ('image', 'image_url') %}<start_of_image>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build(path: Path, layers: int = 3) -> Any:
    """Writes the checkpoint, tokenizer and image processor into ``path``; returns
    transformers' model (float32, eval, eager attention: its mask is the bidirectional one)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = load_tokenizer(tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.add_special_tokens({"additional_special_tokens": [BOI, EOI, SOFT]})
    tok.chat_template = CHAT_TEMPLATE
    kinds = ["sliding_attention", "full_attention"] * layers
    text = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 2048, "sliding_window": WINDOW,
        "layer_types": kinds[:layers], "query_pre_attn_scalar": 16,
        "eos_token_id": None, "bos_token_id": None, "pad_token_id": 0,
        "initializer_range": INIT,
    }  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 2, "patch_size": PATCH, "image_size": IMAGE_SIZE,
        "vision_use_head": False,
    }  # fmt: skip
    cfg = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS,
        boi_token_index=tok.convert_tokens_to_ids(BOI),
        eoi_token_index=tok.convert_tokens_to_ids(EOI),
        image_token_index=tok.convert_tokens_to_ids(SOFT), initializer_range=INIT,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers initializes these to zeros / ones: random here, so
        # a wrong norm or projection shows
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name or "position_embedding" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    return model.to(torch.float32).eval()


def _pixels(path: Path, images: list[bytes]) -> torch.Tensor:
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    proc = Gemma3ImageProcessorPil.from_pretrained(str(path))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return proc(images=pil, return_tensors="pt")["pixel_values"]


def processor_prompt(path: Path, text: str, images: list[bytes]) -> list[int]:
    """The ids transformers' Gemma 3 processor gives ``text`` (a rendered chat, one
    ``<start_of_image>`` per image)."""
    assert text.count(BOI) == len(images)
    full = f"\n\n{BOI}{SOFT * TOKENS}{EOI}\n\n"
    return load_tokenizer(path)(text.replace(BOI, full), add_special_tokens=False)["input_ids"]


def hf_greedy(model: Any, path: Path, ids: list[int], images: list[bytes], new: int) -> list[int]:
    """transformers' greedy tokens after ``ids`` (placeholders already expanded), the image
    tokens marked in ``token_type_ids`` as its processor marks them."""
    soft = model.config.image_token_index
    kwargs: dict[str, Any] = {"token_type_ids": torch.tensor([[int(t == soft) for t in ids]])}
    if images:
        kwargs["pixel_values"] = _pixels(path, images)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()
