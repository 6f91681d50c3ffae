"""How long after a client hangs up are the workers' pools free again? A long prompt is sent,
the client disconnects while it is in prefill, and the gateway's ``/workers`` is polled until
every worker reports its whole pool free and nothing running, waiting or reserved (issue 16,
acceptance 4: 3000 tokens, both pools free within 2 s).

``/workers`` shows each worker's load as of the gateway's last poll (every second), so a
reported time is an upper bound that may include up to one poll interval::

    tandem up --max-model-len 4096 --port 8000 &
    python -m gateway.bench.cancel --url http://127.0.0.1:8000 --prompt-tokens 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx


def _idle(load: dict[str, Any] | None) -> bool:
    if load is None:
        return False
    return bool(
        load["free_blocks"] == load["total_blocks"]
        and load["num_running"] == load["num_waiting"] == load["num_reserved"] == 0
    )


async def _loads(client: httpx.AsyncClient) -> list[dict[str, Any] | None]:
    workers = (await client.get("/workers")).json()["workers"]
    return [w["load"] for w in workers]


async def _prompt(client: httpx.AsyncClient, model: str, tokens: int, salt: int) -> str:
    """A text of about ``tokens`` tokens (checked with /tokenize), unique per ``salt``."""
    unit = "Harbours keep their lanterns lit through the long winter nights. "
    per_unit = (await client.post("/tokenize", json={"model": model, "prompt": unit})).json()[
        "count"
    ]
    text = f"Run {salt}. " + unit * max(1, tokens // per_unit)
    count = (await client.post("/tokenize", json={"model": model, "prompt": text})).json()["count"]
    return text if count <= tokens else text[: len(text) * tokens // count]


async def one(
    client: httpx.AsyncClient, model: str, tokens: int, salt: int, lead_s: float
) -> dict[str, Any]:
    prompt = await _prompt(client, model, tokens, salt)
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True}

    async def send() -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass

    task = asyncio.ensure_future(send())
    started = time.monotonic()
    while not any(ld and ld["num_running"] for ld in await _loads(client)):
        if task.done() or time.monotonic() - started > 120:
            raise SystemExit("the prompt never showed up as running on a worker")
        await asyncio.sleep(0.05)
    await asyncio.sleep(lead_s)  # well into its prefill
    task.cancel()
    t0 = time.monotonic()
    await asyncio.gather(task, return_exceptions=True)
    while not all(_idle(ld) for ld in await _loads(client)):
        if time.monotonic() - t0 > 60:
            return {"prompt_chars": len(prompt), "freed_s": None}
        await asyncio.sleep(0.05)
    return {"prompt_chars": len(prompt), "freed_s": round(time.monotonic() - t0, 3)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, timeout=300, headers=headers) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        runs = [
            await one(client, model, args.prompt_tokens, i, args.lead_s)
            for i in range(args.repeats)
        ]
    freed = [r["freed_s"] for r in runs if r["freed_s"] is not None]
    return {"url": args.url, "model": model, "prompt_tokens": args.prompt_tokens, "runs": runs,
            "max_freed_s": max(freed) if len(freed) == len(runs) else None}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lead-s", type=float, default=1.0, help="seconds into the prefill to cancel")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
