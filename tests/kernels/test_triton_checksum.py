"""The KV-transfer checksum (Triton) against its reference: the same int64 bits, always.

Small pieces (``piece_words``) and blocks stand in for the 4M-word pieces and 4096-word blocks,
so piece boundaries, blocks straddling them and many programs show up in a few kilobytes.
"""

from __future__ import annotations

import pytest
import torch

from kernels import ops
from kernels.checksum import ref_checksum
from kernels.triton_checksum import checksum

SIZES = (1, 3, 4, 5, 7, 8, 63, 64, 65, 137)  # bytes: tail only, whole words, 0-3 byte tails
# (piece_words, (BLOCK, num_warps)): one block a piece; two blocks a piece, the second one
# straddling the piece's end (12 = 8 + 4); the defaults (one piece here). The interpreter
# costs ~10 ms a program: few programs each
LAUNCHES = ((16, (16, 1)), (12, (8, 1)), (1 << 22, None))


def _bytes(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:  # [n] uint8
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(device)


@pytest.mark.parametrize("offset", [0, 1, 3])  # 1, 3: an unaligned slice, read byte by byte
def test_matches_the_reference_over_sizes_offsets_and_pieces(offset: int, gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    buffer = _bytes(max(SIZES) + 4, gen, device)
    for n in SIZES:
        data = buffer[offset : offset + n]
        for piece_words, config in LAUNCHES:
            want = ref_checksum(data, piece_words)
            got = checksum(data, piece_words, config)
            assert got.shape == () and got.dtype == torch.int64 and got.device.type == device.type
            assert int(got) == int(want), (n, offset, piece_words, config)


def test_int64_wrap_around_is_the_references(device: torch.device) -> None:
    """Maximal words overflow int64 (the value below is exact, then wrapped): a kernel that
    saturated, or summed in another width, would differ."""
    pieces, piece_words, word = 16, 16384, 0x7FFFFFFF
    data = torch.full((pieces * piece_words,), word, dtype=torch.int32, device=device)
    exact = word * (pieces * (pieces + 1) // 2) * (piece_words * (piece_words + 1) // 2)
    wrapped = (exact + 2**63) % 2**64 - 2**63
    assert wrapped != exact
    raw = data.view(torch.uint8)
    assert int(ref_checksum(raw, piece_words)) == wrapped
    assert int(checksum(raw, piece_words, (16384, 4))) == wrapped


def test_word_weights_restart_after_65521_words_inside_a_block(gen: torch.Generator, device: torch.device) -> None:  # fmt: skip
    data = _bytes(4 * 65536 + 2, gen, device)  # block 3 of 4 holds words 65520 and 65521
    assert int(checksum(data, config=(16384, 4))) == int(ref_checksum(data))


def test_default_pieces_give_the_values_both_ends_already_agree_on(device: torch.device) -> None:
    data = (torch.arange(4099) * 7919 % 251).to(torch.uint8).to(device)
    assert int(checksum(data)) == int(ref_checksum(data)) == 9447460755143
    assert int(ops.checksum(data)) == 9447460755143


def test_empty_data_sums_to_zero(device: torch.device) -> None:
    data = torch.empty(0, dtype=torch.uint8, device=device)
    assert int(checksum(data)) == int(ref_checksum(data)) == 0


def test_rejects_what_it_cannot_read(device: torch.device) -> None:
    data = torch.zeros(64, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="dtype"):
        checksum(data.view(torch.int32))
    with pytest.raises(ValueError, match="dims"):
        checksum(data.view(8, 8))
    with pytest.raises(ValueError, match="contiguous"):
        checksum(data[::2])
    with pytest.raises(ValueError, match="piece_words"):
        checksum(data, 0)
    for block in (12, 1 << 16):
        with pytest.raises(ValueError, match="power of two"):
            checksum(data, config=(block, 1))
    with pytest.raises(ValueError, match="1-D uint8"):
        ref_checksum(data.view(8, 8))


@pytest.mark.gpu
def test_gpu_llama_kv_agrees_with_the_cpu() -> None:
    """A 1024-token Llama-3.1-8B KV (134 MB, 8 default pieces) and an unaligned slice of it:
    the GPU kernel gives the CPU reference's bits (a CPU sender, a GPU receiver)."""
    gen = torch.Generator().manual_seed(0)
    cpu = torch.randint(0, 256, (1024 * 32 * 2 * 8 * 128 * 2 + 3,), dtype=torch.uint8, generator=gen)  # fmt: skip
    gpu = cpu.cuda()
    for a, b in ((0, cpu.numel()), (1, cpu.numel() - 5), (4096, 4096 + (1 << 24) + 7)):
        want = int(ref_checksum(cpu[a:b]))
        assert int(checksum(gpu[a:b])) == want
        assert int(ref_checksum(gpu[a:b])) == want
