"""A finished request's span attributes, from its usage record (pure).

GenAI semantic conventions (gen_ai.*) for the inference routes; the gateway's own
decisions under `gateway.*`. Nothing a client wrote goes in beyond the model name and
the route's path (a forwarded path is cut to 200 characters by the flow): no prompt, no
session id, no key. The tenant is the operator's own name for a key ([auth] keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.usage.record import UsageRecord

AttrValue = str | bool | int | float | tuple[str, ...]

# gen_ai.operation.name per routed endpoint (Responses and Messages are chats to vLLM)
OPERATION: Mapping[str, str] = {
    "chat": "chat", "completions": "text_completion", "responses": "chat",
    "messages": "chat",
}
PROVIDER = "vllm"


def span_name(endpoint: str, model: str | None) -> str:
    """`{operation} {model}` for an inference route (the GenAI convention), else the
    gateway's name for a forwarded call (bounded: the path is an attribute)."""
    op = OPERATION.get(endpoint)
    if op is None:
        return "gateway forward"
    return f"{op} {model}" if model else op


def start_attributes(endpoint: str, method: str, model: str | None) -> dict[str, AttrValue]:
    out: dict[str, AttrValue] = {"http.request.method": method}
    op = OPERATION.get(endpoint)
    if op is not None:
        out["gen_ai.operation.name"] = op
        out["gen_ai.provider.name"] = PROVIDER
        out["gen_ai.system"] = PROVIDER  # the older name, still read by many backends
    else:
        out["url.path"] = endpoint
    if model:
        out["gen_ai.request.model"] = model
    return out


def end_attributes(rec: UsageRecord, admission_class: str | None,
                   queued_ms: float | None) -> dict[str, AttrValue]:
    """What the request became (the record) and how it was admitted (the ticket's)."""
    out: dict[str, AttrValue] = {"http.response.status_code": rec.status,
                                 "gateway.request_id": rec.request_id,
                                 "gateway.stream": rec.stream}
    optional: dict[str, Any] = {
        "gen_ai.request.model": rec.model if rec.endpoint in OPERATION else None,
        "gen_ai.usage.input_tokens": rec.prompt_tokens,
        "gen_ai.usage.output_tokens": rec.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": rec.cached_tokens,
        "gateway.route": rec.route,
        "gateway.replica": rec.replica,
        "gateway.tenant": rec.tenant,
        "gateway.cache.predicted_tokens": rec.predicted_cached_tokens,
        # P/D: the prefill replica's own hits (what its prediction is judged by), the
        # tokens it pulled back from the decoder apart (UsageRecord.cache_split)
        "gateway.cache.delivered_tokens": rec.cache_split()[1],
        "gateway.cache.pulled_tokens": rec.pulled_tokens,
        "gateway.pd.prefill_replica": rec.prefill_replica,
        "gateway.cache.best_available_tokens": rec.best_available_tokens,
        "gateway.moved": rec.moved,
        "gateway.admission.class": admission_class,
        "gateway.admission.queued_ms": queued_ms,
        "gateway.ttft_ms": rec.ttft_ms,
        "error.type": rec.error[:200] if rec.error else None,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    if rec.findings:
        out["gateway.hygiene.findings"] = tuple(sorted({f.kind for f in rec.findings}))
        out["gateway.hygiene.finding_count"] = rec.hygiene
    return out
