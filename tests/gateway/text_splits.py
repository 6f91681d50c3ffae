"""A hypothesis helper for the streaming parsers' tests: one text cut at random places."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st


def random_split(data: st.DataObject, text: str) -> list[str]:
    """``text`` in consecutive pieces (some empty), cut where hypothesis chooses."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]
