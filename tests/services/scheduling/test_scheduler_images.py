"""Whole images (Gemma 3: an image's tokens attend to each other both ways, so one prefill
chunk computes them all): a chunk that would end inside an image ends before it, or takes the
rest of it when the image starts the chunk (past the long-prefill threshold, within the step's
budget); a prefix-cache hit that ends inside an image is kept and the chunk after it takes the
rest of the image; models whose images need not be whole are cut anywhere, as before."""

from __future__ import annotations

from protos.multimodal import ImageItem
from services.scheduling.outputs import SchedulerOutput
from services.scheduling.request import Request
from tests.services.scheduling.conftest import make_request, make_scheduler
from tests.services.scheduling.simulation import FakeEngine


def _with_images(req: Request, spans: list[tuple[int, int]], whole: bool = True) -> Request:
    req.images = tuple(
        ImageItem(o, n, (1, 4, 4), bytes([i]) * 16, b"png") for i, (o, n) in enumerate(spans)
    )
    req.whole_images = whole
    return req


def _chunks(out: SchedulerOutput, rid: str) -> list[tuple[int, int]]:
    return [(r.start_pos, r.start_pos + r.num_new_tokens) for r in out.requests
            if r.request_id == rid]  # fmt: skip


def _prefill(engine: FakeEngine, rid: str, steps: int = 20) -> list[tuple[int, int]]:
    req = engine.scheduler.requests[rid]
    chunks: list[tuple[int, int]] = []
    for _ in range(steps):
        if req.num_computed_tokens >= req.num_prompt_tokens:
            break
        chunks += _chunks(engine.step(), rid)
    return chunks


def test_a_chunk_ends_before_an_image_and_the_next_holds_it_whole() -> None:
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=20))
    req = _with_images(make_request("a", 60, max_tokens=2), [(5, 16), (30, 16)])
    engine.add(req)
    # 20 tokens would end inside the first image (5..21): the chunk stops at 5, the next holds
    # 5..21 and stops before the second (30..46), which the one after holds whole
    assert _prefill(engine, "a") == [(0, 5), (5, 25), (25, 30), (30, 50), (50, 60)]
    engine.run()


def test_an_image_that_starts_a_chunk_outgrows_the_long_prefill_threshold() -> None:
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=20, long_prefill_token_threshold=8))
    req = _with_images(make_request("a", 30, max_tokens=2), [(3, 16)])
    engine.add(req)
    assert _prefill(engine, "a") == [(0, 3), (3, 19), (19, 27), (27, 30)]
    engine.run()


def test_an_image_waits_for_a_step_with_room_for_it() -> None:
    """The second request's image does not fit what the first leaves of the step: its chunk
    stops before the image, and the image comes whole in a later step."""
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=20))
    a = make_request("a", 12, max_tokens=3)
    b = _with_images(make_request("b", 30, max_tokens=2), [(2, 16)])
    engine.add(a, b)
    first = engine.step()
    assert _chunks(first, "a") == [(0, 12)] and _chunks(first, "b") == [(0, 2)]
    second = engine.step()  # a decodes (1 token), b's image takes 16 of the other 19
    assert _chunks(second, "b") == [(2, 21)]
    engine.run()


def test_a_prefix_hit_inside_an_image_is_kept_and_the_rest_computed_whole() -> None:
    """The first request's blocks (4 tokens) end inside its image (3..19) at 16: they were
    computed with the whole image, so the second, with the same prompt and image, reuses them
    and computes the image's rest (16..19) in its first chunk, never cut (the fake engine
    checks every position it attends to holds its own prefix's KV)."""
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=20))
    tokens = list(range(1000, 1030))
    first = _with_images(make_request("a", tokens, max_tokens=1), [(3, 16)])
    engine.add(first)
    engine.run()
    second = _with_images(make_request("b", tokens, max_tokens=1), [(3, 16)])
    engine.add(second)
    out = engine.step()
    assert second.num_cached_tokens == 28  # 7 whole blocks, past the image
    assert _chunks(out, "b") == [(28, 30)]
    third = _with_images(make_request("c", tokens[:17] + [7] * 13, max_tokens=1), [(3, 16)])
    engine.add(third)  # the same image, then other tokens: a hit of 16, inside the image
    out = engine.step()
    assert third.num_cached_tokens == 16
    assert _chunks(out, "c") == [(16, 30)]  # the image's rest (16..19) and on, one chunk
    engine.run()


def test_images_of_other_models_are_cut_anywhere() -> None:
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=20))
    req = _with_images(make_request("a", 40, max_tokens=2), [(5, 16)], whole=False)
    engine.add(req)
    assert _prefill(engine, "a") == [(0, 20), (20, 40)]
    engine.run()
