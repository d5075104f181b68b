"""The request flow's tracing seam (gateway.proxy.flow calls it; no OpenTelemetry import
here, so a core install without the `otel` extra runs as before).

    begin(headers, endpoint, method) -> Trace     at the flow's begin
    end(trace, record, class, queued_ms)          at the flow's finish, once

`Trace.upstream` is the trace context the replica is sent (gateway.tracing.propagate):
the gateway span's own with tracing on, the client's validated one with it off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from gateway.tracing import propagate
from gateway.usage.record import UsageRecord


class Trace:
    __slots__ = ("span", "upstream")

    def __init__(self, span: Any, upstream: tuple[tuple[str, str], ...]) -> None:
        self.span = span  # the SDK's span, or None
        self.upstream = upstream


class RequestTracer(Protocol):
    def begin(self, headers: Sequence[tuple[str, str]], endpoint: str, method: str,
              model: str | None = None) -> Trace: ...

    def end(self, trace: Trace, rec: UsageRecord, admission_class: str | None,
            queued_ms: float | None) -> None: ...

    def close(self) -> None: ...


class Passthrough:
    """Tracing off: no span; the client's trace context goes upstream when well formed."""

    def begin(self, headers: Sequence[tuple[str, str]], endpoint: str, method: str,
              model: str | None = None) -> Trace:
        return Trace(None, propagate.client_context(headers))

    def end(self, trace: Trace, rec: UsageRecord, admission_class: str | None,
            queued_ms: float | None) -> None:
        return None

    def close(self) -> None:
        return None
