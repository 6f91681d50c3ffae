"""What the engine tests of image models share: the tiny checkpoint's fixture, chat messages
and prompts with images, the reference run of transformers on the prompt our engine expands,
and the checks every image model passes (the image decides the output, the prefix cache keyed
by image content, bad images refused, the language model alone without the vision tower)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from protos.sampling_params import InvalidRequestError, SamplingParams
from services.engine.llm import LLM
from tests.services.engine.conftest import BESIDE

# what an image sent to a checkpoint served without its vision tower is refused with
LANGUAGE_MODEL_ALONE = r"preprocessor_config\.json, unquant"


def chat(*parts: str) -> list[dict[str, Any]]:
    """One user message: an image part where "<image>" is, text parts otherwise."""
    content = [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def built_fixture(name: str, build: Callable[[Path], Any], fixture: str = "built") -> Any:
    """A module-scoped fixture (named ``fixture``): a tiny random checkpoint ``build`` writes
    in a directory named after ``name`` (the directory, the transformers model)."""

    @pytest.fixture(scope="module", name=fixture)
    def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
        path = tmp_path_factory.mktemp(name)
        return path, build(path)

    return built


@dataclass(frozen=True)
class ImagePrompts:
    """The prompts of one model family: its test images (``png(seed, width, height)``) and its
    transformers reference (``hf_greedy(model, path, ids, images, new)``)."""

    png: Callable[..., bytes]
    hf_greedy: Callable[..., list[int]]
    new: int

    @property
    def greedy(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.new, ignore_eos=True)

    def prompt(self, llm: LLM, parts: tuple[str, ...], images: list[tuple[int, int, int]]) -> dict:
        return {
            "prompt_token_ids": llm.apply_chat_template(chat(*parts)),
            "multi_modal_data": {"image": [self.png(s, w, h) for s, w, h in images]},
        }

    def reference(self, built: tuple[Path, Any], llm: LLM, prompt: dict) -> list[int]:
        """transformers' greedy tokens on the prompt as our engine expands it."""
        ids, _ = llm.encode_with_images(prompt)
        return self.hf_greedy(built[1], built[0], ids, prompt["multi_modal_data"]["image"],
                              self.new)  # fmt: skip

    def check_the_image_decides_the_output(self, llm: LLM) -> None:
        a = llm.generate(self.prompt(llm, ("<image>", "Hi"), [(11, 64, 48)]), self.greedy)
        b = llm.generate(self.prompt(llm, ("<image>", "Hi"), [(12, 64, 48)]), self.greedy)
        assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids

    def check_prefix_cache_keys_image_blocks_by_content(
        self, built: tuple[Path, Any], llm: LLM, count_hits: bool = False
    ) -> None:
        """Two images of one size give the same token ids: the second must not read the
        first's KV; the first again hits the cache and is not encoded again (``count_hits``:
        and the engine's hit counter counts the cached tokens)."""
        greedy = self.greedy
        first = self.prompt(llm, ("<image>", "Say something long about it."), [(21, 112, 112)])
        other = self.prompt(llm, ("<image>", "Say something long about it."), [(22, 112, 112)])
        _, items = llm.encode_with_images(first)
        assert items[0].num_tokens >= llm.engine.kv.block_size  # whole blocks of image tokens
        a = llm.generate(first, greedy)[0]
        b = llm.generate(other, greedy)[0]
        assert b.num_cached_tokens == 0
        assert b.outputs[0].token_ids == self.reference(built, llm, other)
        vision = llm.engine.runner.vision
        assert vision is not None
        encoded = vision.cache.encoded
        hits = llm.engine.stats().prefix_cache_hits
        again = llm.generate(first, greedy)[0]
        assert again.num_cached_tokens >= items[0].end  # the image's blocks came from the cache
        if count_hits:
            assert llm.engine.stats().prefix_cache_hits - hits == again.num_cached_tokens
        assert vision.cache.encoded == encoded  # not encoded again
        assert again.outputs[0].token_ids == a.outputs[0].token_ids

    def check_bad_images_are_refused(self, llm: LLM) -> list[int]:
        """An image that does not decode, and two images for one placeholder, are refused;
        the ids of the one-image prompt, for the model's own checks."""
        ids = llm.apply_chat_template(chat("<image>", "hi"))
        with pytest.raises(InvalidRequestError, match="could not be decoded"):
            llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [b"not a png"]}})
        two = [self.png(1), self.png(2)]
        with pytest.raises(InvalidRequestError, match="1 image placeholders but 2 images"):
            llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": two}}, self.greedy)
        return ids

    def check_the_language_model_alone(self, built: tuple[Path, Any], tmp_path: Path) -> None:
        """Without preprocessor_config.json (a copy in ``tmp_path``), or quantized, the
        checkpoint's language model alone is served, images refused with the reason."""
        for f in built[0].iterdir():
            if f.name != "preprocessor_config.json":
                (tmp_path / f.name).write_bytes(f.read_bytes())
        image = {"prompt": "hi", "multi_modal_data": {"image": [self.png(1)]}}
        for path, kwargs in ((tmp_path, {}), (built[0], {"quantization": "fp8"})):
            with LLM(str(path), **kwargs, **BESIDE) as text:
                assert text.engine.runner.vision is None
                with pytest.raises(InvalidRequestError, match=LANGUAGE_MODEL_ALONE):
                    text.generate(image, self.greedy)
                assert text.generate("hi", self.greedy)[0].outputs[0].finish_reason == "length"
