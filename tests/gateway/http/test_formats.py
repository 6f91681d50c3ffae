"""Response formatting: legacy completion logprobs for tokens that split a character."""

from __future__ import annotations

from gateway.http.formats import TextOffsets, completion_logprobs
from protos.logprobs import PositionLogprobs, TokenLogprob

EMOJI = "😀".encode()  # f0 9f 98 80: one character, here split over two tokens


def _tok(token: str, raw: bytes = b"", logprob: float = -0.5) -> TokenLogprob:
    return TokenLogprob(token_id=0, logprob=logprob, token=token, token_bytes=raw)


def _pos(chosen: TokenLogprob, *top: TokenLogprob) -> PositionLogprobs:
    return PositionLogprobs(chosen=chosen, top=top)


def _split_emoji_entries() -> list[PositionLogprobs]:
    """'a', the emoji in two pieces, 'b': the text is 'a😀b'."""
    return [
        _pos(_tok("a", b"a")),
        _pos(_tok("\ufffd", EMOJI[:2]), _tok("\ufffd", EMOJI[:2]), _tok("x", b"", -3.0)),
        _pos(_tok("\ufffd", EMOJI[2:])),
        _pos(_tok("b")),  # no bytes carried: the token's UTF-8
    ]


def test_partial_character_tokens_render_as_bytes_and_offsets_stay_in_the_text() -> None:
    text = "a😀b"
    out = completion_logprobs(_split_emoji_entries(), 0)
    assert out["tokens"] == ["a", "bytes:\\xf0\\x9f", "bytes:\\x98\\x80", "b"]
    assert out["tokens"][1] == "bytes:" + "\\" + "xf0" + "\\" + "x9f"  # literal backslash-x
    assert out["top_logprobs"][1] == {"bytes:\\xf0\\x9f": -0.5, "x": -3.0}
    assert out["token_logprobs"] == [-0.5, -0.5, -0.5, -0.5]
    # both pieces point at where the emoji starts; 'b' right after it
    assert out["text_offset"] == [0, 1, 1, 2]
    assert all(o <= len(text) for o in out["text_offset"])
    assert text[out["text_offset"][3]] == "b"


def test_whole_tokens_are_unchanged() -> None:
    entries = [_pos(_tok("Hello", b"Hello")), _pos(_tok(" wörld", " wörld".encode()))]
    out = completion_logprobs(entries, 0)
    assert out["tokens"] == ["Hello", " wörld"] and out["text_offset"] == [0, 5]
    # a real U+FFFD in the text (its bytes are its UTF-8) is a character like any other
    out = completion_logprobs([_pos(_tok("\ufffd")), _pos(_tok("z"))], 3)
    assert out["tokens"] == ["\ufffd", "z"] and out["text_offset"] == [3, 4]


def test_echoed_prompt_tokens_come_first_and_share_the_offsets() -> None:
    # prompt 'x😀' (the emoji split in the prompt, as bytes), then the generated 'a😀b'
    out = completion_logprobs(_split_emoji_entries(), 0, ["x", EMOJI[:1], EMOJI[1:]])
    assert out["tokens"][:3] == ["x", "bytes:\\xf0", "bytes:\\x9f\\x98\\x80"]
    assert out["token_logprobs"][:3] == [None, None, None]
    assert out["top_logprobs"][:3] == [None, None, None]
    assert out["text_offset"] == [0, 1, 1, 2, 3, 3, 4]
    # whole prompt tokens given as text
    out = completion_logprobs(_split_emoji_entries(), 0, ["he", "llo"])
    assert out["tokens"][:2] == ["he", "llo"] and out["text_offset"] == [0, 2, 5, 6, 6, 7]


def test_offsets_carried_over_a_streams_chunks_equal_the_whole_responses() -> None:
    """However the tokens fall into chunks (and whatever text each chunk released), one
    ``TextOffsets`` carried from chunk to chunk gives the whole response's offsets."""
    entries = [*_split_emoji_entries(), _pos(_tok(" end")), _pos(_tok("!"))]
    whole = completion_logprobs(entries, 0)["text_offset"]
    for cuts in ([1], [2], [1, 3], [2, 3, 4], list(range(1, len(entries)))):
        where, got = TextOffsets(0), []
        for a, b in zip([0, *cuts], [*cuts, len(entries)], strict=True):
            got += completion_logprobs(entries[a:b], where)["text_offset"]
        assert got == whole, cuts


def test_streamed_chunks_that_split_a_character() -> None:
    """Chunk texts hold back a partial character, so a chunk may open with its tail: the tail
    points at the chunk's start, where that character is, and what follows comes after it."""
    first = completion_logprobs([_pos(_tok("a")), _pos(_tok("\ufffd", EMOJI[:2]))], 0)
    assert first["text_offset"] == [0, 1]  # chunk text 'a': the emoji is held back
    second = completion_logprobs(
        [_pos(_tok("\ufffd", EMOJI[2:])), _pos(_tok("b")), _pos(_tok("c"))], 1
    )
    assert second["tokens"][0] == "bytes:\\x98\\x80"
    assert second["text_offset"] == [1, 2, 3]  # chunk text '😀bc' at 1


def test_top_logprobs_always_hold_the_chosen_token() -> None:
    """OpenAI's legacy completions (and vLLM): up to logprobs + 1 entries a position, the chosen
    token among them even when it is not one of the most likely; logprobs=0: it alone."""
    a, b = _tok("a", logprob=-0.1), _tok("b", logprob=-1.0)
    unlikely, likely = _pos(_tok("z", logprob=-4.0), a, b), _pos(a, a, b)
    alone = _pos(_tok("c", logprob=-2.0))
    out = completion_logprobs([unlikely, likely, alone], 0)
    assert out["top_logprobs"] == [{"a": -0.1, "b": -1.0, "z": -4.0}, {"a": -0.1, "b": -1.0},
                                   {"c": -2.0}]  # fmt: skip
    echoed = completion_logprobs([], 0, ["p", "q"], [unlikely])
    assert echoed["top_logprobs"] == [None, {"a": -0.1, "b": -1.0, "z": -4.0}]
