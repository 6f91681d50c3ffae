"""Incremental detokenization: multi-token characters and stop strings held back while streaming."""

from __future__ import annotations

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
