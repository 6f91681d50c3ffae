"""Grammar-constrained decoding on the worker, with xgrammar.

A request's ``StructuredOutput`` is compiled once into a grammar (``GrammarCompiler``, called off
the engine thread; xgrammar caches compiled grammars per spec). Each constrained request then has
a matcher (``GrammarState``). Every step the engine fills one bitmask row per constrained request
on the CPU (after the step's forward is queued on the GPU, so the two overlap); the sampler
applies it to the logits with xgrammar's kernel; the sampled token advances the matcher. A
reasoning model's thinking block is left free: the grammar starts after its end tag.

The decode side of a disaggregated request replays the tokens the prefill worker sampled through
a fresh matcher (``GrammarBatch.add``), so the grammar continues where it stopped; the prompt is
never recomputed.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protos.sampling_params import InvalidRequestError, StructuredOutput
from services.engine.step_stats import TokenHistogram

if TYPE_CHECKING:
    import xgrammar as xgr
else:

    class _OnFirstUse:
        """xgrammar, imported when a structured request first needs it: a worker that never
        serves one keeps its ~45 MB (and the triton import it pulls in) off its memory."""

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("xgrammar"), name)

    xgr = _OnFirstUse()

log = logging.getLogger(__name__)

COMPILE_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_PARAM = "structured_outputs"
_CPP_PREFIX = re.compile(r"\[[0-9:]+\] [^\s:]+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class CompiledOutput:
    """A compiled grammar and the token ids around a thinking block (see ``StructuredOutput``)."""

    grammar: xgr.CompiledGrammar
    reasoning_start: int | None = None  # the one token that opens a thinking block
    reasoning_end: tuple[int, ...] = ()  # the tokens that close it; () = no thinking
    reasoning_open: bool = False


def _library_message(exc: Exception) -> str:
    """xgrammar's C++ errors, without the file:line prefix."""
    return _CPP_PREFIX.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else repr(exc)


def _choice_grammar(spec: str) -> str:
    """``choice``: an EBNF alternation of the literal strings (JSON string escapes are EBNF's)."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"choice must be a JSON list of strings: {e}", _PARAM) from e
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError("choice must be a non-empty list of strings", _PARAM)
    if any(c == "" for c in choices):
        raise InvalidRequestError("choice strings must not be empty", _PARAM)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer. Thread-safe; the xgrammar compiler (its
    tokenizer table takes up to a second on a 128k vocabulary) is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._stop_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self.compile_seconds = TokenHistogram(COMPILE_SECONDS_BUCKETS)

    def _xgr(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidRequestError(
                        "structured output needs the model's tokenizer, and this worker serves "
                        "token ids only (a random-weight named config without one)",
                        _PARAM,
                    )
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, so: StructuredOutput) -> CompiledOutput:
        """Raises InvalidRequestError naming what is wrong with the schema, regex or grammar."""
        compiler = self._xgr()
        t0 = time.perf_counter()
        grammar = self._grammar(compiler, so)
        with self._lock:  # compiles run on pool threads
            self.compile_seconds.observe(time.perf_counter() - t0)
        start = self._tokens(so.reasoning_start)
        return CompiledOutput(
            grammar,
            reasoning_start=start[0] if len(start) == 1 else None,
            reasoning_end=tuple(self._tokens(so.reasoning_end)),
            reasoning_open=so.reasoning_open,
        )

    def _tokens(self, text: str) -> list[int]:
        if not text:
            return []
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _grammar(self, compiler: xgr.GrammarCompiler, so: StructuredOutput) -> xgr.CompiledGrammar:
        try:
            if so.kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=so.any_whitespace
                )
            if so.kind == "json":
                schema = xgr.Grammar.from_json_schema(so.spec, any_whitespace=so.any_whitespace)
                return _compile_json_safe(compiler, schema)
            if so.kind == "regex":
                return compiler.compile_regex(so.spec)
            if so.kind == "choice":
                return compiler.compile_grammar(_choice_grammar(so.spec))
            if so.kind == "structural_tag":
                return _compile_json_safe(compiler, xgr.Grammar.from_structural_tag(so.spec))
            return self._ebnf_or_lark(compiler, so.spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's C++ errors, mapped
            what = _KIND_NAMES.get(so.kind, so.kind)
            raise InvalidRequestError(f"invalid {what}: {_library_message(e)}", _PARAM) from e

    @staticmethod
    def _ebnf_or_lark(compiler: xgr.GrammarCompiler, spec: str) -> xgr.CompiledGrammar:
        """vLLM takes GBNF/EBNF (``root ::= ...``) or Lark (``start: ...``) grammars."""
        try:
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as ebnf_error:
            try:
                return compiler.compile_grammar(xgr.Grammar.from_lark(spec))
            except (RuntimeError, ValueError, TypeError):
                raise ebnf_error from None


_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "structural_tag": "structural tag"}

# xgrammar (0.2.9) builds a JSON string with a minLength or maxLength from characters of the
# class below, which lets raw control characters other than the line breaks into the string:
# JSON forbids them (a sampled backspace made an output json.loads refuses). Its strings without
# bounds take the class after it; the bounded ones are given the same.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def _compile_json_safe(compiler: xgr.GrammarCompiler, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
    """``grammar`` (from a JSON schema or a structural tag) compiled with its length-bounded
    strings' characters those JSON allows in a string."""
    text = str(grammar)
    fixed = text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
    return compiler.compile_grammar(fixed if fixed != text else grammar)


