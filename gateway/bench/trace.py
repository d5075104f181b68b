"""Mooncake trace format: parsing, slicing, prompt synthesis and the trace's own bound (pure).

A line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`
with one hash id per 512-token block of the prompt (the last block may be partial).

Prompt synthesis: block id `h` always becomes the same `TRACE_BLOCK_TOKENS` tokens' worth of
text (`words("trace-block:h", 512)`), so shared ids become shared text prefixes; the last
block is cut to the remaining length (a prefix of the same text, so partial blocks still
share with full ones). Blocks are joined with a newline, which keeps tokenization of each
block independent of its neighbours.

The trace's bound: for each request, the longest run of leading hash ids seen in any
earlier request, in tokens (capped at the input length and at vLLM's floor((N-1)/16)*16).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson

from gateway.bench.bound import max_cache_hit
from gateway.bench.text import words

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace(lines: Iterable[bytes | str]) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            out.append(
                TraceRequest(
                    timestamp_ms=int(row["timestamp"]),
                    input_length=int(row["input_length"]),
                    output_length=int(row["output_length"]),
                    hash_ids=tuple(int(h) for h in row["hash_ids"]),
                )
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise TraceError(f"trace line {n}: {type(e).__name__}: {e}") from e
    return out


def select(
    requests: Sequence[TraceRequest], minutes: float | None = None, limit: int | None = None
) -> list[TraceRequest]:
    """The first `minutes` of the trace, then at most `limit` requests."""
    chosen = [r for r in requests if minutes is None or r.timestamp_ms < minutes * 60_000]
    return chosen[:limit] if limit is not None else chosen


def block_text(hash_id: int, tokens: int = TRACE_BLOCK_TOKENS) -> str:
    return words(f"trace-block:{hash_id}", tokens)


def prompt_text(req: TraceRequest) -> str:
    parts = []
    remaining = req.input_length
    for h in req.hash_ids:
        if remaining <= 0:
            break
        size = min(TRACE_BLOCK_TOKENS, remaining)
        parts.append(block_text(h, size))
        remaining -= size
    return "\n".join(parts)


def trace_bound(requests: Sequence[TraceRequest], block_size: int = 16) -> tuple[int, int]:
    """(best cached tokens, prompt tokens) of the trace in its own units."""
    seen: set[tuple[int, ...]] = set()
    best = total = 0
    for req in requests:
        ids = req.hash_ids
        matched = 0
        while matched < len(ids) and ids[: matched + 1] in seen:
            matched += 1
        hit = min(matched * TRACE_BLOCK_TOKENS, req.input_length)
        best += min(hit, max_cache_hit(req.input_length, block_size))
        total += req.input_length
        for k in range(1, len(ids) + 1):
            seen.add(ids[:k])
    return best, total
