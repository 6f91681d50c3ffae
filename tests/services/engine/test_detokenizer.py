"""Incremental detokenization: multi-token characters and stop strings held back while streaming."""

from __future__ import annotations

from typing import Any

import pytest

from services.engine.detokenizer import IncrementalDetokenizer, fast_decoder


class ByteDecoder:
    """Each token id is one byte of UTF-8; incomplete characters decode to U+FFFD."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _feed(det: IncrementalDetokenizer, text: str) -> tuple[str, str | None]:
    shown, matched = "", None
    for b in text.encode():
        matched = det.add(b)
        shown += det.release(matched is not None)
        if matched:
            break
    return shown + det.release(True), matched


def test_multibyte_characters_are_released_whole() -> None:
    det = IncrementalDetokenizer(ByteDecoder(), [])
    pieces = []
    for b in "héllo €".encode():
        det.add(b)
        pieces.append(det.release(False))
    assert "".join(pieces) == "héllo €"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_never_streamed() -> None:
    det = IncrementalDetokenizer(ByteDecoder(), [], stop=("STOP",))
    shown, matched = _feed(det, "abc STOP def")
    assert shown == "abc " and matched == "STOP"


def test_partial_stop_prefix_is_released_once_it_cannot_match() -> None:
    det = IncrementalDetokenizer(ByteDecoder(), [], stop=("STOP",))
    shown, matched = _feed(det, "a STO b")
    assert shown == "a STO b" and matched is None


def test_stop_strings_count_from_min_tokens_on() -> None:
    """vLLM's min_tokens: a stop string inside the first min_tokens tokens does not end the
    output; one that completes at or after the min_tokens-th token does."""
    det = IncrementalDetokenizer(ByteDecoder(), [], stop=(".",), min_tokens=6)
    shown, matched = _feed(det, "a.b.c.d.e")  # "." at tokens 2 and 4: too early; 6: counts
    assert shown == "a.b.c" and matched == "."
    det = IncrementalDetokenizer(ByteDecoder(), [], stop=("ab",), min_tokens=3)
    shown, matched = _feed(det, "abxab")  # the first "ab" ends at token 2, the second at 5
    assert shown == "abx" and matched == "ab"
    det = IncrementalDetokenizer(ByteDecoder(), [], stop=("STOP",), min_tokens=100)
    assert _feed(det, "x STOP y") == ("x STOP y", None)


def test_include_stop_string() -> None:
    det = IncrementalDetokenizer(ByteDecoder(), [], stop=("END",), include_stop=True)
    shown, matched = _feed(det, "xyEND more")
    assert shown == "xyEND" and matched == "END"


def test_the_fast_decoder_decodes_as_the_tokenizer_does() -> None:
    """The engine's detokenizers call the fast tokenizer's backend directly (twice a token): the
    same text as ``tokenizer.decode`` for any ids (special ones included, skipped or not), and
    the tokenizer itself where a clean-up step would make them differ."""
    import random

    from services.engine.llm_engine import load_tokenizer
    from services.model_files import prepare_model

    tok = load_tokenizer(str(prepare_model("embedded").hf_dir))
    fast = fast_decoder(tok)
    assert fast is not tok
    rng = random.Random(0)
    specials = list(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids[rng.randrange(len(ids))] = rng.choice(specials)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip
            )
    tok.clean_up_tokenization_spaces = True
    assert fast_decoder(tok) is tok


class PieceDecoder:
    """Token ``i`` is ``pieces[i]``, any bytes (part of a character, or a character and part of
    the next, as byte-level BPE merges them); decoded as one UTF-8 string with U+FFFD."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _run(det: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """The deltas an engine sends for ``ids`` (the output ends after the last one, or at a
    matched stop string), and the matched stop string."""
    deltas, matched = [], None
    for k, t in enumerate(ids):
        matched = det.add(t)
        finished = matched is not None or k == len(ids) - 1
        deltas.append(det.release(finished))
        if finished:
            break
    return deltas, matched


def test_an_output_that_ends_inside_a_character_drops_its_bytes_as_vllm_does() -> None:
    """max_tokens cut the output after the first two bytes of "东": its text is what came before
    it, streamed and whole, not ``tokenizer.decode``'s U+FFFD for the bytes (vLLM's detokenizers
    release no text ending in U+FFFD, and its final text is what they released)."""
    ids = list("a东".encode())[:-1]
    deltas, _ = _run(IncrementalDetokenizer(ByteDecoder(), []), ids)
    assert "".join(deltas) == ByteDecoder().decode(ids).rstrip("\ufffd") == "a"
    assert not any("\ufffd" in d for d in deltas)
    # an invalid byte and then the end of the output (an end-of-sequence token not in the text)
    ids = [*b"ok", 0x93]
    assert "".join(_run(IncrementalDetokenizer(ByteDecoder(), []), ids)[0]) == "ok"
    # a last token that completes one character and begins another keeps the complete one
    dec = PieceDecoder(["。".encode() + "东".encode()[:2]])
    assert _run(IncrementalDetokenizer(dec, []), [0]) == (["。"], None)
    # an invalid byte inside the output stays as decode spells it (only the end is dropped)
    ids = [*b"o", 0x93, *b"k"]
    assert "".join(_run(IncrementalDetokenizer(ByteDecoder(), []), ids)[0]) == "o\ufffdk"


def test_characters_before_an_unfinished_one_are_released_at_once() -> None:
    """A token that ends one character and begins the next ("。" and the first bytes of "东"):
    "。" is final as soon as that token comes, so it streams then and a stop string "。" ends
    the output there, not a token later once "东" is complete."""
    pieces = ["。".encode() + "东".encode()[:2], "东".encode()[2:], b"x"]
    dec = PieceDecoder(pieces)
    det = IncrementalDetokenizer(dec, [])
    assert det.add(0) is None and det.release(False) == "。"
    assert det.add(1) is None and det.release(False) == "东"
    det = IncrementalDetokenizer(dec, [], stop=("。",))
    deltas, matched = _run(det, [0, 1, 2])
    assert (deltas, matched) == ([""], "。")
    det = IncrementalDetokenizer(dec, [], stop=("。",), include_stop=True)
    assert _run(det, [0, 1, 2]) == (["。"], "。")


def test_a_matched_stop_string_is_where_the_text_ends() -> None:
    """The bytes of an unfinished character after a stop string are not released after it."""
    pieces = [b"ab", b"STOP" + "东".encode()[:1], b"z"]
    det = IncrementalDetokenizer(PieceDecoder(pieces), [], stop=("STOP",))
    deltas, matched = _run(det, [0, 1, 2])
    assert "".join(deltas) == "ab" and matched == "STOP"


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_streamed_text_is_the_tokenizers_decode(kind: str) -> None:
    """Random outputs of real tokenizer kinds (byte-level BPE; SentencePiece with byte fallback)
    cut anywhere, a character split over tokens among them: the deltas joined are
    ``tokenizer.decode(prompt + output)`` less the prompt's text (the output's own leading
    space kept, as vLLM keeps it) and less the U+FFFD of an end inside a character (dropped,
    as vLLM drops it)."""
    import random

    from tests import tokenizer_zoo

    tok = (
        tokenizer_zoo.byte_level_tokenizer()
        if kind == "byte_level"
        else tokenizer_zoo.sentencepiece_tokenizer()
    )
    rng = random.Random(0)
    prompt = tok("Hello", add_special_tokens=False)["input_ids"]
    texts = ["东京 😀 world", " café\n\n", "北京是中国", "👍🏽❤️ ok"]
    checked = 0
    for _ in range(60):
        ids = tok(rng.choice(texts) + rng.choice(texts), add_special_tokens=False)["input_ids"]
        ids = ids[: rng.randrange(1, len(ids) + 1)]
        det = IncrementalDetokenizer(fast_decoder(tok), prompt)
        deltas, _ = _run(det, ids)
        whole = tok.decode(prompt + ids, skip_special_tokens=True)
        assert all(not d.endswith("\ufffd") for d in deltas)
        # SentencePiece's byte fallback decodes a run of byte tokens as one: a run that ends
        # inside a character turns every byte of it into U+FFFD, the characters it completed
        # before too, so a later token can change text decode gave earlier. No stream can
        # show those characters and match such an end (vLLM's neither); which outputs meet it
        # depends on the vocabulary the trainer picked (its ties differ between processes)
        if not _decode_only_grows(tok, prompt, ids):
            continue
        checked += 1
        assert "".join(deltas) == whole[len(tok.decode(prompt)) :].rstrip("\ufffd"), ids
    assert checked >= 30, checked


def _decode_only_grows(tok: Any, prompt: list[int], ids: list[int]) -> bool:
    """Whether each prefix of ``ids`` decodes (after the prompt) to the start of what the whole
    decodes to, an unfinished character's U+FFFD aside."""
    whole = tok.decode(prompt + ids, skip_special_tokens=True)
    for end in range(1, len(ids)):
        part = tok.decode(prompt + ids[:end], skip_special_tokens=True).rstrip("\ufffd")
        if not whole.startswith(part):
            return False
    return True
