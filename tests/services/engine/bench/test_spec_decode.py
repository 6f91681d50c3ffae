"""The speculative-decoding benchmark: the same tokens with and without a draft model, and
where the draft's time went (verify steps, proposals, forwards, the prompt fed beside the
target's prefill)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

from services.engine.bench.spec_decode import main


def _bench(*extra: str) -> dict[str, Any]:
    args = ["--prompts", "random", "--input-len", "24", "--batch", "1,2", "--max-tokens", "8",
            "--max-model-len", "256", *extra]  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    return json.loads(buf.getvalue())


def test_the_bench_reports_where_the_drafts_time_went() -> None:
    off = _bench()
    on = _bench("--speculative-config", '{"model": "embedded", "num_speculative_tokens": 3}')
    for a, b in zip(off["results"], on["results"], strict=True):
        assert a["token_ids"] == b["token_ids"] and a["outputs_sha256"] == b["outputs_sha256"]
        assert a["speculation"]["propose_s"] == 0 and a["ttft_ms_mean"] > 0
        spent = b["speculation"]
        # the embedded model drafting for itself: every draft kept, 8 tokens in a few steps
        assert b["verify_steps"] > 0 and b["accepted_tokens"] == b["draft_tokens"]
        assert spent["steps"] < 8 and spent["proposals"] > 0 and spent["propose_s"] > 0
        # each request's 24-token prompt went to the draft beside the target's prefill, so the
        # proposals caught up on a token or two per request and verify step
        assert spent["prefill_tokens"] == 24 * b["requests"]
        assert spent["catchup_tokens"] <= 2 * b["verify_steps"]
        assert sum(int(k) * n for k, n in spent["drafts_by_k"].items()) == b["draft_tokens"]
