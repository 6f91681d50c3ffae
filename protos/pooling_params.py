"""How an embedding request turns its prompt's hidden states into one vector: plain data.

``last`` (the last token's state) is vLLM's default for a causal LM served with ``--task
embed``, and the one whose prompt may be served from the prefix cache: ``mean`` and ``cls`` read
every position (or the first), so their prompts are computed whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.sampling_params import InvalidRequestError

POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("generate", "embed")


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: str = "last"
    normalize: bool = True  # L2-normalize the pooled vector (vLLM's default for embed)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}",
                "pooling_type",
            )

    @property
    def reads_prefix_cache(self) -> bool:
        """Only the last position is needed: a cached prefix leaves it to compute."""
        return self.pooling_type == "last"
