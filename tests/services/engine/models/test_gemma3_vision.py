"""Gemma 3 with images (the SigLIP tower, Gemma 3's projector, bidirectional attention within
each image) in our engine against transformers' ``Gemma3ForConditionalGeneration`` (float32,
eager attention, a tiny random checkpoint whose sliding window is narrower than an image):
greedy, token for token, with one image, two images and a text-only prompt, batched, and
prefilled in a step budget that would otherwise cut an image (the scheduler keeps each image
whole in one chunk); through the torch references and the Triton kernels (interpreter); the
prompt as transformers' processor builds it; the prefix cache keyed by image content and a hit
that ends inside an image; bad images refused; the config's refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kernels import ops
from protos.multimodal import VisionSpec
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.config import ConfigError
from services.engine.llm import LLM
from tests.services.engine.conftest import BESIDE
from tests.services.engine.image_prompts import ImagePrompts, built_fixture
from tests.services.gemma3_model import TOKENS, build, hf_greedy, png, processor_prompt

# every engine here on the test tokenizer, loaded once (tests/services/engine/_tp_tokenizers.py)
pytestmark = pytest.mark.usefixtures("tokenizers_loaded_once")

IMAGES = ImagePrompts(png, hf_greedy, new=8)
GREEDY = IMAGES.greedy
_prompt = IMAGES.prompt
_REFERENCES: dict[tuple[Any, ...], list[int]] = {}


def _reference(built: tuple[Path, Any], llm: LLM, prompt: dict) -> list[int]:
    """transformers' greedy tokens on the prompt as our engine expands it
    (``ImagePrompts.reference``), computed once per prompt: several tests check the same ones."""
    ids, _ = llm.encode_with_images(prompt)
    key = (str(built[0]), tuple(ids), tuple(prompt["multi_modal_data"]["image"]))
    if key not in _REFERENCES:
        _REFERENCES[key] = IMAGES.reference(built, llm, prompt)
    return list(_REFERENCES[key])


# (chat parts, the images' (seed, width, height))
CASES = [
    (("<image>", "What is in the picture?"), [(1, 64, 48)]),
    (("Compare", "<image>", "and", "<image>", "please."), [(3, 64, 64), (4, 200, 40)]),
    (("No picture here, just text.",), []),
]


built = built_fixture("gemma3", build)


@pytest.fixture(scope="module")
def llm(built: tuple[Path, Any]) -> LLM:
    # a 24-token step budget: chunks would cut the 20-token wrapped images but for the rule
    return LLM(str(built[0]), max_num_batched_tokens=24, enable_prefix_caching=True,
               block_size=8, **BESIDE)  # fmt: skip


def test_the_prompt_holds_the_text_of_transformers_processor(
    built: tuple[Path, Any], llm: LLM
) -> None:
    """The expanded prompt reads as the text transformers' processor tokenizes, its newlines
    merged into one token where the tokenizer has one ("user\n" + "\n\n" before the image:
    three newlines, as transformers' ids have them). The ids are compared as text: this
    byte-level test tokenizer splits "\n\nWord" its own way (Gemma's holds newline runs as
    tokens)."""
    spec = llm.engine.vision_spec
    assert spec is not None
    three = spec.newlines[2]
    for parts, images in CASES:
        prompt = _prompt(llm, parts, images)
        ids, items = llm.encode_with_images(prompt)
        text = llm.tokenizer.decode(prompt["prompt_token_ids"])
        want = processor_prompt(built[0], text, prompt["multi_modal_data"]["image"])
        assert llm.tokenizer.decode(ids) == llm.tokenizer.decode(want)
        if images and parts[0] == "<image>":
            assert ids[: ids.index(spec.begin_id)] == want[: want.index(spec.begin_id)]
            assert ids[ids.index(spec.begin_id) - 1] == three
        for item in items:  # the item: the image soft tokens alone, begin/end tokens beside
            assert item.num_tokens == TOKENS and item.grid == (1, 8, 8)
            assert ids[item.offset : item.end] == [spec.image_token_id] * TOKENS
            assert (ids[item.offset - 1], ids[item.end]) == (spec.begin_id, spec.end_id)


def test_greedy_equals_transformers_batched_and_chunked(built: tuple[Path, Any], llm: LLM) -> None:
    prompts = [_prompt(llm, parts, images) for parts, images in CASES]
    want = [_reference(built, llm, p) for p in prompts]
    results = llm.generate(prompts, GREEDY)  # all in one batch, 24 tokens a step
    assert [r.outputs[0].token_ids for r in results] == want
    for prompt, w in zip(prompts, want, strict=True):  # one at a time
        assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == w


def test_causal_image_attention_gives_other_tokens(
    built: tuple[Path, Any], llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test can fail: with the image spans dropped (causal attention over the image) the
    tokens are not transformers'."""
    import services.engine.model_runner as runner

    prompt = _prompt(llm, CASES[1][0], CASES[1][1])
    want = _reference(built, llm, prompt)
    monkeypatch.setattr(runner, "span_last", lambda reqs: None)
    with LLM(str(built[0]), max_num_batched_tokens=24, **BESIDE) as causal:
        assert causal.generate(prompt, GREEDY)[0].outputs[0].token_ids != want


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels on the CPU: TRITON_INTERPRET=1",
)
def test_through_the_triton_kernels(
    built: tuple[Path, Any], llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The language model's norms, rotary, KV writes and attention (the image spans, the
    sliding window on top) in the Triton kernels under the interpreter, chunked: transformers'
    tokens for one image and two."""
    from kernels import triton_attention, triton_layers

    kernels = {"triton_attention": triton_attention, "triton_layers": triton_layers}
    monkeypatch.setattr(ops, "_triton", lambda name, x: kernels.get(name))
    prompts = [_prompt(llm, parts, images) for parts, images in CASES[:2]]
    want = [_reference(built, llm, p) for p in prompts]
    with LLM(str(built[0]), max_num_batched_tokens=24, block_size=16, **BESIDE) as tri:
        assert [r.outputs[0].token_ids for r in tri.generate(prompts, GREEDY)] == want


def test_two_ranks_give_the_tokens_of_one(built: tuple[Path, Any], llm: LLM) -> None:
    """The language model split over two ranks (Gloo), the tower and projector whole on each:
    the greedy tokens of one rank."""
    prompts = [_prompt(llm, parts, images) for parts, images in CASES[:2]]
    want = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    with LLM(str(built[0]), max_num_batched_tokens=24, tensor_parallel_size=2, **BESIDE) as tp:
        assert [r.outputs[0].token_ids for r in tp.generate(prompts, GREEDY)] == want


def test_prefix_cache_by_image_content_and_a_hit_inside_an_image(
    built: tuple[Path, Any], llm: LLM
) -> None:
    """Two images give the same token ids: the second must not read the first's KV; the first
    again hits the cache past its image and is not encoded again. Then the same image before
    other words: its hit (8-token blocks) ends inside the image, computed whole before, and
    the chunk after it takes the image's rest: transformers' tokens still."""
    text = "Say something long about it."
    first = _prompt(llm, ("<image>", text), [(21, 112, 112)])
    other = _prompt(llm, ("<image>", text), [(22, 112, 112)])
    inside = _prompt(llm, ("<image>", "Tell me more."), [(21, 112, 112)])
    _, (item,) = llm.encode_with_images(inside)
    assert (item.offset, item.end) == (4, 20)  # the hit at 16 (the words differ at 22)
    a = llm.generate(first, GREEDY)[0]
    b = llm.generate(other, GREEDY)[0]
    assert b.num_cached_tokens == 0
    assert b.outputs[0].token_ids == _reference(built, llm, other)
    vision = llm.engine.runner.vision
    assert vision is not None
    encoded = vision.cache.encoded
    again = llm.generate(first, GREEDY)[0]
    assert again.num_cached_tokens >= item.end  # the image's blocks came from the cache
    assert again.outputs[0].token_ids == a.outputs[0].token_ids == _reference(built, llm, first)
    hit = llm.generate(inside, GREEDY)[0]
    assert hit.num_cached_tokens == 16
    assert hit.outputs[0].token_ids == _reference(built, llm, inside)
    assert vision.cache.encoded == encoded  # its embeddings from the encoder cache


def test_bad_image_input_is_refused(llm: LLM) -> None:
    ids = IMAGES.check_bad_images_are_refused(llm)
    spec = llm.engine.vision_spec
    assert spec is not None
    soft = ids + [spec.image_token_id] * 3  # image tokens without an image
    with pytest.raises(InvalidRequestError, match="image tokens"):
        llm.generate({"prompt_token_ids": soft}, GREEDY)


def test_refusals_and_the_language_model_alone(built: tuple[Path, Any], tmp_path: Path) -> None:
    """A step budget below an image's tokens is refused at start; pan-and-scan is refused;
    without preprocessor_config.json, or quantized, the language model alone serves (images
    refused with the reason)."""
    with pytest.raises(ConfigError, match="raise it to at least 16"):
        LLM(str(built[0]), max_num_batched_tokens=15, **BESIDE)
    config = json.loads((built[0] / "config.json").read_text())
    pre = json.loads((built[0] / "preprocessor_config.json").read_text())
    with pytest.raises(ConfigError, match="do_pan_and_scan"):
        VisionSpec.from_dicts(config, {**pre, "do_pan_and_scan": True}, {"\n\n": 5})
    with pytest.raises(ConfigError, match="mm_tokens_per_image 15"):
        VisionSpec.from_dicts({**config, "mm_tokens_per_image": 15}, pre, {"\n\n": 5})
    IMAGES.check_the_language_model_alone(built, tmp_path)


def test_the_hub_and_module_tree_tensor_names_load(built: tuple[Path, Any], tmp_path: Path) -> None:
    """The tensors as the Hub's checkpoints name them (transformers 4: the tower under
    ``vision_tower.vision_model.``) and as transformers 5's module tree names them
    (``model.vision_tower.``, ``model.multi_modal_projector.``, ``model.language_model.``):
    the same tokens as transformers' own save."""
    from safetensors.torch import load_file, save_file

    (file,) = built[0].glob("*.safetensors")
    stored = load_file(str(file))
    hub = {
        k.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if k.startswith("vision_tower.")
        else k: v
        for k, v in stored.items()
    }
    tree = {
        "model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else k: v
        for k, v in stored.items()
    }
    tree = {
        k.replace("language_model.model.", "model.language_model.", 1): v for k, v in tree.items()
    }
    prompt = None
    want = None
    for i, names in enumerate((hub, tree)):
        path = tmp_path / str(i)
        path.mkdir()
        for f in built[0].iterdir():
            if not f.name.endswith(".safetensors"):
                (path / f.name).write_bytes(f.read_bytes())
        save_file(names, str(path / "model.safetensors"))
        with LLM(str(path), max_num_batched_tokens=24, **BESIDE) as other:
            if prompt is None:
                prompt = _prompt(other, CASES[0][0], CASES[0][1])
                want = _reference(built, other, prompt)
            assert other.generate(prompt, GREEDY)[0].outputs[0].token_ids == want


def test_the_device_default_budget_holds_an_image(
    built: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --max-num-batched-tokens the step budget is the device's default, plus one
    image's tokens where it is below them (a real Gemma 3's 256 against the CPU's 128: 384, so
    requests decoding beside an image do not hold it back): the engine starts and serves an
    image, where an explicit budget below it is refused."""
    from services import config as service_config

    monkeypatch.setattr(service_config, "CPU_TOKEN_BUDGET", 8)  # the tiny model's image: 16
    with LLM(str(built[0]), **BESIDE) as small:
        assert small.engine.config.scheduler.token_budget == 8 + 16
        prompt = _prompt(small, ("Look:", "<image>", "what is it?"), [(3, 40, 60)])
        (out,) = small.generate([prompt], SamplingParams(max_tokens=3, temperature=0))
        assert out.outputs[0].token_ids == _reference(built, small, prompt)[:3]
