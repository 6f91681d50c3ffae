"""Qwen2-VL, Qwen2.5-VL (windowed vision attention) and Qwen3-VL (learned patch positions,
DeepStack, interleaved M-RoPE) with images in our engine against transformers (float32, tiny
random checkpoints): greedy, token for token, with one and two images per prompt, batched and
chunked; the prefix cache keyed by image content; images refused where they cannot be served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from protos.sampling_params import InvalidRequestError
from services.engine.llm import LLM
from tests.services.engine.conftest import BESIDE
from tests.services.engine.image_prompts import ImagePrompts
from tests.services.vl_model import build, hf_greedy, png

# every engine here on the test tokenizer, loaded once (tests/services/engine/_tp_tokenizers.py)
pytestmark = pytest.mark.usefixtures("tokenizers_loaded_once")

IMAGES = ImagePrompts(png, hf_greedy, new=10)
GREEDY = IMAGES.greedy
_prompt, _reference = IMAGES.prompt, IMAGES.reference


# (chat parts, the images' (seed, width, height))
CASES = [
    (("<image>", "What is in the picture?"), [(1, 64, 48)]),
    (("Describe", "<image>", "briefly."), [(2, 30, 200)]),  # tall: a 1-D-ish grid
    (("<image>", "and", "<image>", "differ how?"), [(3, 64, 64), (4, 100, 40)]),
    (("Compare", "<image>", "<image>"), [(5, 56, 56), (5, 56, 56)]),  # one image twice
]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def built(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(request.param)
    return path, build(path, request.param)


@pytest.fixture(scope="module")
def llm(built: tuple[Path, Any]) -> LLM:
    # a 16-token step budget: the prompts are prefilled in chunks that cut through images
    return LLM(str(built[0]), max_num_batched_tokens=16, enable_prefix_caching=True, **BESIDE)


def test_greedy_equals_transformers_batched_and_chunked(built: tuple[Path, Any], llm: LLM) -> None:
    prompts = [_prompt(llm, parts, images) for parts, images in CASES]
    results = llm.generate(prompts, GREEDY)  # all four in one batch
    for prompt, res in zip(prompts, results, strict=True):
        assert res.outputs[0].token_ids == _reference(built, llm, prompt)


def test_two_ranks_give_the_tokens_of_one(built: tuple[Path, Any], llm: LLM) -> None:
    """The language model split over two ranks (Gloo), the vision tower whole on each: every
    rank encodes the step's images (their bytes travel with the step), the same greedy tokens
    as one rank, through prompts whose chunks cut through images. Qwen2.5-VL (its vision MLP
    has the language model's projection names, never to be cut) and Qwen3-VL (DeepStack into
    the split layers); Qwen2-VL's language model is Qwen2.5-VL's (the suite's time)."""
    if built[1].config.model_type == "qwen2_vl":
        pytest.skip("the language model of qwen2_5_vl's case")
    prompts = [_prompt(llm, parts, images) for parts, images in CASES[:3]]
    want = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    tp = LLM(str(built[0]), max_num_batched_tokens=16, tensor_parallel_size=2, **BESIDE)
    try:
        assert [r.outputs[0].token_ids for r in tp.generate(prompts, GREEDY)] == want
    finally:
        tp.close()


def test_the_image_decides_the_output(llm: LLM) -> None:
    IMAGES.check_the_image_decides_the_output(llm)


def test_prefix_cache_keys_image_blocks_by_content(built: tuple[Path, Any], llm: LLM) -> None:
    """Two images of one size give the same placeholder ids: the second must not read the
    first's KV; the first again hits the cache (counted) and is not encoded again."""
    IMAGES.check_prefix_cache_keys_image_blocks_by_content(built, llm, count_hits=True)


def test_bad_image_input_is_refused(llm: LLM, built: tuple[Path, Any]) -> None:
    ids = IMAGES.check_bad_images_are_refused(llm)
    # placeholder tokens that no image covers
    with pytest.raises(InvalidRequestError, match="image tokens"):
        llm.generate(ids, GREEDY)


def test_a_text_only_model_refuses_images() -> None:
    text = LLM("embedded", max_model_len=256)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text.generate({"prompt": "hi", "multi_modal_data": {"image": [png(1)]}}, GREEDY)


def test_an_image_is_checked_when_added_not_in_a_step(llm: LLM) -> None:
    """What reaches the engine without the gateway's checks (a gRPC client of a worker): an
    image that does not decode, or whose grid is not the one its tokens were counted for, is
    refused as the request is added; the engine goes on serving."""
    from dataclasses import replace

    from protos.multimodal import content_hash

    prompt = _prompt(llm, ("<image>", "hi"), [(51, 56, 56)])
    ids, (image,) = llm.encode_with_images(prompt)
    junk = replace(image, data=b"junk", content_hash=content_hash(b"junk"))
    with pytest.raises(InvalidRequestError, match="could not be decoded"):
        llm.engine.add_request("junk", ids, GREEDY, images=[junk])
    other = png(52, 112, 112)  # 4x4 merged patches, not the 2x2 of the placeholders
    wrong = replace(image, data=other, content_hash=content_hash(other))
    with pytest.raises(InvalidRequestError, match="patch grid"):
        llm.engine.add_request("wrong", ids, GREEDY, images=[wrong])
    assert not llm.engine.has_unfinished
    assert llm.generate(prompt, GREEDY)[0].outputs[0].finish_reason == "length"


def test_preempted_on_a_decode_worker_that_has_the_bytes_it_recomputes(
    built: tuple[Path, Any],
) -> None:
    """The gateway sends a decode worker the images' bytes too (not preprocessed unless
    needed): preempted, the request recomputes its images' tokens and ends as it would have."""
    # no prefix cache: the reservation's blocks never got real KV here (no prefill worker)
    with LLM(str(built[0]), enable_prefix_caching=False) as dec:
        prompt = _prompt(dec, ("<image>", "hi"), [(63, 84, 84)])
        want = dec.generate(prompt, GREEDY)[0].outputs[0].token_ids
        ids, (image,) = dec.encode_with_images(prompt)
        engine = dec.engine
        assert engine.reserve_for("dec", len(ids), GREEDY) is not None
        assert engine.activate("dec", ids, want[:1], GREEDY, images=[image]) is None
        engine.scheduler._preempt(engine.scheduler.requests["dec"])  # as KV pressure would
        got, reasons = list(want[:1]), []
        while engine.has_unfinished:
            for out in engine.step():
                got += out.token_ids
                reasons.append(out.finish_reason)
        assert reasons[-1] == "length" and "error" not in reasons
        assert got == want


def test_a_decode_side_request_that_lost_its_image_kv_fails_alone(llm: LLM) -> None:
    """A decode worker holds an image's KV, not its bytes: preempted (its KV freed), the
    request cannot be recomputed and ends with an error; the engine goes on."""
    from dataclasses import replace

    engine = llm.engine
    ids, (image,) = llm.encode_with_images(_prompt(llm, ("<image>", "hi"), [(61, 84, 84)]))
    assert engine.reserve_for("dec", len(ids), GREEDY) is not None
    engine.activate("dec", ids, [5], GREEDY, images=[replace(image, data=b"")])
    engine.scheduler._preempt(engine.scheduler.requests["dec"])  # as KV pressure would
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("dec", "error")]
    assert "cannot recompute" in (outputs[0].error or "")
    assert not engine.has_unfinished
    assert llm.generate(_prompt(llm, ("<image>", "hi"), [(62, 84, 84)]), GREEDY)[0].outputs
