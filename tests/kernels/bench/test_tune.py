"""The prefill sweep's candidate list (the timing itself needs a GPU)."""

from __future__ import annotations

from kernels import triton_prefill
from kernels.bench import tune
from kernels.triton_prefill import Tiles


def test_prefill_sweep_stays_within_its_budget_and_has_no_repeats() -> None:
    # ~120 configurations per case keep the whole prefill sweep to a few minutes of one GPU
    assert len(tune.PREFILL_KNOBS) <= 120
    assert len(set(tune.PREFILL_KNOBS)) == len(tune.PREFILL_KNOBS)


def test_prefill_sweep_times_the_launchers_own_choices_and_every_knob() -> None:
    swept = set(tune.PREFILL_KNOBS)
    assert triton_prefill.TILE_CHOICES[0] in swept
    assert all(tiles in swept for tiles, _ in triton_prefill.LARGE_TILES)
    for knob in Tiles._fields[5:]:
        assert any(getattr(t, knob) for t in swept), knob


def test_sweep_entries_print_as_code_that_reads_back() -> None:
    for tiles in tune.PREFILL_KNOBS:
        assert eval(tiles.code(), {"Tiles": Tiles}) == tiles
