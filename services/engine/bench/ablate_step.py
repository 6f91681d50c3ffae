"""What a decode step would save without one kind of small kernel: the bound on fusing it away.

    python -m services.engine.bench.ablate_step --model llama-3.1-8b --batch 1 --context 1024 \
        --skip silu

Replaces one kind of kernel by a no-op before the engine captures its CUDA graphs, then times
one decode step's graph replay as :mod:`services.engine.bench.profile_step` does. The step's
numbers are then wrong (only its time means anything): ``silu`` passes the gate half through,
``norm`` returns its input (and the residual unchanged), ``rotary`` returns q unrotated and
writes no KV, ``merge`` skips the decode attention's split merge. ``none`` is the step as it
is. Each kind in its own process (the engine's graphs are captured once).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kernels import ops


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _skip_silu() -> None:
    ops.silu_and_mul = lambda x: x[..., : x.shape[-1] // 2]  # type: ignore[assignment]


def _skip_norm() -> None:
    def norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x if residual is None else residual

    ops.rms_norm = norm  # type: ignore[assignment]


def _skip_rotary() -> None:
    ops.rotary_write_kv = lambda positions, q, *args, **kwargs: q  # type: ignore[assignment]


def _skip_merge() -> None:
    from kernels import triton_decode

    triton_decode._merge_splits_kernel = _NoLaunch()  # type: ignore[assignment]


SKIPS: dict[str, Callable[[], None]] = {
    "none": lambda: None,
    "silu": _skip_silu,
    "norm": _skip_norm,
    "rotary": _skip_rotary,
    "merge": _skip_merge,
}


def main(argv: list[str] | None = None) -> int:
    from services.engine.bench import profile_step

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skip", choices=sorted(SKIPS), required=True)
    args, rest = p.parse_known_args(argv)
    SKIPS[args.skip]()
    return profile_step.main([*rest, "--top", "0"])


if __name__ == "__main__":
    raise SystemExit(main())
