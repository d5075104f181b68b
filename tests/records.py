"""A complete `UsageRecord` for usage tests: one served chat request with typical numbers;
keyword arguments override any field."""

from __future__ import annotations

from typing import Any

from gateway.usage.record import UsageRecord


def usage_record(**kw: Any) -> UsageRecord:
    base: dict[str, Any] = dict(
        ts=1000.0, request_id="r", tenant=None, model="m", replica="a", route="prefix",
        stream=True, status=200, prompt_tokens=1000, cached_tokens=0,
        predicted_cached_tokens=600, best_available_tokens=800, completion_tokens=10,
        ttft_ms=100.0, latency_ms=600.0, session="s",
    )  # fmt: skip
    base.update(kw)
    return UsageRecord(**base)
