"""Log probabilities as plain data, the same on both sides of the wire: the engine reports them,
the gateway formats them (``convert`` modules map them to and from protobuf)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str  # the token decoded alone ("\ufffd" where it holds part of a character)
    token_bytes: bytes = b""  # its raw bytes (OpenAI's ``bytes``); empty: the token's UTF-8
    rank: int = 0  # a prompt token's rank at its position (1: the likeliest); 0: not reported


@dataclass(frozen=True)
class PositionLogprobs:
    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()
