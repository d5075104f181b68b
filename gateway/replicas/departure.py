"""A replica leaving the fleet (an InferencePool pod deleted, its address changed): one call,
`depart`, that takes the replica out of the fleet and out of every map keyed by its name or
its origin, so that what the gateway holds per replica is bounded by the live fleet
whatever the churn.

What goes, through `Services.remove_replica` (gateway/proxy/app.py), which names each part:
- the fleet's entry (`Fleet.remove`): health, models, in-flight count, last snapshot;
- the router's tables, block index, session bindings, restart marks and the token mode's
  view of it (`Router.remove_replica`);
- every metric series labelled with it, in every family of the gateway's registry, and the
  cached children (`GatewayMetrics.remove_replica`);
- the monitor's suspect run, scrape asked soon and when its last scrape was asked
  (`FleetMonitor.forget_replica`); answers to its probes, scrapes
  and model refreshes in flight are dropped when they come (`Fleet.holds`);
- its cached_tokens verdict (`UsageRecorder.forget_replica`) and the Responses API's
  response ids stored on it (`AffinityStore.forget_replica`);
- with shared state ([redis]), the departure itself (`SharedState.depart`): recorded in
  Redis, so that facts about it from before now are void on every instance, those
  starting later included, should a server come back under its name
  (gateway/shared/departures.py);
- its origin's connection slots, idle pooled connections and closing record in the client
  pool and the probes' pool, unless another live replica has the same origin
  (`Upstream.retain_origins`: every origin no live replica has goes, so one made again by
  a request or probe still on its way when the replica left goes at the next departure).

Requests in flight to it finish on their own: the router ignores what they report for a
name it no longer knows, and their usage is counted under `replica="departed"`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from yarl import URL

from gateway.replicas.fleet import Fleet, Replica
from gateway.upstream.seam import Upstream


def origin(url: str) -> str:
    """scheme://host:port of a replica URL, as the client pool keys its slots."""
    return str(URL(url).origin())


def depart(fleet: Fleet, name: str, forget: Iterable[Callable[[str], object]],
           upstreams: Iterable[Upstream]) -> Replica | None:
    """Take `name` out of the fleet and out of every part in `forget` (each called with the
    name), and its origin out of `upstreams` when no live replica shares it; the replica
    that left, or None when no replica had that name (nothing is done)."""
    replica = fleet.remove(name)
    if replica is None:
        return None
    for part in forget:
        part(name)
    live = {origin(r.url) for r in fleet.replicas.values()}
    for upstream in upstreams:
        upstream.retain_origins(live)
    return replica
