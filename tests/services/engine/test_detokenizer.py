"""Incremental detokenization: multi-token characters and stop strings held back while streaming."""

from __future__ import annotations

from services.engine.detokenizer import IncrementalDetokenizer


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


def test_include_stop_string() -> None:
    det = IncrementalDetokenizer(ByteDecoder(), [], stop=("END",), include_stop=True)
    shown, matched = _feed(det, "xyEND more")
    assert shown == "xyEND" and matched == "END"
