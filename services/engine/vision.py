"""The worker's side of image input: the model's own image processor (transformers' numpy/PIL
one) turns an image's bytes into patches, the vision tower encodes them, and each step gets
the embeddings of the image tokens it computes and their 3-D rotary positions.

Images are preprocessed when their request is added (``prepare``: off the engine thread on the
serving path, so a bad image is refused alone and resizing never stalls a step); encoder outputs
are kept by content hash (``EncoderCache``) while an image's prompt is prefilled in chunks, and
for a while after, so a chunk never encodes an image again; an image whose tokens the prefix
cache already holds is never encoded at all (no chunk covers it).
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protos.multimodal import ImageItem
from protos.sampling_params import InvalidRequestError
from services.engine.model_config import VisionConfig
from services.engine.models.qwen2_vl import Qwen2VLForCausalLM, mrope_table
from services.engine.mrope import mrope_positions
from services.scheduling.outputs import ScheduledRequest

CACHE_TOKENS = 16384  # image tokens of encoder output kept (LRU)
PENDING_IMAGES = 32  # preprocessed images waiting for their first encode (LRU)


def load_image_processor(model_dir: Path) -> Any:
    """transformers' PIL/numpy image processor of Qwen2-VL (the torchvision one is not usable
    beside this torch build), configured from the model's preprocessor_config.json."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Processor,
        )
    except ImportError:  # transformers before the PIL backend's own module: the slow class
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (  # type: ignore[assignment,no-redef]
            Qwen2VLImageProcessor as Processor,
        )
    return Processor.from_pretrained(str(model_dir))


