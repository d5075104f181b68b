"""One proxied request's facts, gathered along the request path and turned into its usage
record at the end (pure: the caller passes the end time from the same timer as `t0`)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.hygiene.finding import Finding
from gateway.proxy.errors import GatewayError
from gateway.proxy.relay import RelayOutcome
from gateway.usage.record import UsageRecord

MAX_ERROR_CHARS = 300


class Exchange:
    """Per-request facts that end up in the usage record."""

    __slots__ = (
        "best", "cached_from", "disconnected", "done", "endpoint", "error", "findings", "method",
        "model", "moved", "outcome", "predicted", "prefill_cached_tokens", "prefill_replica",
        "pulled_exact", "pulled_tokens", "replica", "request_id", "route", "session", "status",
        "stream", "t0", "target", "tenant", "transferred_tokens", "ts", "up_headers",
        "upstream_id", "withheld",
    )

    def __init__(self, request_id: str, ts: float, t0: float, endpoint: str,
                 method: str = "POST") -> None:
        self.request_id = request_id  # the client's id if usable, else upstream_id
        self.upstream_id = request_id  # the gateway's own random id, sent as X-Request-Id
        self.method = method
        self.ts = ts
        self.t0 = t0
        self.endpoint = endpoint
        self.tenant: str | None = None
        self.model = ""
        self.stream = False
        self.session: str | None = None
        self.findings: Sequence[Finding] = ()
        self.replica: str | None = None
        self.route: str | None = None
        self.moved: str | None = None
        self.predicted: int | None = None
        # the answer must not show what the index all tenants share decided (tenancy.py)
        self.withheld = False
        self.best: int | None = None
        self.status = 500
        self.error: str | None = None
        self.outcome = RelayOutcome()
        self.disconnected = False
        self.done = False  # the last byte was handed to the server: disconnects are moot
        self.target = ""  # the checked request target for the replica (gateway.proxy.target)
        self.up_headers: list[tuple[str, str]] = []  # the client headers that may go upstream
        # P/D (gateway.pd): the replica of the prefill leg, the tokens it offered the decode
        # replica, and where the reported cached tokens were found
        self.prefill_replica: str | None = None
        self.transferred_tokens: int | None = None
        self.cached_from: str | None = None
        # P's own reported cached tokens, and of those the ones pulled back from the decoder
        # (decoder_kv turns), exact or estimated (gateway.pd.accounting)
        self.prefill_cached_tokens: int | None = None
        self.pulled_tokens: int | None = None
        self.pulled_exact: bool | None = None

    def fail(self, error: GatewayError) -> None:
        self.status = error.status
        # A message may quote what the client sent (a model name, a JSON parse position);
        # the record keeps a bounded part of it.
        self.error = error.message[:MAX_ERROR_CHARS]

    def record(self, end: float) -> UsageRecord:
        """The usage record, `end` read from the same timer as `t0`."""
        o = self.outcome
        u = o.usage
        return UsageRecord(
            ts=self.ts, request_id=self.request_id, tenant=self.tenant, model=self.model,
            replica=self.replica, route=self.route, stream=self.stream, status=self.status,
            prompt_tokens=u.prompt_tokens if u else None,
            cached_tokens=u.cached_tokens if u else None,
            predicted_cached_tokens=self.predicted, best_available_tokens=self.best,
            completion_tokens=u.completion_tokens if u else None,
            ttft_ms=(o.first_byte - self.t0) * 1000.0 if o.first_byte is not None else None,
            latency_ms=(end - self.t0) * 1000.0, session=self.session,
            hygiene=len(self.findings), endpoint=self.endpoint, error=self.error, moved=self.moved,
            method=self.method, findings=tuple(self.findings),
            engine_request_id=self.upstream_id if self.replica is not None else None,
            prefill_replica=self.prefill_replica, transferred_tokens=self.transferred_tokens,
            cached_from=self.cached_from, prefill_cached_tokens=self.prefill_cached_tokens,
            pulled_tokens=self.pulled_tokens, pulled_exact=self.pulled_exact,
        )
