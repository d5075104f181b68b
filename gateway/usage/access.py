"""The access log: one line per finished request (logger `gateway.access`, level info),
made from its usage record, so the line and the record never disagree. Pure apart from the
logger call; `[server] access_log = false` turns it off."""

from __future__ import annotations

import logging
from typing import Any

from gateway.usage.record import ENDPOINT_KINDS, UsageRecord

log = logging.getLogger("gateway.access")

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "responses": "/v1/responses", "messages": "/v1/messages"}


def access_fields(rec: UsageRecord) -> dict[str, Any]:
    """The line's fields: what an operator greps for, tokens and timings included."""
    path = _PATHS.get(rec.endpoint, rec.endpoint) if rec.endpoint in ENDPOINT_KINDS \
        else rec.endpoint
    fields: dict[str, Any] = {
        "method": rec.method, "path": path, "status": rec.status, "model": rec.model,
        "replica": rec.replica, "route": rec.route, "stream": rec.stream,
        "prompt_tokens": rec.prompt_tokens, "cached_tokens": rec.cached_tokens,
        "predicted_cached_tokens": rec.predicted_cached_tokens,
        # a non-streamed answer's first byte is its last: its TTFT would be its latency
        "ttft_ms": None if rec.ttft_ms is None or not rec.stream else round(rec.ttft_ms, 1),
        "latency_ms": round(rec.latency_ms, 1), "request_id": rec.request_id,
    }
    if rec.tenant is not None:
        fields["tenant"] = rec.tenant
    if rec.moved is not None:
        fields["moved"] = rec.moved
    if rec.error is not None:
        fields["error"] = rec.error[:200]
    return fields


def log_access(rec: UsageRecord) -> None:
    if log.isEnabledFor(logging.INFO):
        fields = access_fields(rec)
        log.info("%s %s %d", fields["method"], fields["path"], rec.status, extra=fields)
