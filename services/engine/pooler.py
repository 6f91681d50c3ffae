"""Pooling an embedding request's final hidden states into one vector, chunk by chunk.

A prompt longer than a step's token budget is prefilled in chunks, so the pooler keeps a running
state per request between steps: the float32 sum of the rows so far (``mean``) or the first
row (``cls``); ``last`` needs only the final chunk's last row. ``ref_pool`` is the same function
over a whole prompt's hidden states at once, the reference the chunked path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from protos.pooling_params import PoolingParams


def ref_pool(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """[T, H] final hidden states of one prompt (after the model's last norm) -> [H] float32."""
    rows = hidden.float()
    if params.pooling_type == "mean":
        vec = rows.mean(0)
    elif params.pooling_type == "cls":
        vec = rows[0]
    else:
        vec = rows[-1]
    return F.normalize(vec, p=2.0, dim=-1) if params.normalize else vec


class Pooler:
    def __init__(self) -> None:
        self._partial: dict[str, torch.Tensor] = {}  # request id -> [H] float32

    def add(
        self, request_id: str, params: PoolingParams, rows: torch.Tensor, start_pos: int,
        num_prompt_tokens: int, final: bool,
    ) -> torch.Tensor | None:  # fmt: skip
        """Feed one chunk's rows ([n, H], prompt positions ``start_pos`` on); the pooled vector
        ([H] float32) once ``final`` (the chunk that ends the prompt), else None."""
        if start_pos == 0:  # a first chunk, or the recompute of a preempted request: start over
            self._partial.pop(request_id, None)
        kind = params.pooling_type
        state: torch.Tensor | None
        if kind == "mean":
            chunk = rows.float().sum(0)  # [H]
            before = self._partial.get(request_id)
            state = chunk if before is None else before + chunk
        elif kind == "cls":
            state = rows[0].float() if start_pos == 0 else self._partial.get(request_id)
            if state is None:  # never: a cls request reads no prefix cache, so it starts at 0
                raise RuntimeError(f"{request_id}: cls pooling missed the prompt's first token")
        else:
            state = rows[-1].float() if final else None
        if not final:
            if state is not None:
                self._partial[request_id] = state
            return None
        self._partial.pop(request_id, None)
        assert state is not None
        vec = state / num_prompt_tokens if kind == "mean" else state
        return F.normalize(vec, p=2.0, dim=-1) if params.normalize else vec

    def drop(self, request_id: str) -> None:
        """An aborted request's running state."""
        self._partial.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._partial)
