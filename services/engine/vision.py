"""The worker's side of image input: the model's own image processor (transformers' numpy/PIL
one) turns an image's bytes into patches, the vision tower encodes them, and each step gets
the embeddings of the image tokens it computes and (Qwen-VL) their 3-D rotary positions. A
Mistral 3 image's run of tokens holds an ``[IMG_BREAK]`` after each row of ``[IMG]`` tokens
(``[IMG_END]`` after the last): those keep their token embeddings (``feature_index``). A Gemma 3
image's tokens attend to each other both ways: ``span_last`` gives the prefill kernels each
step row's bound (its image's last token), and the scheduler keeps every image whole in one
chunk (``Request.whole_images``).

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
from services.engine.models.gemma3_vision import Gemma3VLForCausalLM
from services.engine.models.mistral3 import Mistral3ForCausalLM
from services.engine.models.qwen2_vl import Qwen2VLForCausalLM, mrope_table
from services.engine.mrope import mrope_positions
from services.scheduling.outputs import ScheduledRequest

CACHE_TOKENS = 16384  # image tokens of encoder output kept (LRU)
PENDING_IMAGES = 32  # preprocessed images waiting for their first encode (LRU)


def load_image_processor(model_dir: Path, model_type: str = "qwen2_vl") -> Any:
    """transformers' PIL/numpy image processor of Qwen2-VL or Pixtral (Mistral 3; the torchvision
    ones are not usable beside this torch build), configured from the model's
    preprocessor_config.json."""
    if model_type == "mistral3":
        from transformers.models.pixtral.image_processing_pil_pixtral import (
            PixtralImageProcessorPil,
        )

        return PixtralImageProcessorPil.from_pretrained(str(model_dir))
    if model_type == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        return Gemma3ImageProcessorPil.from_pretrained(str(model_dir))
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


def _pixtral_patches(
    processor: Any, rgb: Any, cfg: VisionConfig
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Pixtral's resized, normalized image cut into patches [h*w, C*p*p] (raster order, as the
    patch convolution reads them), and its grid: the processor sizes images in merged patches
    (as transformers' Mistral 3 processor asks it to)."""
    p, m = cfg.patch_size, cfg.spatial_merge_size
    feat = processor(images=[rgb], patch_size={"height": p * m, "width": p * m},
                     return_tensors="np")  # fmt: skip
    return _raster_patches(feat["pixel_values"][0], p)


def _gemma3_patches(
    processor: Any, rgb: Any, cfg: VisionConfig
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Gemma 3's image (resized to the tower's square, rescaled, normalized; no pan-and-scan
    crops) cut into patches [h*w, C*p*p] in raster order, and its grid."""
    feat = processor(images=[rgb], do_pan_and_scan=False, return_tensors="np")
    return _raster_patches(feat["pixel_values"][0], cfg.patch_size)


def _raster_patches(image: Any, p: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """An image [C, H, W] cut into ``p`` x ``p`` patches [h*w, C*p*p] in raster order (as a
    patch convolution reads them), and its grid (1, h, w)."""
    pixels = np.asarray(image, dtype=np.float32)
    c, height, width = pixels.shape
    h, w = height // p, width // p
    patches = pixels.reshape(c, h, p, w, p).transpose(1, 3, 0, 2, 4).reshape(h * w, c * p * p)
    return np.ascontiguousarray(patches), (1, h, w)


def preprocess(
    processor: Any, image: ImageItem, cfg: VisionConfig | None = None
) -> np.ndarray:  # [patches, C*tp*p*p] float32
    """The image's patches; refused if it does not decode or its grid is not the one its
    placeholder tokens were counted for."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(image.data)) as img:
            rgb = to_rgb(img)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidRequestError(f"an image could not be decoded: {exc}", "messages") from None
    if cfg is not None and cfg.model_type == "mistral3":
        patches, grid = _pixtral_patches(processor, rgb, cfg)
    elif cfg is not None and cfg.model_type == "gemma3":
        patches, grid = _gemma3_patches(processor, rgb, cfg)
    else:
        feat = processor(images=[rgb], return_tensors="np")
        grid = tuple(int(v) for v in feat["image_grid_thw"][0])
        patches = np.asarray(feat["pixel_values"], dtype=np.float32)
    if grid != image.grid:
        raise InvalidRequestError(
            f"an image's patch grid is {grid} but its placeholder tokens were counted for "
            f"{image.grid}: the gateway and the worker read different image settings",
            "messages",
        )
    return patches


