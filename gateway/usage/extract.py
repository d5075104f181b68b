"""Usage as the engine reported it, read from a non-streaming JSON body or from the
`usage` object of a stream chunk (pure).

vLLM puts `prompt_tokens`, `completion_tokens` and, with `--enable-prompt-tokens-details`,
`prompt_tokens_details.cached_tokens` in `usage`. `cached_tokens` stays `None` whenever the
engine did not report it (details absent or `null`, as vLLM <= 0.23 does for a cold request);
a reported 0 stays 0. Counts that are not non-negative integers are treated as not reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def usage_from_mapping(usage: Any) -> Usage | None:
    """The `usage` object of a body or chunk; None when it is absent or not an object."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        cached_tokens=cached,
    )


def usage_from_body(body: bytes) -> Usage | None:
    """Usage of a complete JSON response body; None for bodies without one."""
    if b'"usage"' not in body:  # error bodies and most non-chat answers: skip the parse
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    return usage_from_mapping(doc.get("usage"))
