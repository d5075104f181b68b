"""The per-request usage record (design.md section 4), shared by the request path,
the sinks, the metrics and the stats windows.

One record per proxied request, whatever its outcome: `status` is the HTTP status the
client saw (or 499 when the client went away first). `cached_tokens` is exactly what the
engine reported (`usage.prompt_tokens_details.cached_tokens`), `None` when it reported
nothing; a reported 0 stays 0. `hygiene` counts the request's hygiene findings and
`findings` lists them (design.md section 4 schema).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

from gateway.hygiene.finding import Finding

# The replica of a request that ended after its replica left the fleet, in the metrics and
# the /stats windows (the usage log and sinks keep the real name: they hold no map of it).
DEPARTED: Final = "departed"
# The label of a value that is None (no replica, no tenant, no route) in the metrics.
NONE_LABEL: Final = "none"
ENDPOINT_KINDS: Final = frozenset({"chat", "completions", "responses", "messages"})


@dataclass(slots=True)
class UsageRecord:
    ts: float  # unix seconds when the request arrived
    request_id: str
    tenant: str | None
    model: str
    replica: str | None  # None when no replica was chosen (e.g. 503 with none healthy)
    route: str | None  # the policy's reason (x-gateway-route)
    stream: bool
    status: int
    prompt_tokens: int | None
    cached_tokens: int | None
    predicted_cached_tokens: int | None
    best_available_tokens: int | None
    completion_tokens: int | None
    ttft_ms: float | None
    latency_ms: float
    session: str | None
    hygiene: int = 0  # number of hygiene findings for this request
    endpoint: str = "chat"  # "chat" | "completions" | "responses" | "messages" | forwarded path
    error: str | None = None  # short error text for failed/cancelled requests
    # Why the request's session or implicit conversation left the replica it was on
    # (unavailable | evicted | load); None when it stayed or had none.
    moved: str | None = None
    method: str = "POST"  # the client's HTTP method (not POST only for forwarded calls)
    # The findings themselves (at most 16, spans redacted unless configured otherwise):
    # what /stats aggregates and what `gateway lint` reads back from a usage log.
    findings: tuple[Finding, ...] = ()
    # The id the engine got as X-Request-Id (the gateway's own random one, never the
    # client's), to find this request in a replica's logs; None for records made before.
    engine_request_id: str | None = None
    # P/D (gateway.pd): the replica that computed the prompt when another decoded it (None:
    # one replica did both), the prompt tokens whose KV it offered the decoder, and where
    # `cached_tokens` were found ("prefill": on that replica, as vLLM >= 0.32 reports them
    # on the decoder; None: on `replica`)
    prefill_replica: str | None = None
    transferred_tokens: int | None = None
    cached_from: str | None = None
    # P's own report on the prefill leg (its answer's cached tokens: its cache hits plus
    # any pulled), and on "decoder_kv" turns the tokens of it pulled back from the decoder
    # with whether that count is exact (False: estimated from P's prediction,
    # gateway.pd.accounting); None on one-leg requests
    prefill_cached_tokens: int | None = None
    pulled_tokens: int | None = None
    pulled_exact: bool | None = None

    def cache_split(self) -> tuple[int | None, int | None, int]:
        """(prompt, cached, pulled) as the cache figures count them: a two-leg request's
        cached tokens are P's own report (the decoder's is a copy of it, or on engines
        before vLLM 0.32 the whole transferred prompt), and tokens pulled back from the
        decoder are neither cache hits nor misses: they leave both counts."""
        prompt, cached = self.prompt_tokens, self.cached_tokens
        if self.prefill_replica is None:
            return prompt, cached, 0
        if self.prefill_cached_tokens is None:
            # P said nothing: D's copy of its count holds any tokens pulled back from the
            # decoder as hits, so on such a turn the hits are unknown
            return prompt, (None if self.cached_from == "decoder_kv" else cached), 0
        pulled = self.pulled_tokens or 0
        hits = max(0, self.prefill_cached_tokens - pulled)
        return (None if prompt is None else max(0, prompt - pulled)), hits, pulled

    @property
    def endpoint_kind(self) -> str:
        """The endpoint as a bounded label: a forwarded path (the client chose it) is
        "other"."""
        return self.endpoint if self.endpoint in ENDPOINT_KINDS else "other"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
