"""Images in chat messages: OpenAI's ``image_url`` content parts, decoded and checked here (an
http(s) URL is kept for ``gateway.flows.image_fetch``, which fetches it when the gateway allows);
placed into the prompt (each placeholder expanded to the image's token count) by
``place_images``. Torch-free: PIL reads the image's size."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from typing import Any

from gateway.core.errors import invalid
from gateway.flows.image_fetch import ImageURL
from protos.multimodal import ImageItem, VisionSpec, place_images
from protos.sampling_params import InvalidRequestError

_DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<payload>.*)", re.DOTALL)


# OpenAI's image_url.detail: "low" asks for a 512-pixel downscale, which is not done here
DETAILS = (None, "auto", "high")


def image_from_part(part: dict[str, Any], param: str) -> bytes | ImageURL:
    """The encoded image of an ``{"type": "image_url", "image_url": {"url": ...}}`` part, or
    its http(s) URL (fetched, if the gateway allows, once the request is parsed)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    detail = ref.get("detail") if isinstance(ref, dict) else None
    if detail not in DETAILS:
        raise invalid(
            f"{param}: image_url.detail {detail!r} is not supported: images are processed at "
            "their own resolution within the model's pixel bounds (send 'auto' or 'high', or "
            "resize the image yourself)", param
        )  # fmt: skip
    if not isinstance(url, str) or not url:
        raise invalid(f"{param}: an image_url part needs image_url.url (a data: URL)", param)
    if url[:8].lower().startswith(("http://", "https://")):
        return ImageURL(url, param)
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise invalid(f"{param}: image_url.url must be a data: URL (data:image/png;base64,...) "
                      "or, where the gateway fetches images, an https URL", param)  # fmt: skip
    if not match["mime"].startswith("image/"):
        raise invalid(
            f"{param}: the data URL holds {match['mime'] or 'text/plain'!r}, not an image "
            "(image/png, image/jpeg, ...)", param
        )  # fmt: skip
    if ";base64" not in match["params"]:
        raise invalid(f"{param}: an image data URL must be base64 (data:image/png;base64,...)",
                      param)  # fmt: skip
    try:
        return base64.b64decode(match["payload"], validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{param}: the image data URL is not valid base64", param) from None


def check_images(count: int, spec: VisionSpec | None, limit: int | None, model: str) -> None:
    """A 400 for images the model cannot take, or more than ``--limit-mm-per-prompt``."""
    if spec is None:
        raise invalid(
            f"the model {model!r} is served for text only and takes no images: drop the "
            "image_url parts, or serve a vision-language model (Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL, Mistral 3, Gemma 3)", "messages"
        )  # fmt: skip
    if limit is not None and count > limit:
        raise invalid(
            f"the prompt has {count} images but at most {limit} are allowed per prompt "
            "(--limit-mm-per-prompt)", "messages"
        )  # fmt: skip


def images_in_prompt(
    ids: Sequence[int], images: Sequence[bytes], spec: VisionSpec
) -> tuple[list[int], tuple[ImageItem, ...]]:
    """The prompt with its images placed (each placeholder expanded); a 400 for an image that
    does not decode or a placeholder count that does not match."""
    try:
        return place_images(ids, spec, images)
    except InvalidRequestError as e:
        raise invalid(str(e), "messages") from e
