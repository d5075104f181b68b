"""Who may read which field of `/stats` and which `/metrics` family (pure).

Every field is classified here, in one place, as **fleet-wide** or **tenant-scoped**:

- fleet-wide: the fleet's health, load, volume and speed (requests, token volumes, status
  counts, latency percentiles, replica health and KV usage, queue depths). No field names
  a tenant, a session, a user or a request, and none depends on what any prompt contains
  beyond its length.
- tenant-scoped: anything that names a tenant (`by_tenant`, `admission.admitted_tokens`,
  `tenant` labels), describes prompts (hygiene findings: session ids, request ids, spans),
  or tells how much of the prompts the cache shares (cached, predicted and best-available
  tokens and every ratio of them, the engines' prefix-cache hits): summed over tenants,
  such a figure moves with another tenant's prompts, so a key could learn from it whether
  a prefix was sent.

The lists below name the fleet-wide fields (`FLEET_STATS`, `FLEET_METRICS`); everything
else is tenant-scoped, so a field or family added later is private until it is listed.

Audiences (`audience`): without `[auth] keys` the caller is the `operator` (there are no
tenants) and reads everything; an admin key (`[auth] admin_tenants`) likewise. Any other
key is a `tenant`: the fleet-wide fields plus its own tenant's rows (`OWN_STATS`: its
`by_tenant` entries, its admitted tokens, its own hygiene findings), never another's.
`public` (`[auth] public_metrics` and no valid key): fleet-wide fields only. `/metrics`
gives non-operators the fleet-wide families only (a tenant's own series are in `/stats`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Audience = Literal["operator", "tenant", "public"]

# A spec: True keeps the whole subtree; a mapping keeps the listed keys ("*": any key,
# e.g. a window, a replica, a model, a status), applied to each element of a list;
# `Rows(field)` keeps the list elements whose `field` is the reader's tenant.
@dataclass(frozen=True, slots=True)
class Rows:
    field: str
    omit: frozenset[str] = frozenset()  # fields left out of each kept row


Spec = bool | Mapping[str, "Spec"] | Rows


# Volume only: no cached/predicted/best-available figure and no ratio of them.
_VOLUME: Mapping[str, Spec] = {"requests": True, "prompt_tokens": True, "completion_tokens": True,
                 "records_without_cached_tokens": True}

FLEET_STATS: Mapping[str, Spec] = {
    "summary": {"uptime_s": True, "requests": True, "requests_last_5m": True,
                "ttft_p99_ms_last_5m": True, "latency_p99_ms_last_5m": True,
                "replicas": True},
    "now": True, "uptime_s": True, "first_record_ts": True, "last_record_ts": True,
    "bucket_s": True,
    "windows": {"*": {
        **_VOLUME, "window_s": True, "covered_s": True, "from_ts": True, "to_ts": True,
        "by_status": True, "gateway_rejected": True, "prompt_tokens_percentiles": True,
        "total_tokens_p99": True, "max_model_len_suggestion": True, "latency": True,
        "ttft": True, "tpot": True,
        "by_model": {"*": _VOLUME}, "by_replica": {"*": _VOLUME},
        "by_endpoint": {"*": _VOLUME},
    }},
    "replicas": {"*": {
        "scraped": True, "scraped_at": True, "kv_cache_usage": True, "kv_level": True,
        "requests_running": True, "requests_waiting": True, "capacity_tokens": True,
        "capacity_source": True, "reports_cached_tokens": True, "url": True,
        "healthy": True, "in_flight": True}},
    "sinks": True,
    # token mode's health; its block and event counts are tenant-scoped: they move with
    # whether the engine already held a prompt's blocks (a BlockStored event or none)
    "token_mode": {"models": True, "block_size": True, "replicas": {"*": {
        "model": True, "sources": True, "state": True, "block_size": True, "problem": True,
        "parity": True, "events": {"gaps": True, "lost": True, "restarts": True,
                                   "decode_errors": True}}}},
    # per replica, where the queue's room came from: load and age, like `replicas` above
    "admission": {"enabled": True, "queued": True, "shed": True, "wait_ms": True,
                  "replicas": {"*": {"source": True, "snapshot_age_s": True,
                                     "seq_limit": True, "occupancy": True,
                                     "engine_waiting": True}}},
}

# What a tenant's key reads of its own tenant besides the fleet-wide fields; "{tenant}"
# stands for its tenant's name.
OWN_STATS: Mapping[str, Spec] = {
    "windows": {"*": {"by_tenant": {"{tenant}": True},
                      "hygiene": {"by_tenant": {"{tenant}": True}}}},
    "hygiene": {"window": True, "covered_s": True, "warn_share": True,
                "by_tenant": {"{tenant}": True}, "latest": Rows("tenant")},
    "admission": {"admitted_tokens": {"{tenant}": True}},
}

# The same where the routing index is shared by every tenant (token mode without
# `tenant_cache_salt`, proxy/tenancy.py `shared_index`): a key's own figures less what that
# index decided (the predicted and best-available tokens behind `available`, `captured`,
# `delivered`; the replica of its findings), as its answers' headers withhold them. The
# engine's own `cached_tokens` stay: the engine puts them in every answer's usage.
_OWN_ENGINE_FIGURES: Mapping[str, Spec] = {
    **_VOLUME, "cached_tokens": True, "cached_ratio": True}
OWN_STATS_SHARED_INDEX: Mapping[str, Spec] = {
    **OWN_STATS,
    "windows": {"*": {"by_tenant": {"{tenant}": _OWN_ENGINE_FIGURES},
                      "hygiene": {"by_tenant": {"{tenant}": True}}}},
    "hygiene": {"window": True, "covered_s": True, "warn_share": True,
                "by_tenant": {"{tenant}": True},
                "latest": Rows("tenant", omit=frozenset({"replica"}))},
}

# /metrics families (names as the registry collects them: a counter without `_total`).
FLEET_METRICS: frozenset[str] = frozenset({
    "gateway_ttft_seconds", "gateway_non_streamed_latency_seconds",
    "gateway_request_latency_seconds", "gateway_request_prompt_tokens",
    "gateway_endpoint_requests", "gateway_endpoint_prompt_tokens",
    "gateway_routing_decisions", "gateway_route_moves",
    "gateway_records_without_cached_tokens",
    "gateway_usage_sink_errors", "gateway_usage_records_dropped",
    "gateway_replica_healthy", "gateway_replica_in_flight", "gateway_replica_kv_cache_usage",
    "gateway_replica_requests_waiting", "gateway_replica_requests_running",
    "gateway_replica_capacity_tokens",
    "gateway_admission_queued", "gateway_admission_wait_seconds",
    "gateway_admission_shed", "gateway_admission_abandoned",
    "gateway_upstream_failures", "gateway_upstream_pool_busy", "gateway_upstream_retries",
    "gateway_trace_spans_dropped", "gateway_trace_spans_exported",  # [tracing]
    # The gateway process's own CPU, memory, descriptors and collector: they move with the
    # whole fleet's load and prompt sizes (already fleet-wide), never with what a prompt
    # says or which tenant sent it. `python_info` (the exact Python build) is left to the
    # operator: of no use to a tenant, and a fingerprint for a public reader.
    "process_cpu_seconds", "process_virtual_memory_bytes", "process_resident_memory_bytes",
    "process_start_time_seconds", "process_open_fds", "process_max_fds",
    "python_gc_objects_collected", "python_gc_objects_uncollectable", "python_gc_collections",
})


# Families that count what routing decided: fleet-wide where the index is each tenant's,
# tenant-scoped where it is shared (a route reason moving from `cold` to `prefix` would
# tell a key that another tenant sent its prompt).
ROUTED_METRICS: frozenset[str] = frozenset({"gateway_routing_decisions", "gateway_route_moves"})


def audience(keys_configured: bool, tenant: str | None, admin: bool) -> Audience:
    """`tenant`: the caller's valid key's tenant, None for no valid key."""
    if not keys_configured or admin:
        return "operator"
    return "tenant" if tenant is not None else "public"


def stats_view(stats: Mapping[str, Any], who: Audience, tenant: str | None = None, *,
               shared_index: bool = False) -> dict[str, Any]:
    """What `who` (of `tenant`) may read of a /stats document; `shared_index`: the
    routing index is every tenant's (OWN_STATS_SHARED_INDEX)."""
    if who == "operator":
        return dict(stats)
    spec: Mapping[str, Spec] = FLEET_STATS
    if who == "tenant" and tenant is not None:
        own = OWN_STATS_SHARED_INDEX if shared_index else OWN_STATS
        spec = _merge(FLEET_STATS, _for_tenant(own, tenant))
    kept = _prune(stats, spec, tenant)
    assert isinstance(kept, dict)
    return kept


