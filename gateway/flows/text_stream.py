"""The shared frame of the gateway's output scanners (``tool_parsers``, ``reasoning``): text is
fed piece by piece, a scanner consumes what is already decided at the front of its buffer, and
keeps back only an end that could still grow into a marker it waits for."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

StepT = TypeVar("StepT")


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of text that could still grow into marker."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class TextStream(ABC, Generic[StepT]):
    """One generated choice's text; ``feed`` and ``finish`` return what may be sent now."""

    def __init__(self) -> None:
        self._buf = ""  # received and not yet emitted or dropped

    def feed(self, delta: str) -> StepT:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> StepT:
        return self._drain(final=True)

    def _drain(self, final: bool) -> StepT:
        while self._advance(final):
            pass
        return self._take()

    @abstractmethod
    def _advance(self, final: bool) -> bool:
        """Consumes what is decided at the front of the buffer; True while there may be more.

        Every decision taken with ``final`` false must hold whatever text follows: that is what
        makes a stream agree with the whole-text parse for any split of the text."""

    @abstractmethod
    def _take(self) -> StepT:
        """What the advances since the last call decided, then forgotten."""
