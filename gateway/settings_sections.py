"""The settings sections that belong to no component's own config module: `[epp]` (the
endpoint picker, `gateway epp`), `[demo]` (the simulator `gateway serve` embeds) and
`[discovery]` (replicas from DNS names or Kubernetes pods, and how a replica leaves), with
the DNS target checks `[discovery]` validates with. `gateway.settings` assembles them with
the rest and re-exports these names."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

# `gateway epp`, the endpoint picker (TOML section `[epp]`, env `GATEWAY_EPP__*`, flags
# `--host`/`--port`); every other section is the one `gateway serve` reads.
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
    # Replaced by [admission] (the picker takes part in it as `gateway serve` does): kept
    # only to name its replacement; any value but 0 is an error saying so.
    shed_in_flight: int = 0
    # Candidates from an InferencePool's pods instead of [[replicas]]: the pool's name ("" =
    # none) and namespace ("" = the picker's own pod's, else "default"); the `kubernetes`
    # extra. In a cluster the pod's service account is used (it may get inferencepools
    # and list and watch pods), elsewhere the kubeconfig.
    pool: str = ""
    pool_namespace: str = ""
    # Concurrent ext_proc streams (one per request in flight through Envoy); more wait
    # in gRPC's queue. A bound on the EPP's per-request state.
    max_streams: int = 4096
    # The Gateway API Inference Extension conformance suite's hooks (off: never in
    # production): a request header `test-epp-endpoint-selection: ip:port[,ip:port]`
    # restricts the pick to those endpoints (none of them ready: 503), and the answer
    # carries the endpoint that served it in `x-conformance-test-served-endpoint`.
    conformance: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"epp.port must be 0..65535, got {self.port}")
        if self.shed_in_flight != 0:
            raise ValueError(
                "epp.shed_in_flight is replaced by [admission]: set [admission] enabled = "
                "true and replica_max_in_flight (the picker queues, then sheds with 429)")
        if self.max_streams <= 0:
            raise ValueError("epp.max_streams must be positive")


# The embedded simulator `gateway serve` starts when no replica is configured (TOML section
# `[demo]`, env `GATEWAY_DEMO__*`, flag `--demo-speed`); ignored when replicas are given.
@dataclass(frozen=True, kw_only=True, slots=True)
class DemoSettings:
    """The embedded simulator `gateway serve` starts when no replica is configured: its
    speed (said in its start-up line) and its share of tool calls for tool_choice auto."""

    # Simulated seconds per wall second: 1 is an H100's real time for an 8B model (a
    # 32,700-token answer takes about 227 s), 10 answers it in about 23 s.
    speed: float = 1.0
    # tool_choice "auto": the share of answers that are a tool call (named and "required"
    # always are), drawn per prompt, so a prompt repeats its answer.
    tool_call_probability: float = 0.5

    def __post_init__(self) -> None:
        if not self.speed > 0 or self.speed == float("inf"):
            raise ValueError(f"demo.speed must be a positive number, got {self.speed}")
        if not 0 <= self.tool_call_probability <= 1:
            raise ValueError("demo.tool_call_probability must lie within 0..1, got "
                             f"{self.tool_call_probability}")


def host_port(target: str) -> tuple[str, int]:
    """`host:port` (`[v6]:port` too) split; ValueError without a port in 1..65535."""
    host, sep, port = target.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"discovery.dns: {target!r} is not host:port")
    if not resolvable_name(host):
        raise ValueError(f"discovery.dns: {target!r}: {host!r} is no DNS name (RFC 1123: "
                         "labels of 1 to 63 characters, 253 in all)")
    return host, int(port)


def resolvable_name(host: str) -> bool:
    """An IP address, or a name a resolver can ask for (pure): labels of 1..63 octets and
    253 in all once IDNA-encoded (a final dot allowed). The system resolver refuses any
    other before a query (getaddrinfo's UnicodeError), at every interval."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    try:
        encoded = name.encode("idna")
    except UnicodeError:  # a label empty or past 63 octets, or not IDNA-encodable
        return False
    return len(encoded) <= 253 and all(0 < len(label) <= 63 for label in encoded.split(b"."))


@dataclass(frozen=True, kw_only=True, slots=True)
class DiscoverySettings:
    """Replicas beside [[replicas]] (gateway.replicas.sources), and how any replica leaves."""
    # DNS names re-resolved every dns_interval_s: each A/AAAA address is a replica at the
    # given port, named `address:port` (a headless Service's name works as is).
    dns: tuple[str, ...] = ()  # "host:port" each
    dns_interval_s: float = 10.0
    # Addresses taken from one name, lowest first: a bound on the fleet and on the
    # `replica` label values whatever DNS answers.
    max_replicas: int = 64
    api_key: str | None = field(default=None, repr=False)  # sent to discovered replicas
    # Kubernetes pods (the `kubernetes` extra; gateway.replicas.kube): the pods this label
    # selector picks in kubernetes_namespace (empty: the gateway pod's own, else
    # "default"), each Ready one with an IP a replica `<pod>:<port>` at kubernetes_port or
    # at its container port named kubernetes_port_name (one of the two).
    kubernetes_selector: str = ""  # "app=vllm,tier=gpu"
    kubernetes_namespace: str = ""
    kubernetes_port: int = 0
    kubernetes_port_name: str = ""
    # A replica no longer listed takes no new request at once, keeps what it learned for
    # grace_s (listed again within it, it is not learned from scratch), and departs after
    # that once its requests in flight finished, or drain_timeout_s after it left anyway.
    grace_s: float = 30.0
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for target in self.dns:
            host_port(target)
        if len(self.dns) > 16:
            raise ValueError("discovery.dns: at most 16 names")
        if self.dns_interval_s <= 0 or self.max_replicas <= 0:
            raise ValueError("discovery.dns_interval_s and discovery.max_replicas must be "
                             "positive")
        if self.grace_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("discovery.grace_s and discovery.drain_timeout_s must be >= 0")
        if self.kubernetes_selector and (self.kubernetes_port > 0) == bool(
                self.kubernetes_port_name):
            raise ValueError("discovery.kubernetes_selector needs one of "
                             "discovery.kubernetes_port and discovery.kubernetes_port_name")
        if not 0 <= self.kubernetes_port < 65536:
            raise ValueError("discovery.kubernetes_port must be in 1..65535")
