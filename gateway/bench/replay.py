"""`gateway-bench replay TRACE`: a Mooncake trace against an OpenAI-compatible endpoint.

Each trace request is sent at `timestamp / speedup` (wall seconds from the start) as a
streamed `/v1/completions` call with the synthesized prompt and
`max_tokens = min(output_length, max_tokens_cap)`. At most `max_in_flight` requests are
open at once (later ones wait, and the delay shows in their latency); the whole replay is
bounded by `max_wall_s`. Results are the usual summary next to the trace's own bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from gateway.bench.client import post
from gateway.bench.progress import Progress
from gateway.bench.runner import RequestRecord, RunResult, record_of
from gateway.bench.session import TurnRequest
from gateway.bench.trace import TraceRequest, prompt_text


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    base_url: str
    model: str
    speedup: float = 1.0
    max_tokens_cap: int = 64
    max_in_flight: int = 64
    request_timeout_s: float = 300.0
    max_wall_s: float = 600.0
    progress: bool = True


async def replay(requests: Sequence[TraceRequest], opts: ReplayOptions) -> RunResult:
    result = RunResult()
    progress = Progress(len(requests), label="replay", enabled=opts.progress)
    gate = asyncio.Semaphore(max(1, opts.max_in_flight))
    url = opts.base_url.rstrip("/") + "/v1/completions"
    start = time.perf_counter()
    origin = requests[0].timestamp_ms if requests else 0

    async def one(http: aiohttp.ClientSession, i: int, req: TraceRequest) -> None:
        delay = (req.timestamp_ms - origin) / 1000 / opts.speedup
        wait = start + delay - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        body = {
            "model": opts.model,
            "prompt": prompt_text(req),
            "max_tokens": max(1, min(req.output_length, opts.max_tokens_cap)),
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        turn = TurnRequest(session_id=f"trace-{i}", agent="trace", turn=0, sibling=0, body=body)
        async with gate:
            send_s = time.perf_counter() - start
            ex = await post(http, url, body, timeout_s=opts.request_timeout_s)
        rec: RequestRecord = record_of(turn, ex, send_s)
        result.records.append(rec)
        result.bodies.append(body)
        result.replies.append(ex.text)
        progress.advance(error=ex.error is not None)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.create_task(one(http, i, r)) for i, r in enumerate(requests)]
        _, pending = await asyncio.wait(tasks, timeout=opts.max_wall_s) if tasks else ((), ())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        result.unfinished_sessions = len(pending)
    result.wall_s = time.perf_counter() - start
    progress.close()
    return result