class GrammarState:
    """One request's place in its grammar, with the free thinking block before it (if any).

    Sampled tokens are pushed as they come and taken by the matcher at the next fill, which runs
    while the next forward is on the device: the matcher's work stays off the step's critical
    path (``GrammarBatch.fill``)."""

    def __init__(self, compiled: CompiledOutput) -> None:
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self._start, self._end = compiled.reasoning_start, compiled.reasoning_end
        self._tail: list[int] = []
        self.pending: list[int] = []  # sampled under the grammar, not yet taken by the matcher
        self.broken = False  # the matcher refused a token: the request must end
        if not self._end:
            self.phase = "grammar"
        elif compiled.reasoning_open:
            self.phase = "thinking"
        else:  # the model may open a thinking block first, or answer at once
            self.phase = "undecided" if self._start is not None else "grammar"

    @property
    def constrains(self) -> bool:
        return self.phase != "thinking"

    def push(self, token: int) -> None:
        """A sampled token; a thinking block's tokens are handled at once (no matcher work)."""
        if self.phase == "undecided":
            if token == self._start:
                self.phase = "thinking"
                return
            self.phase = "grammar"
        if self.phase == "thinking":
            self._tail = [*self._tail, token][-len(self._end) :]
            if tuple(self._tail) == self._end:
                self.phase = "grammar"
            return
        self.pending.append(token)

    def flush(self) -> bool:
        """Let the matcher take the pending tokens; False if it refuses one."""
        for token in self.pending:
            if not self.broken and not self.matcher.accept_token(token):
                self.broken = True
        self.pending.clear()
        return not self.broken

    def allow_start(self, bitmask: torch.Tensor, row: int) -> None:
        """Undecided: the token that opens a thinking block is allowed besides the grammar's."""
        if self.phase == "undecided" and self._start is not None:
            words = bitmask.numpy().view(np.uint32)  # set bit 31 without int32 overflow
            words[row, self._start // 32] |= np.uint32(1 << (self._start % 32))


class GrammarBatch:
    """The engine's constrained requests and the step's bitmask (one row per sampling row)."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device,
                 stop_token_ids: Iterable[int] = ()) -> None:  # fmt: skip
        self.states: dict[str, GrammarState] = {}
        self.device = device
        self.stop_ids = frozenset(stop_token_ids)  # the tokens a finished grammar ends with
        # [rows, ceil(V / 32)] int32, every bit set, as xgrammar's allocate_token_bitmask makes it
        bitmask = torch.full((max_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)
        self._bitmask = bitmask.pin_memory() if device.type == "cuda" else bitmask
        # rows are filled in parallel: on the GPU this overlaps the forward; a CPU worker keeps
        # its cores for the model
        self._threads = max(1, min(8, (os.cpu_count() or 1) // 2)) if device.type == "cuda" else 1
        self._matcher_batch: xgr.BatchGrammarMatcher | None = None

    @property
    def _batch(self) -> xgr.BatchGrammarMatcher:  # made with the first constrained request
        if self._matcher_batch is None:
            self._matcher_batch = xgr.BatchGrammarMatcher(max_threads=self._threads)
        return self._matcher_batch

    def add(self, request_id: str, compiled: CompiledOutput, outputs: Sequence[int] = ()) -> None:
        """Track a request; ``outputs`` (sampled elsewhere, e.g. by the prefill worker) replay."""
        state = GrammarState(compiled)
        for i, token in enumerate(outputs):
            state.push(token)
            if not state.flush():
                raise InvalidRequestError(
                    f"output token {i} ({token}) does not match the request's grammar",
                    "output_token_ids",
                )
        self.states[request_id] = state

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def constrains(self, request_ids: Sequence[str]) -> bool:
        return bool(self.states) and any(r in self.states for r in request_ids)

    def fill(self, request_ids: Sequence[str]) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask of the step's sampling rows (in ``request_ids`` order) and the rows it
        constrains; None when none is constrained this step. Called while the forward runs."""
        rows, states = [], []
        for i, rid in enumerate(request_ids):
            state = self.states.get(rid)
            if state is not None and state.constrains:
                rows.append(i)
                states.append(state)
        if not rows:
            return None
        self._take_pending(states)
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], self._bitmask, rows)
        for i, state in zip(rows, states, strict=True):
            state.allow_start(self._bitmask, i)
            if state.broken:  # only its end is left to sample
                self._only_stop(i)
        return self._bitmask[: len(request_ids)], rows

    def _take_pending(self, states: list[GrammarState]) -> None:
        single = [s for s in states if len(s.pending) == 1 and not s.broken]
        if single:
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(
                [s.matcher for s in single], [s.pending[0] for s in single]
            )
            for state, ok in zip(single, accepted, strict=True):
                state.broken = not ok
                state.pending.clear()
        for state in states:
            if state.pending:
                state.flush()
            if state.broken:
                log.error("a sampled token broke its grammar; the request ends")

    def _only_stop(self, row: int) -> None:
        self._bitmask[row].zero_()
        for token in self.stop_ids:
            words = self._bitmask.numpy().view(np.uint32)
            words[row, token // 32] |= np.uint32(1 << (token % 32))

    def push(self, request_id: str, token: int) -> None:
        state = self.states.get(request_id)
        if state is not None:
            state.push(token)

    def ends_with(self, request_id: str, token: int) -> bool:
        """The grammar is over with this token (its stop token): nothing may follow, even under
        ignore_eos."""
        state = self.states.get(request_id)
        return state is not None and state.phase == "grammar" and token in self.stop_ids

    def completed(self, request_id: str) -> bool:
        """The grammar could end here (what min_tokens yields to)."""
        state = self.states.get(request_id)
        if state is None or state.phase != "grammar":
            return False
        state.flush()
        return bool(state.matcher.is_completed())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens' logits of ``rows`` to -inf, in place (xgrammar's kernel on the GPU).

    logits: [S, V] fp32; bitmask: [>= S, ceil(V / 32)] int32 on the host, bit j of word w
    allowing token 32 * w + j."""
    mask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, indices=rows)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Plain torch, for tests: unpack the bits and mask."""
    V = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int64)
    for r in rows:
        words = bitmask[r].to(torch.int64) & 0xFFFFFFFF  # [W]
        allowed = ((words[:, None] >> bits) & 1).flatten()[:V].bool()  # [V]
        logits[r] = logits[r].masked_fill(~allowed.to(logits.device), float("-inf"))
