"""The worker's image preprocessing against transformers' processor given the same file: an
image with transparency must become the pixels the processor (and vLLM) make of it, its
transparent parts white, not the colour stored under them."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from protos.multimodal import ImageItem, content_hash
from services.engine.vision import preprocess

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def processor():  # type: ignore[no-untyped-def]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    pixels = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 24}
    return Qwen2VLImageProcessorPil(size=pixels)


def _encoded(mode: str, **save: object) -> bytes:
    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (40, 56, 4), dtype=np.uint8)
    rgba[:20, :, 3] = 0  # the top half fully transparent, over random colours
    img = Image.fromarray(rgba, "RGBA")
    if mode == "P":  # a palette image with a transparent index, as GIFs and some PNGs are
        img = img.convert("RGB").quantize(16)
        save = {**save, "transparency": 0}
    elif mode != "RGBA":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG", **save)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "RGB", "L"])
def test_pixels_equal_the_processors_for_the_same_file(processor, mode: str) -> None:  # type: ignore[no-untyped-def]
    data = _encoded(mode)
    with Image.open(io.BytesIO(data)) as img:
        want = processor(images=[img], return_tensors="np")
    grid = tuple(int(v) for v in want["image_grid_thw"][0])
    item = ImageItem(0, 0, grid, content_hash(data), data)  # type: ignore[arg-type]
    np.testing.assert_array_equal(preprocess(processor, item), want["pixel_values"])
