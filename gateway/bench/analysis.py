"""From a finished run to its figures: summary + per-turn rows + exact bound (+ usage log).

The bound needs the engine tokens of every successful request in send order; they come
from `/tokenize` on `tokenize_url` (a replica, or the endpoint itself). When that fails the
summary says why and carries no bound rather than an estimate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.bench.bound import compute_bound
from gateway.bench.failures import error_reasons
from gateway.bench.groups import by
from gateway.bench.prefill import TokenizeError, engine_tokens
from gateway.bench.report import per_turn, predicted_error, summarize
from gateway.bench.runner import RunResult

ANALYSIS_ERRORS = (TokenizeError, aiohttp.ClientError, TimeoutError, KeyError)


async def bound_of(result: RunResult, tokenize_url: str, block_size: int = 16) -> dict[str, Any]:
    order = sorted(
        (i for i, r in enumerate(result.records) if r.error is None and r.prompt_tokens),
        key=lambda i: result.records[i].send_s,
    )
    inputs = await engine_tokens(
        tokenize_url, [result.bodies[i] for i in order], [result.replies[i] for i in order]
    )
    bound = compute_bound(inputs, block_size)
    return {
        "ratio": bound.ratio,
        "cached_tokens": bound.cached_tokens,
        "prompt_tokens": bound.prompt_tokens,
        "working_set_blocks": bound.distinct_blocks,
    }


def read_usage_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_bytes().splitlines():
        if line.strip():
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a torn last line when the gateway was stopped mid-write
            if isinstance(row, dict):
                rows.append(row)
    return rows


def analyse(
    result: RunResult,
    replicas: int = 0,
    tokenize_url: str | None = None,
    usage: Sequence[Mapping[str, Any]] | None = None,
    block_size: int = 16,
) -> dict[str, Any]:
    summary = summarize(result.records, result.wall_s, replicas)
    summary["unfinished_sessions"] = result.unfinished_sessions
    summary["error_reasons"] = error_reasons(result.records)
    if tokenize_url is not None:
        try:
            summary["bound"] = asyncio.run(bound_of(result, tokenize_url, block_size))
            summary["bound"]["block_size"] = block_size
        except ANALYSIS_ERRORS as e:
            summary["bound_error"] = f"{type(e).__name__}: {e}"
    bound = summary.get("bound")
    if bound and bound["cached_tokens"]:
        summary["bound_share"] = summary["cached_tokens"] / bound["cached_tokens"]
    if usage:
        summary["predicted"] = predicted_error(usage)
    summary["turns"] = per_turn(result.records)
    by_class = by(result.records, lambda r: r.priority)
    if by_class:
        summary["by_class"] = by_class
    by_tenant = by(result.records, lambda r: r.tenant)
    if by_tenant:
        summary["by_tenant"] = by_tenant
    return summary
