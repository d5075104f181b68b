"""Candidates from an InferencePool's pods (`[epp] pool`; the `kubernetes` extra).

The pool (`inference.networking.k8s.io/v1`, `InferencePool`) names the pods by its
`selector.matchLabels` and the port(s) they serve on by `targetPorts`; every ready pod
gives one endpoint per target port (`ip:port`), each a replica named `<pod>:<port>`
(`pool_spec`, `ready_endpoints`: pure). `PoolWatch` reads the pool once, lists its pods and
then watches them (the official `kubernetes` client, in one thread: its watch blocks),
handing the loop the whole endpoint set after every change; a broken watch is listed and
watched again after `RETRY_S`. `Members` applies a set to the fleet, the router and the
picker: joiners are probed at once (down until then), leavers forgotten everywhere at once
(`remove`: `Services.remove_replica`, gateway.replicas.departure), so what the picker holds
per replica is bounded by the live pods, whatever the churn.

A pod counts while it has an IP, its `Ready` condition is True and it is not being
deleted. The pool's own changes (another selector) need a restart of the picker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.epp.decision import endpoint_of
from gateway.settings import ReplicaSettings
from gateway.tasks import guarded

log = logging.getLogger("gateway.epp.pool")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
RETRY_S = 2.0
WATCH_TIMEOUT_S = 60  # the API server ends a watch after this long; it is started again
MAX_PODS = 4096  # pods held from one pool: a bound on the picker's map of them


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


def _ready(pod: Mapping[str, Any]) -> str | None:
    """The pod's IP when it takes traffic, else None."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    return ip if ip and ready else None


def ready_endpoints(pods: Iterable[Mapping[str, Any]], ports: Iterable[int]) -> dict[str, str]:
    """Replica name (`<pod>:<port>`) -> URL, for every ready pod and target port."""
    out: dict[str, str] = {}
    for pod in pods:
        ip = _ready(pod)
        name = (pod.get("metadata") or {}).get("name")
        if ip is None or not isinstance(name, str):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        for port in ports:
            out[f"{name}:{port}"] = f"http://{host}:{port}"
    return out


def changes(current: Mapping[str, str], wanted: Mapping[str, str]
            ) -> tuple[dict[str, str], list[str]]:
    """(replicas to add, replicas to remove): a pod whose address changed is both."""
    gone = [n for n, url in current.items() if wanted.get(n) != url]
    new = {n: url for n, url in wanted.items() if current.get(n) != url}
    return new, gone


class PoolWatch:
    """List and watch an InferencePool's pods in a thread; `publish(endpoints)` is called
    on the loop after every change."""

    def __init__(self, api: Any, namespace: str, pool: str,
                 publish: Callable[[dict[str, str]], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.api = api  # kubernetes.client.ApiClient
        self.namespace = namespace
        self.pool = pool
        self.publish = publish
        self.loop = loop
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="epp-pool-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _send(self, endpoints: dict[str, str]) -> None:
        if not self._stop.is_set():
            self.loop.call_soon_threadsafe(self.publish, endpoints)

    def _run(self) -> None:
        from kubernetes import client, watch

        custom: Any = client.CustomObjectsApi(self.api)
        core: Any = client.CoreV1Api(self.api)
        plain: Callable[[Any], Any] = self.api.sanitize_for_serialization
        while not self._stop.is_set():
            try:
                obj: Any = custom.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, self.pool)
                spec = pool_spec(obj)
                listed: Any = plain(core.list_namespaced_pod(
                    self.namespace, label_selector=spec.selector))
                pods: dict[str, Any] = {p["metadata"]["name"]: p
                                        for p in (listed.get("items") or [])[:MAX_PODS]}
                self._send(ready_endpoints(pods.values(), spec.ports))
                watcher: Any = watch.Watch()  # type: ignore[no-untyped-call]
                self._watch = watcher
                for event in watcher.stream(
                        core.list_namespaced_pod, self.namespace,
                        label_selector=spec.selector,
                        resource_version=listed["metadata"].get("resourceVersion"),
                        timeout_seconds=WATCH_TIMEOUT_S):
                    if self._stop.is_set():
                        return
                    pod = plain(event["object"])
                    name = (pod.get("metadata") or {}).get("name")
                    if not isinstance(name, str):
                        continue
                    if event["type"] == "DELETED":
                        pods.pop(name, None)
                    elif len(pods) < MAX_PODS or name in pods:
                        pods[name] = pod
                    self._send(ready_endpoints(pods.values(), spec.ports))
            except Exception as exc:  # the API server is away, the pool is missing, ...
                if self._stop.is_set():
                    return
                log.warning("InferencePool watch failed; retrying", extra={
                    "pool": self.pool, "namespace": self.namespace, "error": str(exc)[:300]})
                self._stop.wait(RETRY_S)


class Members:
    """Applies the pool's endpoint sets to the fleet, router and picker (on the loop)."""

    def __init__(self, fleet: Any, monitor: Any, remove: Callable[[str], object],
                 set_endpoints: Callable[[Mapping[str, str]], None]) -> None:
        self.fleet, self.monitor, self.remove = fleet, monitor, remove
        self.set_endpoints = set_endpoints
        self._probes: set[asyncio.Task[None]] = set()

    def apply(self, wanted: dict[str, str]) -> None:
        current = {name: r.url for name, r in self.fleet.replicas.items()}
        new, gone = changes(current, wanted)
        for name in gone:
            self.remove(name)
            log.info("replica left the pool", extra={"replica": name})
        for name, url in new.items():
            replica = self.fleet.add(ReplicaSettings(name=name, url=url))
            log.info("replica joined the pool", extra={"replica": name, "url": url})
            task = asyncio.get_running_loop().create_task(guarded(
                functools.partial(self.monitor.probe, replica), f"health probe {name}",
                self.monitor.failures))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
        if new or gone:
            self.set_endpoints({name: endpoint_of(r.url)
                                for name, r in self.fleet.replicas.items()})
