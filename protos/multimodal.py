"""Images in a prompt, as plain data both sides share (torch-free).

A Qwen2-VL prompt holds each image as a run of ``<|image_pad|>`` tokens, one per merged patch
of the resized image; a Mistral 3 prompt (Pixtral's layout) as one ``[IMG]`` per merged patch
with ``[IMG_BREAK]`` ending each row of them and ``[IMG_END]`` the last. The gateway works out
an image's run (``VisionSpec.span``: the image processor's resize arithmetic, ``smart_resize``
or ``pixtral_size``) to expand the chat template's single placeholder and to check the context
length; the worker's image processor must arrive at the same grid. A Gemma 3 image is always
``mm_tokens_per_image`` ``<image_soft_token>`` tokens (the image resized to a fixed square),
wrapped as its processor wraps them: ``\n\n<start_of_image>`` before, ``<end_of_image>\n\n``
after; the chat template's placeholder is ``<start_of_image>``, and the wrapping newlines merge
with newline tokens beside them as the tokenizer would have merged the text (vLLM does too).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protos.errors import ConfigError
from protos.sampling_params import InvalidRequestError

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3", "gemma3")
# served as their language model alone without an image processor (preprocessor_config.json)
_LANGUAGE_ONLY_WITHOUT_PROCESSOR = ("mistral3", "gemma3")
_NEWLINES = 4  # runs of 1 .. 4 newlines a tokenizer may hold as one token (Gemma's do)
MAX_ASPECT_RATIO = 200  # the image processor refuses a more elongated image
MAX_IMAGE_PIXELS = 8192 * 8192  # a larger image is refused before it is decoded (memory)


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt: where its placeholder tokens sit, its patch grid and its bytes."""

    offset: int  # index of its first token (``<|image_pad|>``, ``[IMG]``) in the prompt
    # its run of tokens (Mistral 3: its [IMG_BREAK] and [IMG_END] too; Gemma 3: its image soft
    # tokens, not the start/end tokens and newlines around them)
    num_tokens: int
    grid: tuple[int, int, int]  # (t, h, w) in patches, before the spatial merge
    content_hash: bytes  # of the encoded image: the prefix cache's key for its tokens
    data: bytes  # the encoded image (PNG, JPEG, ...), as the client sent it

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def content_hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The image processor's target size: both sides multiples of ``factor``, the area within
    ``[min_pixels, max_pixels]``, the aspect ratio kept as well as that allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"an image of {width}x{height} pixels is too elongated: the aspect ratio must be at "
            f"most {MAX_ASPECT_RATIO}", "messages"
        )  # fmt: skip
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pixtral_size(height: int, width: int, longest_edge: int, factor: int) -> tuple[int, int]:
    """Pixtral's image processor's target size: scaled down (never up) to fit ``longest_edge``
    on both sides, each side then rounded up to a multiple of ``factor``."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"an image of {width}x{height} pixels is too elongated: the aspect ratio must be at "
            f"most {MAX_ASPECT_RATIO}", "messages"
        )  # fmt: skip
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:  # floor, as transformers (the image stays within longest_edge); a side
        # floored to nothing (a thin image and a small longest_edge) keeps one patch row
        height = max(1, math.floor(height / ratio))
        width = max(1, math.floor(width / ratio))
    return (height - 1) // factor * factor + factor, (width - 1) // factor * factor + factor


@dataclass(frozen=True)
class VisionSpec:
    """What turns an image into placeholder tokens: read from a model directory's
    ``config.json`` and ``preprocessor_config.json``."""

    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    # Mistral 3 (Pixtral): images fit within longest_edge pixels (not an area), each row of
    # merged patches closed by image_break_id, the image by image_end_id; 0 and -1: Qwen-VL's
    longest_edge: int = 0
    image_break_id: int = -1
    image_end_id: int = -1
    # Gemma 3: every image image_size pixels square (its grid fixed), its run wrapped in
    # "\n\n" begin_id ... end_id "\n\n"; the chat template writes begin_id as the placeholder;
    # newlines: the ids of runs of 1 .. 4 newlines (-1 where the vocabulary has none)
    image_size: int = 0
    begin_id: int = -1
    end_id: int = -1
    newlines: tuple[int, ...] = ()

    @classmethod
    def from_dicts(
        cls, config: dict[str, Any], processor: dict[str, Any], tokens: dict[str, int] | None = None
    ) -> VisionSpec:
        """``tokens``: the tokenizer's ids of its special tokens (Mistral 3's image break and
        end tokens are named only there)."""
        vision = config.get("vision_config") or {}
        size = processor.get("size") or {}
        if config.get("model_type") == "mistral3":
            return cls._pixtral(config, vision, size, tokens or {})
        if config.get("model_type") == "gemma3":
            return cls._gemma3(config, vision, processor, tokens or {})
        return cls(
            image_token_id=int(config["image_token_id"]),
            vision_start_id=int(config["vision_start_token_id"]),
            vision_end_id=int(config["vision_end_token_id"]),
            patch_size=int(processor.get("patch_size") or vision.get("patch_size", 14)),
            merge_size=int(processor.get("merge_size") or vision.get("spatial_merge_size", 2)),
            temporal_patch_size=int(
                processor.get("temporal_patch_size") or vision.get("temporal_patch_size", 2)
            ),
            min_pixels=int(
                processor.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels
            ),
            max_pixels=int(
                processor.get("max_pixels") or size.get("longest_edge") or cls.max_pixels
            ),
        )

    @classmethod
    def _pixtral(
        cls, config: dict[str, Any], vision: dict[str, Any], size: dict[str, Any],
        tokens: dict[str, int],
    ) -> VisionSpec:  # fmt: skip
        missing = [t for t in ("[IMG_BREAK]", "[IMG_END]") if t not in tokens]
        if missing:
            raise ConfigError(f"mistral3: the tokenizer lacks the image tokens {missing}")
        return cls(
            image_token_id=int(config.get("image_token_index", config.get("image_token_id", 10))),
            vision_start_id=-1,
            vision_end_id=-1,
            patch_size=int(vision.get("patch_size", 14)),
            merge_size=int(config.get("spatial_merge_size", 2)),
            temporal_patch_size=1,
            longest_edge=int(size.get("longest_edge") or vision.get("image_size") or 1540),
            image_break_id=tokens["[IMG_BREAK]"],
            image_end_id=tokens["[IMG_END]"],
        )

    @classmethod
    def _gemma3(
        cls, config: dict[str, Any], vision: dict[str, Any], processor: dict[str, Any],
        tokens: dict[str, int],
    ) -> VisionSpec:  # fmt: skip
        if processor.get("do_pan_and_scan"):
            raise ConfigError(
                "gemma3: do_pan_and_scan (crops of an image besides the whole one) is not "
                "supported: set it false in preprocessor_config.json"
            )
        size = processor.get("size") or {}
        image_size = int(vision.get("image_size", 224))
        if (size.get("height"), size.get("width")) not in ((None, None), (image_size,) * 2):
            raise ConfigError(
                f"gemma3: the image processor's size {size} is not the vision tower's "
                f"image_size {image_size}"
            )
        patch = int(vision.get("patch_size", 16))  # SiglipVisionConfig's defaults
        side = math.isqrt(int(config.get("mm_tokens_per_image", 256)))
        if side * side != int(config.get("mm_tokens_per_image", 256)) or (
            image_size % patch or (image_size // patch) % side
        ):
            raise ConfigError(
                f"gemma3: mm_tokens_per_image {config.get('mm_tokens_per_image')} must be a "
                f"square whose side divides the {image_size // patch} patches a side"
            )
        newlines = tuple(tokens.get("\n" * k, -1) for k in range(1, _NEWLINES + 1))
        if newlines[1] < 0:
            raise ConfigError("gemma3: the tokenizer has no single token for two newlines")
        return cls(
            image_token_id=int(config.get("image_token_index", config.get("image_token_id", 0))),
            vision_start_id=-1,
            vision_end_id=-1,
            patch_size=patch,
            merge_size=image_size // patch // side,
            temporal_patch_size=1,
            image_size=image_size,
            begin_id=int(config.get("boi_token_index", config.get("boi_token_id", 255999))),
            end_id=int(config.get("eoi_token_index", config.get("eoi_token_id", 256000))),
            newlines=newlines,
        )

    @property
    def placeholder_id(self) -> int:
        """The token the chat template writes for an image (Gemma 3's ``<start_of_image>``)."""
        return self.begin_id if self.image_size else self.image_token_id

    @property
    def lead(self) -> int:
        """The tokens of an image's span before its run (Gemma 3: "\n\n" <start_of_image>)."""
        return 2 if self.image_size else 0

    @classmethod
    def of_model_dir(cls, directory: Path) -> VisionSpec | None:
        """The directory's spec; None for a text-only model."""
        config_path = directory / "config.json"
        if not config_path.is_file():
            return None
        config = json.loads(config_path.read_text())
        if config.get("model_type") not in VL_MODEL_TYPES:
            return None
        pre = directory / "preprocessor_config.json"
        if not pre.is_file() and config["model_type"] in _LANGUAGE_ONLY_WITHOUT_PROCESSOR:
            return None  # served as its language model (services.engine.model_config)
        if not pre.is_file():
            raise ConfigError(
                f"{directory} is a vision-language model without preprocessor_config.json"
            )
        tokens: dict[str, int] = {}
        if config["model_type"] == "mistral3":
            tokens = special_tokens(directory)
        elif config["model_type"] == "gemma3":
            tokens = newline_tokens(directory)
        return cls.from_dicts(config, json.loads(pre.read_text()), tokens)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patches of an image of ``height`` x ``width`` pixels once resized."""
        factor = self.patch_size * self.merge_size
        if self.image_size:  # resized to the tower's square, whatever its shape
            side = self.image_size // self.patch_size
            return 1, side, side
        if self.longest_edge:
            h, w = pixtral_size(height, width, self.longest_edge, factor)
        else:
            h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def features_of(self, grid: tuple[int, int, int]) -> int:
        """The image's embeddings (merged patches): its ``image_token_id`` tokens."""
        t, h, w = grid
        return t * h * w // (self.merge_size**2)

    def tokens_of(self, grid: tuple[int, int, int]) -> int:
        """The image's run of tokens in the prompt."""
        rows = grid[1] // self.merge_size
        return self.features_of(grid) + (rows if self.image_break_id >= 0 else 0)

    def run(self, grid: tuple[int, int, int]) -> list[int]:
        """The image's own run of tokens (its ``ImageItem``'s)."""
        span = self.span(grid)
        return span[self.lead : self.lead + self.tokens_of(grid)]

    def span(self, grid: tuple[int, int, int]) -> list[int]:
        """The tokens an image's placeholder becomes."""
        if self.image_size:  # Gemma 3: wrapped as its processor wraps it
            wrap = self.newlines[1]
            run = [self.image_token_id] * self.features_of(grid)
            return [wrap, self.begin_id, *run, self.end_id, wrap]
        if self.image_break_id < 0:
            return [self.image_token_id] * self.features_of(grid)
        _, h, w = grid
        rows, cols = h // self.merge_size, w // self.merge_size
        out = ([self.image_token_id] * cols + [self.image_break_id]) * rows
        out[-1] = self.image_end_id
        return out


def special_tokens(directory: Path) -> dict[str, int]:
    """The ids of a tokenizer's added tokens, from its tokenizer.json (or, without one,
    tokenizer_config.json's added_tokens_decoder); torch- and tokenizers-free."""
    found: dict[str, int] = {}
    try:
        path = directory / "tokenizer.json"
        if path.is_file():
            for token in json.loads(path.read_text()).get("added_tokens") or ():
                found[str(token["content"])] = int(token["id"])
        path = directory / "tokenizer_config.json"
        if not found and path.is_file():
            decoder = json.loads(path.read_text()).get("added_tokens_decoder") or {}
            found = {str(v["content"]): int(k) for k, v in decoder.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"{directory}: the tokenizer's added tokens are unreadable: {e}"
        ) from None
    return found


def newline_tokens(directory: Path) -> dict[str, int]:
    """The ids of the tokenizer's tokens for runs of 1 .. 4 newlines, by their text, from its
    tokenizer.json (a byte-level vocabulary spells a newline ``Ċ``); torch-free."""
    found: dict[str, int] = {}
    try:
        model = json.loads((directory / "tokenizer.json").read_text()).get("model") or {}
        vocab = model.get("vocab") or {}
        if isinstance(vocab, list):  # Unigram: [piece, score] pairs by id
            vocab = {str(piece[0]): i for i, piece in enumerate(vocab)}
        for k in range(1, _NEWLINES + 1):
            for spelled in ("\n" * k, "Ċ" * k):
                if spelled in vocab:
                    found["\n" * k] = int(vocab[spelled])
                    break
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise ConfigError(f"{directory}: the tokenizer's vocabulary is unreadable: {e}") from None
    return found


def _merge_newlines(out: list[int], token: int, newlines: Sequence[int]) -> bool:
    """Whether ``token`` (a run of newlines) merged into ``out``'s last token (another run)
    as one token of their newlines together, as the tokenizer would have read the text."""
    if not newlines or not out or token not in newlines or out[-1] not in newlines:
        return False
    k = newlines.index(out[-1]) + newlines.index(token) + 2
    if k > len(newlines) or newlines[k - 1] < 0:
        return False
    out[-1] = newlines[k - 1]
    return True


def expand_placeholders(
    prompt: Sequence[int], image_token_id: int, spans: Sequence[int | Sequence[int]],
    lead: int = 0, newlines: Sequence[int] = (),
) -> tuple[list[int], list[int]]:  # fmt: skip
    """Each single ``image_token_id`` of ``prompt`` replaced by its image's run of tokens (a
    count: that many ``image_token_id``); returns the expanded prompt and each image's offset
    in it (of its span's token ``lead``). The placeholders must match the images. ``newlines``
    (Gemma 3): a span's first and last tokens merge with newline tokens beside them."""
    found = sum(1 for t in prompt if t == image_token_id)
    if found != len(spans):
        raise InvalidRequestError(
            f"the prompt has {found} image placeholders but {len(spans)} images were given",
            "messages",
        )
    out: list[int] = []
    offsets: list[int] = []
    images = iter(spans)
    span_end = -1  # where the last span ended in ``out``
    for token in prompt:
        if token == image_token_id:
            span = next(images)
            run = [image_token_id] * span if isinstance(span, int) else list(span)
            merged = bool(run) and _merge_newlines(out, run[0], newlines)
            offsets.append(len(out) + lead - merged)
            out.extend(run[1:] if merged else run)
            span_end = len(out)
        elif not (len(out) == span_end and _merge_newlines(out, token, newlines)):
            out.append(token)
    return out, offsets


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of an encoded image, read with PIL (torch-free), refusing what does not
    decode as an image."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            img.verify()  # a truncated or corrupt file fails here, before any worker sees it
    except Image.DecompressionBombError:  # a small file that declares a huge image
        raise InvalidRequestError(
            f"an image is larger than the {MAX_IMAGE_PIXELS // 10**6} megapixels allowed: "
            "scale it down", "messages"
        ) from None  # fmt: skip
    except UnidentifiedImageError:  # its message would name a BytesIO object
        raise InvalidRequestError(
            f"an image could not be decoded (not a known image format, {len(data)} bytes "
            f"starting {data[:8]!r}); send a PNG, JPEG, WebP or GIF image", "messages"
        ) from None  # fmt: skip
    except (OSError, ValueError, SyntaxError) as exc:
        raise InvalidRequestError(
            f"an image could not be decoded ({type(exc).__name__}: {exc}); send a PNG, JPEG, "
            "WebP or GIF image", "messages"
        ) from None  # fmt: skip
    if width < 1 or height < 1:
        raise InvalidRequestError(f"an image of {width}x{height} pixels is empty", "messages")
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidRequestError(
            f"an image of {width}x{height} pixels is larger than the "
            f"{MAX_IMAGE_PIXELS // 10**6} megapixels allowed: scale it down", "messages"
        )  # fmt: skip
    return width, height


def place_images(
    prompt: Sequence[int], spec: VisionSpec, images: Sequence[bytes]
) -> tuple[list[int], tuple[ImageItem, ...]]:
    """The prompt with each image's placeholder expanded to its token count, and the images."""
    grids = []
    for i, data in enumerate(images):
        try:
            width, height = image_size(data)
            grids.append(spec.grid(height, width))
        except InvalidRequestError as e:
            if len(images) == 1:
                raise
            # the prompt's images in order, as the client sent them
            raise InvalidRequestError(f"image {i + 1} of the prompt: {e}", e.param) from None
    spans = [spec.span(g) for g in grids]
    ids, offsets = expand_placeholders(prompt, spec.placeholder_id, spans, spec.lead, spec.newlines)
    items = tuple(
        ImageItem(o, spec.tokens_of(g), g, content_hash(d), d)
        for o, g, d in zip(offsets, grids, images, strict=True)
    )
    return ids, items
