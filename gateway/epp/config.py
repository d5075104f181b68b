"""Settings of `gateway epp`, the endpoint picker (TOML section `[epp]`, env
`GATEWAY_EPP__*`, flags `--host`/`--port`). Every other setting (replicas, routing,
hygiene, usage, tokens, redis) is the one `gateway serve` reads from the same file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What the EPP reads of each response (bench/RESULTS.md has what each costs):
#   "json"    (default) the headers, and the body of a JSON answer (one message, whole:
#             usage, the cached-tokens self-check, the reply text the router indexes); of
#             a stream the headers only (its records have no token counts)
#   "body"    also every chunk of a stream (its usage chunk, when the client asked for it):
#             one gRPC message per chunk Envoy reads, about twice the EPP's CPU per stream
#   "headers" status and served endpoint only
ResponseRead = Literal["json", "body", "headers"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EppSettings:
    host: str = "127.0.0.1"  # the gRPC listener (ext_proc + grpc.health.v1)
    port: int = 9002  # the port GIE's examples give the EPP
    response: ResponseRead = "json"
    # Shedding: with every candidate replica holding this many requests the EPP routed and
    # that are not finished, a new request is answered 429 (0 = never shed).
    shed_in_flight: int = 0
    # Candidates from an InferencePool's pods instead of [[replicas]]: the pool's name ("" =
    # none) and namespace ("" = the picker's own pod's, else "default"); the `kubernetes`
    # extra. In a cluster the pod's service account is used (it may get and watch
    # inferencepools and pods), elsewhere the kubeconfig.
    pool: str = ""
    pool_namespace: str = ""
    # Concurrent ext_proc streams (one per request in flight through Envoy); more wait
    # in gRPC's queue. A bound on the EPP's per-request state.
    max_streams: int = 4096

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"epp.port must be 0..65535, got {self.port}")
        if self.shed_in_flight < 0:
            raise ValueError("epp.shed_in_flight must be >= 0")
        if self.max_streams <= 0:
            raise ValueError("epp.max_streams must be positive")
