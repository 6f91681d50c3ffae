"""Which part of the model each tensor-parallel rank holds: plain arithmetic, no torch.

Query heads are split by KV group, so each rank attends with whole groups of its own KV heads:
with at least as many KV heads as ranks, each rank takes a contiguous run of KV heads (runs
differ by at most one head: SmolLM2's 3 KV heads over 2 ranks are 2 + 1) and their query heads;
with fewer KV heads than ranks, each KV head is replicated on ``size / Hkv`` ranks, which split
its query heads. The MLP's intermediate rows split the same way (column-parallel gate/up,
row-parallel down); the vocabulary is split into equal shards of ``ceil(V / size)`` rows, the
last one padded, so the logits gather is one equal-sized all-gather.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from services.config import ConfigError
from services.engine.model_config import ArchConfig

Span = tuple[int, int]  # [start, end)

# checkpoint tensor name -> (which span, the dimension it cuts); anything else is replicated
_SLICES = {
    "q_proj": ("q", 0),
    "k_proj": ("kv", 0),
    "v_proj": ("kv", 0),
    "o_proj": ("q", 1),
    "gate_proj": ("mlp", 0),
    "up_proj": ("mlp", 0),
    "down_proj": ("mlp", 1),
}
_PIECE = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def split(n: int, parts: int, index: int) -> Span:
    """The index-th of ``parts`` contiguous runs of ``n`` items, the first ones one longer."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class CheckpointSlice:
    dim: int  # 0: rows (out features, vocab), 1: columns (in features)
    start: int
    end: int
    pad_to: int | None = None  # rows the rank's parameter has (a padded vocabulary shard)


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span  # the real rows of this rank's vocabulary shard
    vocab_shard: int  # rows of every rank's shard (the last one padded)
    head_dim: int

    @classmethod
    def of(cls, arch: ArchConfig, rank: int, size: int) -> TPLayout:
        """This rank's part; ConfigError naming the cause when the model cannot be split."""
        nq, nkv = arch.num_heads, arch.num_kv_heads
        where = f"--tensor-parallel-size {size}"
        if arch.moe is not None:
            raise ConfigError(f"{where}: Mixture-of-Experts models are not split yet; use 1")
        if arch.quantization_config:
            raise ConfigError(f"{where}: quantized checkpoints are not split yet; use 1")
        if nq % nkv:
            raise ConfigError(f"{where}: {nq} query heads are not a multiple of {nkv} KV heads")
        if nkv >= size:
            kv = split(nkv, size, rank)
            q = (kv[0] * nq // nkv, kv[1] * nq // nkv)
        elif size % nkv or nq % size:
            raise ConfigError(
                f"{where}: {nkv} KV heads and {nq} query heads cannot be split over {size} "
                f"ranks (with fewer KV heads than ranks, the ranks must be a multiple of the KV "
                "heads and divide the query heads)"
            )
        else:
            per_kv = size // nkv  # ranks sharing one replicated KV head
            kv = (rank // per_kv, rank // per_kv + 1)
            q = (rank * nq // size, (rank + 1) * nq // size)
        if arch.intermediate_size < size:
            raise ConfigError(f"{where}: intermediate size {arch.intermediate_size} is too small")
        shard = -(-arch.vocab_size // size)
        vocab = (min(rank * shard, arch.vocab_size), min((rank + 1) * shard, arch.vocab_size))
        mlp = split(arch.intermediate_size, size, rank)
        return cls(rank, size, q, kv, mlp, vocab, shard, arch.head_dim)

    def local_arch(self, arch: ArchConfig) -> ArchConfig:
        """The plain model this rank builds: its heads, its MLP rows, its vocabulary shard."""
        return replace(
            arch,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab_shard,
        )

    def checkpoint_slice(self, name: str) -> CheckpointSlice | None:
        """The part of an HF checkpoint tensor this rank loads; None: all of it (norms)."""
        if name in _VOCAB:
            return CheckpointSlice(0, *self.vocab, pad_to=self.vocab_shard)
        match = _PIECE.search(name)
        if match is None:
            return None
        span, dim = _SLICES[match.group(1)]
        if match.group(2) == "bias" and dim == 1:
            return None  # a row-parallel bias is added once, after the all-reduce
        d = self.head_dim
        start, end = {
            "q": (self.q_heads[0] * d, self.q_heads[1] * d),
            "kv": (self.kv_heads[0] * d, self.kv_heads[1] * d),
            "mlp": self.intermediate,
        }[span]
        return CheckpointSlice(dim, start, end)

    def param_slice(self, name: str, arch: ArchConfig) -> tuple[int, int, list[Span]] | None:
        """Where this rank's part of our (fused) parameter ``name`` lies in the whole model's
        (``arch``): the dimension, the whole size along it, the spans to concatenate; None: all
        of it. Random ``--load-format dummy`` weights are drawn whole and cut here, so N ranks
        hold the weights of one."""
        d, nq, nkv, inter = arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.intermediate_size
        q = (self.q_heads[0] * d, self.q_heads[1] * d)
        kv = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        mlp = self.intermediate
        if name in _VOCAB:
            return 0, arch.vocab_size, [self.vocab]
        if ".qkv_proj." in name:
            k, v = nq * d, (nq + nkv) * d
            return 0, (nq + 2 * nkv) * d, [q, (k + kv[0], k + kv[1]), (v + kv[0], v + kv[1])]
        if name.endswith(".o_proj.weight"):
            return 1, nq * d, [q]
        if ".gate_up_proj." in name:
            return 0, 2 * inter, [mlp, (inter + mlp[0], inter + mlp[1])]
        if name.endswith(".down_proj.weight"):
            return 1, inter, [mlp]
        return None
