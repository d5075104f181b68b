"""Candidates from an InferencePool's pods (`[epp] pool`; the `kubernetes` extra).

The pool (`inference.networking.k8s.io/v1`, `InferencePool`) names the pods by its
`selector.matchLabels` and the port(s) they serve on by `targetPorts`; every ready pod
gives one endpoint per target port (`ip:port`), each a replica named `<pod>:<port>`
(`pool_spec`: pure; `ready_endpoints`, gateway.replicas.kube). `PoolWatch` is the pod
watcher `gateway serve`'s label selector uses too (gateway.replicas.kube.PodWatch), its
selector and ports read from the pool (again after every broken watch), handing the loop
the whole endpoint set after every change. `Members` applies a set to the fleet, the
router and the picker: joiners are probed at once (down until then) and told to the
services as `gateway serve`'s sources tell them (`on_member`: `Services.joined`, which
gives each its KV-event feed in token mode), leavers forgotten everywhere at once
(`remove`: `Services.remove_replica`, gateway.replicas.departure: their feed too), so
what the picker holds per replica is bounded by the live pods, whatever the churn.
`watch_pool` wires the two for `gateway epp` (gateway.epp.run).

The pool's own changes (another selector) need a restart of the picker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.epp.decision import endpoint_of
from gateway.replicas.kube import PodWatch, changes, ready_endpoints
from gateway.settings import ReplicaSettings
from gateway.tasks import guarded

if TYPE_CHECKING:
    from gateway.proxy.services import Services

log = logging.getLogger("gateway.epp.pool")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"

__all__ = ["Members", "PoolSpec", "PoolWatch", "changes", "pool_spec", "ready_endpoints",
           "watch_pool"]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    selector: str  # "k=v,k2=v2", the label selector of a pod list
    ports: tuple[int, ...]


def pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """The selector and target ports of an InferencePool object; ValueError if it has none."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or []
                  if isinstance(p, dict) and isinstance(p.get("number"), int))
    if not labels or not ports:
        raise ValueError("the InferencePool has no selector.matchLabels or no targetPorts")
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return PoolSpec(selector, ports)


def PoolWatch(api: Any, namespace: str, pool: str,  # a class name: it builds the watch
              publish: Callable[[dict[str, str]], None],
              loop: asyncio.AbstractEventLoop) -> PodWatch:
    """The watch of the pods of the InferencePool `namespace/pool`."""

    def target(api: Any) -> tuple[str, tuple[int, ...]]:
        from kubernetes import client

        custom: Any = client.CustomObjectsApi(api)
        spec = pool_spec(custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, pool))
        return spec.selector, spec.ports

    return PodWatch(api, namespace, target, f"InferencePool {namespace}/{pool}", publish,
                    loop)


class Members:
    """Applies the pool's endpoint sets to the fleet, router and picker (on the loop)."""

    def __init__(self, fleet: Any, monitor: Any, remove: Callable[[str], object],
                 set_endpoints: Callable[[Mapping[str, str]], None],
                 on_member: Callable[[ReplicaSettings], object] = lambda replica: None
                 ) -> None:
        self.fleet, self.monitor, self.remove = fleet, monitor, remove
        self.set_endpoints = set_endpoints
        self.on_member = on_member
        self._probes: set[asyncio.Task[None]] = set()

    def apply(self, wanted: dict[str, str]) -> None:
        current = {name: r.url for name, r in self.fleet.replicas.items()}
        new, gone = changes(current, wanted)
        for name in gone:
            self.remove(name)
            log.info("replica left the pool", extra={"replica": name})
        for name, url in new.items():
            settings = ReplicaSettings(name=name, url=url)
            replica = self.fleet.add(settings)
            self.on_member(settings)
            log.info("replica joined the pool", extra={"replica": name, "url": url})
            task = asyncio.get_running_loop().create_task(guarded(
                functools.partial(self.monitor.probe, replica), f"health probe {name}",
                self.monitor.failures))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
        if new or gone:
            self.set_endpoints({name: endpoint_of(r.url)
                                for name, r in self.fleet.replicas.items()})


def watch_pool(services: Services, api: Any, namespace: str, pool: str,
               set_endpoints: Callable[[Mapping[str, str]], None]) -> PodWatch:
    """The InferencePool `namespace/pool`'s pods as the fleet, started (stop it with
    `stop`): joiners and leavers go through the services as `gateway serve`'s do."""
    members = Members(services.fleet, services.monitor, services.remove_replica,
                      set_endpoints, on_member=services.joined)
    watch = PoolWatch(api, namespace, pool, members.apply, asyncio.get_running_loop())
    watch.start()
    return watch
