"""Multimodal rotary positions (M-RoPE, Qwen2-VL): three position ids (t, h, w) per token.

A text token has the same id on all three axes. An image's tokens sit on its merged patch grid:
t, row and column, each offset by the position the image starts at; the text after it goes on
from the image's largest extent, so a prompt with images ends below its length. That shortfall,
``rope_delta`` (<= 0), shifts every later token: a decoded token at index i has position
i + rope_delta on all three axes (what transformers keeps as ``rope_deltas``), which is why a
decode step needs no 3-D positions, only the offset. Torch-free arithmetic on numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protos.multimodal import ImageItem


def _llm_grid(image: ImageItem, merge: int) -> tuple[int, int, int]:
    t, h, w = image.grid
    return t, h // merge, w // merge


def rope_delta(images: Sequence[ImageItem], merge: int) -> int:
    """Position minus index of every token after the last image (0 without images)."""
    delta = 0
    for image in images:
        _, h, w = _llm_grid(image, merge)
        delta += max(h, w) - image.num_tokens  # transformers' extent of an image: max(h, w)
    return delta


def mrope_positions(
    images: Sequence[ImageItem], merge: int, start: int, n: int
) -> np.ndarray:  # [3, n] int64: the positions of tokens start .. start + n
    idx = np.arange(start, start + n, dtype=np.int64)
    out = np.empty((3, n), dtype=np.int64)
    shift = np.zeros(n, dtype=np.int64)  # of the text tokens: the images before them
    in_image = np.zeros(n, dtype=bool)
    delta = 0
    for image in sorted(images, key=lambda im: im.offset):
        _, h, w = _llm_grid(image, merge)
        inside = (idx >= image.offset) & (idx < image.end)
        if inside.any():
            base = image.offset + delta  # the position the image starts at
            k = idx[inside] - image.offset  # raster order: t, then rows, then columns
            out[0, inside] = base + k // (h * w)
            out[1, inside] = base + (k // w) % h
            out[2, inside] = base + k % w
            in_image |= inside
        step = max(h, w) - image.num_tokens
        shift[idx >= image.end] += step
        delta += step
    text = ~in_image
    out[:, text] = (idx + shift)[text]
    return out