def _prune(doc: Any, spec: Spec, tenant: str | None) -> Any:
    if spec is True:
        return doc
    if isinstance(spec, Rows):
        if not isinstance(doc, list):
            return []
        return [{k: v for k, v in r.items() if k not in spec.omit} for r in doc
                if isinstance(r, dict) and tenant is not None and r.get(spec.field) == tenant]
    if spec is False:
        return None
    if isinstance(doc, list):
        return [_prune(v, spec, tenant) for v in doc]
    if not isinstance(doc, Mapping):
        return None  # a leaf where the spec expected an object: not shown
    out: dict[str, Any] = {}
    for key, value in doc.items():
        sub = spec.get(key, spec.get("*"))
        if sub is None or sub is False:
            continue
        out[key] = _prune(value, sub, tenant)
    return out


def _for_tenant(spec: Mapping[str, Spec], tenant: str) -> dict[str, Spec]:
    out: dict[str, Spec] = {}
    for key, sub in spec.items():
        name = tenant if key == "{tenant}" else key
        out[name] = _for_tenant(sub, tenant) if isinstance(sub, Mapping) else sub
    return out


def _merge(a: Mapping[str, Spec], b: Mapping[str, Spec]) -> dict[str, Spec]:
    out: dict[str, Spec] = dict(a)
    for key, sub in b.items():
        mine = out.get(key)
        if isinstance(mine, Mapping) and isinstance(sub, Mapping):
            out[key] = _merge(mine, sub)
        elif mine is not True:
            out[key] = sub
    return out


class _Collector(Protocol):
    def collect(self) -> Iterable[Any]: ...


class FleetMetrics:
    """A registry view with only the fleet-wide families (for `generate_latest`);
    `shared_index`: less ROUTED_METRICS."""

    def __init__(self, registry: _Collector, *, shared_index: bool = False) -> None:
        self._registry = registry
        self._names = FLEET_METRICS - ROUTED_METRICS if shared_index else FLEET_METRICS

    def collect(self) -> Iterator[Any]:
        for family in self._registry.collect():
            if family.name in self._names:
                yield family