def to_rgb(img: Any) -> Any:
    """The PIL image as RGB, transparency composited onto white, as transformers' processors
    and vLLM convert it (PIL's plain convert would keep the colour under a transparent pixel)."""
    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img.convert("RGB")
    from PIL import Image

    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def preprocess(processor: Any, image: ImageItem) -> np.ndarray:  # [patches, C*tp*p*p] float32
    """The image's patches; refused if it does not decode or its grid is not the one its
    placeholder tokens were counted for."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(image.data)) as img:
            rgb = to_rgb(img)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidRequestError(f"an image could not be decoded: {exc}", "messages") from None
    feat = processor(images=[rgb], return_tensors="np")
    grid = tuple(int(v) for v in feat["image_grid_thw"][0])
    if grid != image.grid:
        raise InvalidRequestError(
            f"an image's patch grid is {grid} but its placeholder tokens were counted for "
            f"{image.grid}: the gateway and the worker read different image settings",
            "messages",
        )
    return np.asarray(feat["pixel_values"], dtype=np.float32)


class EncoderCache:
    """Vision-tower outputs by image content hash, least recently used dropped first."""

    def __init__(self, max_tokens: int = CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._tokens = 0
        self.encoded = 0  # images run through the vision tower (tests, stats)

    def __contains__(self, key: bytes) -> bool:  # no LRU update: safe from any thread
        return key in self._items

    def get(self, key: bytes) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        self._items[key] = value
        self._tokens += value.shape[0]
        while self._tokens > self.max_tokens and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._tokens -= old.shape[0]


class VisionInputs:
    """What a step of a vision-language model needs beyond token ids."""

    def __init__(self, model: Qwen2VLForCausalLM, cfg: VisionConfig, model_dir: Path) -> None:
        self.model = model
        self.cfg = cfg
        self.processor = load_image_processor(model_dir)
        # Qwen3-VL's rows carry its DeepStack levels beside the embeddings: as many bytes kept
        self.cache = EncoderCache(CACHE_TOKENS // (1 + len(cfg.deepstack_blocks)))
        self._pixels: OrderedDict[bytes, np.ndarray] = OrderedDict()  # by content hash
        self._lock = threading.Lock()  # prepare runs on the callers' threads

    def prepare(self, images: tuple[ImageItem, ...]) -> None:
        """Preprocess each image not yet encoded (InvalidRequestError for a bad one); any
        thread. Images without bytes (a decode worker's) are left alone."""
        for image in images:
            key = image.content_hash
            with self._lock:
                if not image.data or key in self._pixels or key in self.cache:
                    continue
            pixels = preprocess(self.processor, image)
            with self._lock:
                self._pixels[key] = pixels
                while len(self._pixels) > PENDING_IMAGES:
                    self._pixels.popitem(last=False)

    def _pixels_of(self, image: ImageItem) -> np.ndarray:
        with self._lock:
            pixels = self._pixels.pop(image.content_hash, None)
        return pixels if pixels is not None else preprocess(self.processor, image)

    def _encode(self, images: list[ImageItem]) -> dict[bytes, torch.Tensor]:
        """Encode these (distinct, uncached) images in one pass of the vision tower; their
        embeddings by content hash, each also cached."""
        for image in images:
            if not image.data:  # a decode worker got the KV, not the image: cannot recompute
                raise RuntimeError(
                    "an image's tokens must be recomputed (the request was preempted) but this "
                    "worker never received the image's bytes"
                )
        dev = self.model.lm_head.weight.device
        batch = [(torch.from_numpy(self._pixels_of(i)).to(dev), i.grid) for i in images]
        outs = self.model.encode_images(batch)
        for image, out in zip(images, outs, strict=True):
            if out.shape[0] != image.num_tokens:
                raise InvalidRequestError(
                    f"an image encodes to {out.shape[0]} tokens, not {image.num_tokens}",
                    "messages",
                )
        for image, out in zip(images, outs, strict=True):
            self.cache.put(image.content_hash, out)
            self.cache.encoded += 1
        return {image.content_hash: out for image, out in zip(images, outs, strict=True)}

    def embeds(
        self, reqs: list[ScheduledRequest], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step [n], their image embeddings [n, hidden]) for every image token the
        step computes; None when it computes none."""
        spans: list[tuple[int, ImageItem, int, int]] = []  # (row of token 0, image, a, b)
        needed: dict[bytes, ImageItem] = {}
        for r, at in zip(reqs, starts, strict=True):
            lo, hi = r.start_pos, r.start_pos + r.num_new_tokens
            for image in r.images:
                a, b = max(lo, image.offset), min(hi, image.end)
                if a < b:
                    spans.append((at - lo, image, a, b))
                    needed.setdefault(image.content_hash, image)
        # the step's embeddings, read or encoded (all missing ones in one pass) before any is
        # used: a cache smaller than the step's images may drop some of them again meanwhile
        embeds = {h: e for h in needed if (e := self.cache.get(h)) is not None}
        missing = [image for h, image in needed.items() if h not in embeds]
        if missing:
            embeds.update(self._encode(missing))
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for shift, image, a, b in spans:
            parts.append(embeds[image.content_hash][a - image.offset : b - image.offset])
            rows.extend(range(shift + a, shift + b))
        if not rows:
            return None
        dev = parts[0].device
        return torch.tensor(rows, device=dev), torch.cat(parts)

    def rope_table(
        self, reqs: list[ScheduledRequest], starts: list[int], positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The step's [T, D] rotary rows when a chunk reaches into a prompt's images (3-D
        positions there); None when every token's three positions are equal."""
        chunks = [(r, at) for r, at in zip(reqs, starts, strict=True) if r.before_image_end]
        if not chunks:
            return None
        pos3 = positions[None, :].expand(3, -1).clone()  # [3, T]
        for r, at in chunks:
            p = mrope_positions(r.images, self.cfg.spatial_merge_size, r.start_pos,
                                r.num_new_tokens)  # fmt: skip
            pos3[:, at : at + r.num_new_tokens] = torch.from_numpy(p).to(pos3.device)
        return mrope_table(
            self.model.cos_sin, pos3, self.cfg.mrope_section, self.cfg.mrope_interleaved
        )
