"""Why requests failed: every distinct reason with its count (pure).

A failed request's record holds the first bytes of the error body (or the client-side
exception). An OpenAI-shaped body is reduced to its `error.message` (with the status), so
identical refusals group together however their ids differ; anything else is kept as is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from gateway.bench.runner import RequestRecord

MAX_REASON_CHARS = 200


def reason(status: int | None, error: str) -> str:
    try:
        body = orjson.loads(error)
    except orjson.JSONDecodeError:
        body = None
    message = error
    if body is None and '"message":"' in error:
        # A body cut short by the runner's capture: take the message as far as it goes.
        message = error.split('"message":"', 1)[1].split('","', 1)[0]
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            message = inner["message"]
        elif isinstance(body.get("detail"), str):  # FastAPI's shape
            message = body["detail"]
    message = " ".join(message.split())[:MAX_REASON_CHARS]
    return f"{status}: {message}" if status else message


def error_reasons(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """Distinct reasons, most frequent first: `[{"reason": ..., "count": n}, ...]`."""
    counts = Counter(reason(r.status, r.error) for r in records if r.error is not None)
    return [{"reason": k, "count": n} for k, n in counts.most_common()]


def format_reasons(reasons: Sequence[dict[str, Any]]) -> list[str]:
    return [f"  {r['count']:>5} x {r['reason']}" for r in reasons]
