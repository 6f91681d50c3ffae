"""Does anything stall the gateway's streams? 16 streams alone, then 16 streams while a 4 MB
``/tokenize`` runs and 50 clients send their headers a byte at a time (issue 16, acceptance 3).

Reports, per phase, the largest gap between two tokens of any stream (and its p99), how long the
big ``/tokenize`` took and what it answered, and how the slow-header connections ended (a 408
and a close within ``--header-timeout``, or still open at the end). Against a running gateway::

    tandem up --port 8000 &
    python -m gateway.bench.stall --url http://127.0.0.1:8000 --out stall.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx


@dataclass
class StreamTimes:
    arrivals: list[float] = field(default_factory=list)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.arrivals)]


@dataclass
class Phase:
    name: str
    streams: int
    tokens: int
    max_gap_s: float
    p99_gap_s: float
    median_gap_s: float
    tokenize: dict[str, Any] | None = None
    slow_clients: dict[str, Any] | None = None


async def one_stream(client: httpx.AsyncClient, model: str, max_tokens: int, i: int) -> StreamTimes:
    times = StreamTimes()
    body = {
        "model": model,
        "prompt": f"Stream {i}: tell me a long story about the sea.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.arrivals.append(time.monotonic())
    return times


async def streams(
    client: httpx.AsyncClient, model: str, n: int, max_tokens: int
) -> list[StreamTimes]:
    return list(await asyncio.gather(*(one_stream(client, model, max_tokens, i) for i in range(n))))


def summarize(name: str, results: list[StreamTimes]) -> Phase:
    gaps = sorted(g for r in results for g in r.gaps[1:])  # from the second token on: ITL
    if not gaps:
        raise SystemExit(f"{name}: no inter-token gaps measured (max_tokens too small?)")
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    return Phase(
        name, len(results), sum(len(r.arrivals) for r in results),
        round(gaps[-1], 4), round(p99, 4), round(statistics.median(gaps), 4),
    )  # fmt: skip


async def big_tokenize(client: httpx.AsyncClient, model: str, size: int) -> dict[str, Any]:
    rng = random.Random(0)
    words = ["parcel", "ocean", "sorting", "harbour", "lantern", "quietly", "seven", "blue"]
    text_parts, n = [], 0
    while n < size:
        w = rng.choice(words)
        text_parts.append(w)
        n += len(w) + 1
    text = " ".join(text_parts)[:size]
    t0 = time.monotonic()
    r = await client.post("/tokenize", json={"model": model, "prompt": text}, timeout=600)
    took = time.monotonic() - t0
    count = r.json().get("count") if r.status_code == 200 else None
    return {"bytes": len(text), "status": r.status_code, "count": count, "seconds": round(took, 3)}


async def slow_client(host: str, port: int, stop: asyncio.Event) -> dict[str, Any]:
    """Sends a request head a byte every 100 ms, valid but never finished (one header line after
    another), until the server answers or closes the connection."""
    start = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    line = b"X-Slow: still-coming\r\n"
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.monotonic()
    i, reply = 0, b""
    try:
        while not stop.is_set():
            if i < len(start):
                byte = start[i : i + 1]
            else:
                j = (i - len(start)) % len(line)
                byte = line[j : j + 1]
            try:
                writer.write(byte)
                await writer.drain()
            except (ConnectionError, OSError):
                break
            i += 1
            try:
                reply = await asyncio.wait_for(reader.read(256), 0.1)
                break  # the server answered (408) or closed
            except TimeoutError:
                continue
        if reply:
            reply += await asyncio.wait_for(reader.read(), 5)  # until it closes
    finally:
        writer.close()
    closed = bool(reply) or not stop.is_set()
    return {"closed_s": round(time.monotonic() - t0, 3) if closed else None,
            "status": reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else None}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    url = urlsplit(args.url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(
        base_url=args.url, timeout=600, limits=limits, headers=headers
    ) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await streams(client, model, 2, 4)  # warm-up
        alone = summarize(
            "16 streams alone", await streams(client, model, args.streams, args.max_tokens)
        )

        stop = asyncio.Event()
        running = asyncio.ensure_future(streams(client, model, args.streams, args.max_tokens))
        await asyncio.sleep(args.lead_s)  # the streams are under way
        slow = [
            asyncio.ensure_future(slow_client(url.hostname or "127.0.0.1", url.port or 80, stop))
            for _ in range(args.slow_clients)
        ]
        tokenize = await big_tokenize(client, model, args.tokenize_bytes)
        loaded_results = await running
        stop.set()
        ends = await asyncio.gather(*slow)
    loaded = summarize("16 streams + 4 MB /tokenize + slow headers", loaded_results)
    loaded.tokenize = tokenize
    closed = [e["closed_s"] for e in ends if e["closed_s"] is not None]
    loaded.slow_clients = {
        "count": len(ends),
        "closed": len(closed),
        "statuses": sorted({str(e["status"]) for e in ends}),
        "max_closed_s": max(closed) if closed else None,
    }
    return {
        "url": args.url,
        "model": model,
        "max_tokens": args.max_tokens,
        "phases": [asdict(alone), asdict(loaded)],
        "max_gap_growth_ms": round(1000 * (loaded.max_gap_s - alone.max_gap_s), 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--tokenize-bytes", type=int, default=4_000_000)
    p.add_argument("--slow-clients", type=int, default=50)
    p.add_argument("--lead-s", type=float, default=1.0, help="seconds of streaming before the load")
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    alone, loaded = result["phases"]
    print(f"\n{'phase':<46} {'max gap ms':>10} {'p99 gap ms':>10}")
    for ph in (alone, loaded):
        print(f"{ph['name']:<46} {1000 * ph['max_gap_s']:>10.1f} {1000 * ph['p99_gap_s']:>10.1f}")
    print(f"max gap growth: {result['max_gap_growth_ms']} ms; tokenize: {loaded['tokenize']}; "
          f"slow clients: {loaded['slow_clients']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
