"""`Services`: every long-lived object one gateway owns (upstream client, fleet and its
monitor, router, hygiene analyzer, metrics, usage recorder, and the optional KV-event
feeds, shared state, admission queue, tenant salts, tracer), built at startup by
`GatewayApp` (gateway serve, app.py) or the picker (gateway epp), and what a replica's
arrival or departure changes in all of them at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.admission.gate import Gate
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.proxy.auth import Authenticator
from gateway.proxy.tenancy import TenantSalts
from gateway.proxy.tokenmode import EventFeeds, feed_target
from gateway.replicas.departure import depart
from gateway.replicas.fleet import Fleet, Replica
from gateway.replicas.monitor import FleetMonitor
from gateway.routing.affinity import AffinityStore, ResponseAffinity
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings, Settings
from gateway.tracing.tracer import Passthrough, RequestTracer
from gateway.upstream.seam import Upstream
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.recorder import UsageRecorder

if TYPE_CHECKING:
    from gateway.shared.redis_state import SharedState


@dataclass(slots=True, eq=False)
class Services:
    settings: Settings
    clock: Callable[[], float]
    upstream: Upstream
    fleet: Fleet
    router: Router
    analyzer: HygieneAnalyzer
    metrics: GatewayMetrics
    recorder: UsageRecorder
    auth: Authenticator
    monitor: FleetMonitor
    probes: Upstream  # the health probes' own small pool (the client pool when one is given)
    # Responses API: which replica created each stored response (local; Redis later).
    affinity: AffinityStore = field(default_factory=ResponseAffinity)
    feeds: EventFeeds | None = None  # KV-event feeds, in token mode ([tokens])
    shared: SharedState | None = None  # routing state shared through Redis ([redis])
    gate: Gate | None = None  # the admission queue ([admission])
    # each tenant's cache namespace ([auth]): serve's and the picker's request flow
    salts: TenantSalts = field(default_factory=lambda: TenantSalts((), ""))
    # [tracing]: one span per request, serve's and the picker's (gateway.tracing)
    tracer: RequestTracer = field(default_factory=Passthrough)

    def joined(self, replica: ReplicaSettings) -> None:
        """A replica joined the fleet, or its settings changed (gateway serve's sources
        through `Membership.on_member`, gateway epp's InferencePool through
        `Members.on_member`): its KV-event feed in token mode, started now when the feeds
        run. Its departure goes through `remove_replica`."""
        if self.feeds is not None:
            self.feeds.add_replica(feed_target(replica))

    def remove_replica(self, name: str) -> Replica | None:
        """A replica left the fleet: out of every per-replica map at once
        (gateway.replicas.departure lists them); None when no replica had that name."""
        parts: list[Callable[[str], object]] = [
            *([self.feeds.remove_replica] if self.feeds is not None else []),
            self.router.remove_replica, self.metrics.remove_replica,
            self.monitor.forget_replica, self.recorder.forget_replica,
            self.affinity.forget_replica]
        if self.gate is not None:
            parts.append(self.gate.forget_replica)
        if self.shared is not None:  # facts about it from before are void, everywhere
            parts.append(self.shared.depart)
        return depart(self.fleet, name, parts, (self.upstream, self.probes))
