"""Whether two greedy continuations of one prompt agree up to rounding: the check vLLM's model
tests make against transformers in 16-bit (``check_logprobs_close``), with the margins reported.

Two correct bf16 implementations do not produce the same 32 greedy tokens: where the two best
next tokens are nearly tied, rounding in a matmul's reduction order picks one or the other, and
the continuations part for good. So exact equality is no test of correctness there. What is: up to
the first position where the tokens differ they are equal, and at that position each side's
token is among the other side's top-N candidates (it was a near-tie, not a wrong model). The gap
(the log-probability of a side's own token minus that of the other side's token, by that side's
own distribution) says how near the tie was. Plain data, no torch: the GPU test and
``services.engine.bench.parity_report`` fill it in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Continuation:
    token_ids: list[int]
    top: list[dict[int, float]]  # per position: token id -> log-probability, the N likeliest


@dataclass(frozen=True)
class Divergence:
    position: int | None  # first position whose tokens differ; None: equal up to where one ended
    ours_in_ref_top: bool = True
    ref_in_ours_top: bool = True
    ref_gap: float | None = None  # ref's logprob of its token minus of ours (None: not in its top)
    ours_gap: float | None = None  # ours of its token minus of ref's (None: not in our top)

    @property
    def close(self) -> bool:
        return self.ours_in_ref_top and self.ref_in_ours_top

    def as_dict(self) -> dict[str, object]:
        return {
            "position": self.position,
            "close": self.close,
            "ours_in_ref_top": self.ours_in_ref_top,
            "ref_in_ours_top": self.ref_in_ours_top,
            "ref_gap": self.ref_gap,
            "ours_gap": self.ours_gap,
        }


def logprobs_close(ours: Continuation, ref: Continuation) -> Divergence:
    """Compare one prompt's continuations (see the module docstring)."""
    for k, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids, strict=False)):
        if a == b:
            continue
        if k >= len(ours.top) or k >= len(ref.top):
            raise ValueError(f"no top log-probabilities at position {k}, where the tokens differ")
        ref_top, our_top = ref.top[k], ours.top[k]
        return Divergence(
            position=k,
            ours_in_ref_top=a in ref_top,
            ref_in_ours_top=b in our_top,
            ref_gap=ref_top[b] - ref_top[a] if a in ref_top and b in ref_top else None,
            ours_gap=our_top[a] - our_top[b] if a in our_top and b in our_top else None,
        )
    return Divergence(position=None)


def summarize(pairs: list[Divergence]) -> dict[str, object]:
    """How a set of prompts compared: how many are equal, how many parted at a near-tie, and the
    widest gap seen where they parted."""
    gaps = [g for d in pairs for g in (d.ref_gap, d.ours_gap) if g is not None]
    return {
        "equal_to_end": sum(d.position is None for d in pairs),
        "close": sum(d.close for d in pairs),
        "of": len(pairs),
        "max_gap": max(gaps, default=None),
        "prompts": [d.as_dict() for d in pairs],
    }
