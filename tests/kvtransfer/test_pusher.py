"""The sender's granted push (kvtransfer.pusher) in one process on a GPU: from captured graphs,
any block count, into a grant's blocks only; a revoked grant writes nothing. Skipped without a
GPU (the kernels themselves are tested against their references on the CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_block_copy import BlockCopier
from kvtransfer.grants import GrantTable
from kvtransfer.pusher import Pusher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def test_pushes_of_any_size_land_from_graphs_and_a_revoked_grant_writes_nothing() -> None:
    gen = torch.Generator().manual_seed(1)
    cuda = torch.device("cuda")
    src = [torch.randn((2, 40, 16, 2, 64), generator=gen).to(cuda, torch.bfloat16) for _ in range(3)]  # fmt: skip
    dst = [torch.zeros_like(c) for c in src]
    table = GrantTable(cuda, 8)
    stream = torch.cuda.Stream(cuda)
    pusher = Pusher(BlockCopier(dst), BlockCopier(src), table.fence, stream, capacity=40)
    for n in (1, 3, 4, 5, 17, 40):  # buckets 1, 4, 4, 8, 32, 40 (the pool's size)
        ours = torch.randperm(40, generator=gen)[:n].tolist()
        theirs = torch.randperm(40, generator=gen)[:n].tolist()
        grant = table.grant(theirs)
        assert grant is not None
        ids = pusher.push(grant.token, grant.slot, ours, theirs)
        stream.synchronize()
        assert ids.tolist() == ours
        assert table.phase(grant) == 2  # landed
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, theirs], s[:, ours])
        table.release(grant)
    assert pusher.graphs == {1: True, 4: True, 8: True, 32: True, 40: True}
    before = [c.clone() for c in dst]
    grant = table.grant([0, 1])
    assert grant is not None and table.revoke(grant) == 0  # taken back before the copy
    pusher.push(grant.token, grant.slot, [5, 6], [0, 1])
    stream.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))
    with pytest.raises(ValueError, match="1 to 40 blocks"):
        pusher.push(grant.token, grant.slot, list(range(41)), list(range(41)))