def feature_index(cfg: VisionConfig, image: ImageItem, a: int, b: int) -> torch.Tensor:
    """Of the image's tokens a .. b (prompt indices), the embeddings row (of its encoder
    output) of each that takes one, -1 for each that keeps its token embedding (Mistral 3's
    [IMG_BREAK] and [IMG_END]: one after each row of merged patches)."""
    k = torch.arange(a - image.offset, b - image.offset)
    if cfg.model_type != "mistral3":  # Qwen-VL, Gemma 3: every token
        return k
    width = image.grid[2] // cfg.spatial_merge_size + 1  # a row of [IMG], then its break
    return torch.where(k % width == width - 1, -1, k - k // width)


def num_features(cfg: VisionConfig, image: ImageItem) -> int:
    """The image's embeddings (its merged patches)."""
    t, h, w = image.grid
    return t * h * w // cfg.spatial_merge_size**2


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


def span_last(reqs: list[ScheduledRequest]) -> np.ndarray | None:
    """The step's [T] int32 ``span_last`` of the prefill kernels (Gemma 3), ``reqs`` in the
    step's row order: at each image token the position of its image's last token, 0 at every
    other row; None when no row is an image token. Every image must end within its chunk."""
    rows = np.zeros(sum(r.num_new_tokens for r in reqs), np.int32)
    at, found = 0, False
    for r in reqs:
        lo, hi = r.start_pos, r.start_pos + r.num_new_tokens
        for image in r.images:
            a, b = max(lo, image.offset), min(hi, image.end)
            if a >= b:
                continue
            if image.end > hi:  # the scheduler never cuts an image (Request.whole_images)
                raise RuntimeError(
                    f"request {r.request_id}: its prefill chunk {lo}..{hi} cuts its image "
                    f"{image.offset}..{image.end}, whose tokens attend to each other"
                )
            rows[at + a - lo : at + b - lo] = image.end - 1
            found = True
        at += r.num_new_tokens
    return rows if found else None


class VisionInputs:
    """What a step of a vision-language model needs beyond token ids."""

    def __init__(
        self, model: Qwen2VLForCausalLM | Mistral3ForCausalLM | Gemma3VLForCausalLM,
        cfg: VisionConfig, model_dir: Path,
    ) -> None:  # fmt: skip
        self.model = model
        self.cfg = cfg
        self.processor = load_image_processor(model_dir, cfg.model_type)
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
            pixels = preprocess(self.processor, image, self.cfg)
            with self._lock:
                self._pixels[key] = pixels
                while len(self._pixels) > PENDING_IMAGES:
                    self._pixels.popitem(last=False)

    def _pixels_of(self, image: ImageItem) -> np.ndarray:
        with self._lock:
            pixels = self._pixels.pop(image.content_hash, None)
        return pixels if pixels is not None else preprocess(self.processor, image, self.cfg)

    def _encode(self, images: list[ImageItem]) -> dict[bytes, torch.Tensor]:
        """Encode these (distinct, uncached) images in one pass of the vision tower; their
        embeddings by content hash, each also cached."""
        for image in images:
            if not image.data:  # a decode worker got the KV, not the image: cannot recompute
                raise RuntimeError(
                    "an image's tokens must be recomputed (the request was preempted) but this "
                    "worker never received the image's bytes"
                )
        dev = self.model.model.embed_tokens.weight.device  # (lm_head may hold no dense weight)
        batch = [(torch.from_numpy(self._pixels_of(i)).to(dev), i.grid) for i in images]
        outs = self.model.encode_images(batch)
        for image, out in zip(images, outs, strict=True):
            if out.shape[0] != num_features(self.cfg, image):
                raise InvalidRequestError(
                    f"an image encodes to {out.shape[0]} tokens, not "
                    f"{num_features(self.cfg, image)}", "messages",
                )  # fmt: skip
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
        rows: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        for shift, image, a, b in spans:
            enc, step_rows = embeds[image.content_hash], torch.arange(shift + a, shift + b)
            if not self.cfg.mrope:  # Mistral 3: not every token of the run is an embedding
                index = feature_index(self.cfg, image, a, b)
                taken = index >= 0
                parts.append(enc[index[taken].to(enc.device)])
                rows.append(step_rows[taken])
            else:
                parts.append(enc[a - image.offset : b - image.offset])
                rows.append(step_rows)
        if not parts or sum(p.shape[0] for p in parts) == 0:
            return None
        dev = parts[0].device
        return torch.cat(rows).to(dev), torch.cat(parts)

    def rope_table(
        self, reqs: list[ScheduledRequest], starts: list[int], positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The step's [T, D] rotary rows when a chunk reaches into a prompt's images (3-D
        positions there); None when every token's three positions are equal."""
        chunks = [(r, at) for r, at in zip(reqs, starts, strict=True) if r.before_image_end]
        if not chunks or not self.cfg.mrope:
            return None
        pos3 = positions[None, :].expand(3, -1).clone()  # [3, T]
        for r, at in chunks:
            p = mrope_positions(r.images, self.cfg.spatial_merge_size, r.start_pos,
                                r.num_new_tokens)  # fmt: skip
            pos3[:, at : at + r.num_new_tokens] = torch.from_numpy(p).to(pos3.device)
        return mrope_table(
            self.model.cos_sin, pos3, self.cfg.mrope_section, self.cfg.mrope_interleaved
        )
