"""Chunking a transfer into whole layers, and checking a received chunking."""

from __future__ import annotations

from kvtransfer.chunks import layer_ranges, plan_layers


def test_plan_layers_groups_whole_layers_up_to_the_chunk_size():
    assert plan_layers(32, layer_bytes=4 << 20, chunk_bytes=32 << 20) == [
        (0, 8),
        (8, 16),
        (16, 24),
        (24, 32),
    ]
    assert plan_layers(5, layer_bytes=10, chunk_bytes=25) == [(0, 2), (2, 4), (4, 5)]
    assert plan_layers(3, layer_bytes=100, chunk_bytes=1) == [(0, 1), (1, 2), (2, 3)]
    assert plan_layers(3, layer_bytes=1, chunk_bytes=1 << 30) == [(0, 3)]


def test_layer_ranges_accepts_only_whole_layers_covering_every_layer():
    assert layer_ranges((20, 20, 10), layer_bytes=10, num_layers=5) == [(0, 2), (2, 4), (4, 5)]
    assert layer_ranges((15, 35), layer_bytes=10, num_layers=5) is None  # splits a layer
    assert layer_ranges((20, 20), layer_bytes=10, num_layers=5) is None  # a layer missing
