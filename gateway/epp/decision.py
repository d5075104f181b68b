"""The endpoint picker's pure decisions, apart from gRPC and the router (no I/O).

The Gateway API Inference Extension's endpoint-picker protocol, as this EPP speaks it:

- request: the data plane MAY restrict the candidates with a list of `ip:port` under
  filter metadata `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`
  (`subset_hint`); an empty or absent list means no restriction, a list naming none of
  the ready replicas means no ready endpoint (503).
- answer: `x-gateway-destination-endpoint: ip:port[,ip:port...]` (the pick, then the
  fallbacks a retry may use) and the same value in dynamic metadata `envoy.lb`
  (`destination`); no ready endpoint is a 503, a request the admission queue sheds a
  429 with Retry-After (gateway.admission), each an ImmediateResponse with an
  OpenAI-shaped error body.
- response: the endpoint that served it, from metadata `envoy.lb` /
  `x-gateway-destination-endpoint-served`, else Envoy's `upstream.address` attribute
  (`served_endpoint`).

A replica's endpoint is the `host:port` of its configured URL (`endpoint_of`): on
Kubernetes, the pod IP and port InferencePool names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from gateway.proxy.errors import GatewayError

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
# the conformance suite's hooks (`[epp] conformance`)
TEST_SELECTION = "test-epp-endpoint-selection"
TEST_SERVED = "x-conformance-test-served-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Envoy's attribute for the upstream host a response came from (ip:port).
UPSTREAM_ADDRESS = "upstream.address"
# ... and for why Envoy answered as it did ("via_upstream", or
# "upstream_reset_before_response_started{connection_failure...}" when no upstream could
# be reached).
CODE_DETAILS = "response.code_details"
# A subset hint longer than this is cut: candidates are configured replicas, so no hint
# needs more, and what the data plane sends never grows the EPP's memory unbounded.
MAX_HINT_ENDPOINTS = 1024
MAX_ENDPOINT_CHARS = 64


def endpoint_of(url: str) -> str:
    """`host:port` of a replica URL (the port defaulted by scheme), as Envoy names hosts."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if ":" in host:  # an IPv6 literal keeps its brackets, as in Envoy's address strings
        host = f"[{host}]"
    return f"{host}:{port}"


def subset_hint(values: Sequence[object] | None) -> frozenset[str] | None:
    """The candidate endpoints a subset hint allows; None (absent or empty list) = no
    restriction. Entries that are not `ip:port` strings are ignored (a hint of nothing
    but those allows nothing); at most MAX_HINT_ENDPOINTS are read."""
    if not values:
        return None
    out: set[str] = set()
    for value in values[:MAX_HINT_ENDPOINTS]:
        if isinstance(value, str) and 0 < len(value) <= MAX_ENDPOINT_CHARS:
            host, sep, port = value.strip().rpartition(":")
            if sep and host and port.isdigit():
                out.add(f"{host}:{int(port)}")
    return frozenset(out)


def test_selection(value: str | None, hint: frozenset[str] | None) -> frozenset[str] | None:
    """The candidates with the conformance suite's `test-epp-endpoint-selection` header
    (`ip:port[,ip:port]`) applied on top of the data plane's subset hint: the header's
    endpoints, within the hint when there is one. No header: the hint as it was."""
    if value is None:
        return hint
    chosen = subset_hint(value.split(",")[:MAX_HINT_ENDPOINTS]) or frozenset()
    return chosen if hint is None else chosen & hint


def restrict(candidates: Sequence[str], endpoints: Mapping[str, str],
             allowed: frozenset[str] | None) -> list[str]:
    """The candidate replica names whose endpoint the hint allows (all without a hint)."""
    if allowed is None:
        return list(candidates)
    return [name for name in candidates if endpoints.get(name) in allowed]


def destination(ranked: Sequence[str], endpoints: Mapping[str, str], usable: Iterable[str],
                fallbacks: int) -> str:
    """The header value: the chosen replica's endpoint, then up to `fallbacks` more of the
    ranked replicas that are usable, in rank order, no endpoint twice."""
    ok = set(usable)
    out = [endpoints[ranked[0]]]
    for name in ranked[1:]:
        if len(out) > fallbacks:
            break
        ep = endpoints.get(name)
        if name in ok and ep is not None and ep not in out:
            out.append(ep)
    return ",".join(out)


def no_ready_endpoint(hinted: bool) -> GatewayError:
    why = " in the subset the gateway allowed" if hinted else ""
    return GatewayError(503, f"No ready endpoint{why} is available.",
                        code="no_healthy_replica")


def served_endpoint(metadata: Mapping[str, object] | None,
                    attributes: Mapping[str, object] | None) -> str | None:
    """The endpoint that served the response: the protocol's metadata first, then Envoy's
    `upstream.address` attribute; None when neither says (a local reply)."""
    for value in ((metadata or {}).get(SERVED), (attributes or {}).get(UPSTREAM_ADDRESS)):
        if isinstance(value, str) and 0 < len(value) <= MAX_ENDPOINT_CHARS:
            return value.split(",", 1)[0].strip()
    return None


def unreachable(status: int, details: object) -> bool:
    """Envoy answered itself because it could not connect to the upstream (every try)."""
    return status >= 500 and isinstance(details, str) and "connection_failure" in details


def replica_for(endpoint: str | None, by_endpoint: Mapping[str, str]) -> str | None:
    """The replica name behind an endpoint string Envoy reported."""
    return by_endpoint.get(endpoint) if endpoint else None
