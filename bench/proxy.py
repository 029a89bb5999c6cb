"""The model proxy's added latency (SPEC §14): a loopback endpoint streams 1,000 SSE events
per call; each call is timed direct and through `SessionProxy` (recording), in the same
run. Prints time to first byte and to completion, p50/p95, and what the proxy added.

    python -m bench.proxy [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import aiohttp
from aiohttp import web

from trialledger.adapters.proxy.server import SessionProxy, Upstream

EVENTS = 1000


async def _endpoint() -> tuple[web.AppRunner, str]:
    frames = [f"event: response.output_text.delta\ndata: "
              f"{json.dumps({'type': 'response.output_text.delta', 'delta': 'x' * 40})}\n\n"
              for _ in range(EVENTS - 1)]
    frames.append("event: response.completed\ndata: " + json.dumps(
        {"type": "response.completed", "response": {"id": "r", "usage": {
            "input_tokens": 10, "output_tokens": 5, "total_tokens": 15}}}) + "\n\n")
    body = [frame.encode() for frame in frames]

    async def responses(request: web.Request) -> web.StreamResponse:
        await request.read()
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        for start in range(0, len(body), 50):  # 20 writes, as a model streams in bursts
            await answer.write(b"".join(body[start:start + 50]))
        await answer.write_eof()
        return answer

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/v1"


async def _time(client: aiohttp.ClientSession, url: str, token: str) -> tuple[float, float]:
    start = time.perf_counter()
    async with client.post(url + "/responses", data=b'{"stream":true}',
                           headers={"Authorization": f"Bearer {token}"}) as answer:
        first = None
        async for _ in answer.content.iter_any():
            first = first or time.perf_counter()
        end = time.perf_counter()
    return ((first or end) - start) * 1000, (end - start) * 1000


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def measure(calls: int) -> dict[str, Any]:
    """p50/p95 of first byte and completion, direct and through the proxy (ms)."""
    runner, url = await _endpoint()
    recorded: list[dict[str, Any]] = []

    async def sink(_at: str, data: dict[str, Any]) -> None:
        recorded.append(data)

    proxy = SessionProxy(Upstream(url, token="t", authorization="Bearer k"), sink=sink)
    port = await proxy.start()
    proxied = f"http://127.0.0.1:{port}/v1"
    timings: dict[str, list[tuple[float, float]]] = {"direct": [], "proxy": []}
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as client:
            for _ in range(calls):  # interleaved, so both see the same machine
                timings["direct"].append(await _time(client, url, "k"))
                timings["proxy"].append(await _time(client, proxied, "t"))
    finally:
        await proxy.aclose()
        await runner.cleanup()
    assert len(recorded) == calls and all(r["completed"] for r in recorded)
    out: dict[str, Any] = {}
    for path, pairs in timings.items():
        for index, label in ((0, "first byte"), (1, "completion")):
            values = [pair[index] for pair in pairs]
            out[f"{path} {label}"] = (_p(values, 50), _p(values, 95))
    return out


def report(calls: int) -> None:
    """Print the table and the added p95."""
    figures = asyncio.run(measure(calls))
    print(f"  model proxy, {calls} calls of {EVENTS} SSE events (ms, p50 / p95):")
    for name, (p50, p95) in figures.items():
        print(f"    {name:<22} {p50:8.2f} / {p95:8.2f}")
    for label in ("first byte", "completion"):
        added = figures[f"proxy {label}"][1] - figures[f"direct {label}"][1]
        print(f"  proxy added at p95, {label}: {added:.2f} ms (goal ≤ 5 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    report(parser.parse_args().calls)


if __name__ == "__main__":
    main()
