"""Replicas from Kubernetes pods (the `kubernetes` extra): one watcher for both of its
users, `gateway epp`'s InferencePool (gateway.epp.pool) and `gateway serve`'s label
selector (`[discovery] kubernetes_selector`, gateway.replicas.sources).

`PodWatch` asks `target` (in its thread) for a label selector and the ports the pods serve
on, lists the pods and then watches them (the official `kubernetes` client, in one thread:
its watch blocks), handing the loop the whole endpoint set after every change; a broken
watch (the API server away, the pool missing) is listed and watched again after `RETRY_S`.

A pod counts while it has an IP, its `Ready` condition is True and it is not being deleted
(`pod_ip`). Every ready pod gives one endpoint per port (`ready_endpoints`, pure): a replica
named `<pod>:<port>` (the same on every gateway instance watching the same pods, so
instances sharing state through Redis name it alike), where a port is a number or the name
of a container port (`containerPort` of the pod's container port of that name; a pod
without it gives no endpoint for it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("gateway.replicas.kube")

RETRY_S = 2.0
WATCH_TIMEOUT_S = 60  # the API server ends a watch after this long; it is started again
MAX_PODS = 4096  # pods held from one watch: a bound on the map of them
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

Port = int | str  # a number, or the name of a container port
Target = Callable[[Any], tuple[str, Sequence[Port]]]  # api client -> (selector, ports)


def kube_api() -> Any:
    """A Kubernetes API client: the pod's service account in a cluster, else kubeconfig."""
    from kubernetes import client, config

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    else:
        # KUBECONFIG as it is now: the client reads its default once, when imported
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=os.environ.get("KUBECONFIG") or None)
    return client.ApiClient()


def own_namespace(configured: str) -> str:
    """`configured`, else the namespace this pod runs in, else "default"."""
    if configured:
        return configured
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def pod_ip(pod: Mapping[str, Any]) -> str | None:
    """The pod's IP when it takes traffic, else None."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    return ip if ip and ready else None


def container_port(pod: Mapping[str, Any], name: str) -> int | None:
    """The number of the pod's container port named `name`, if one is."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            number = port.get("containerPort")
            if port.get("name") == name and isinstance(number, int):
                return number
    return None


def ready_endpoints(pods: Iterable[Mapping[str, Any]], ports: Iterable[Port]
                    ) -> dict[str, str]:
    """Replica name (`<pod>:<port>`) -> URL, for every ready pod and port (a named one as
    that pod declares it)."""
    out: dict[str, str] = {}
    for pod in pods:
        ip = pod_ip(pod)
        name = (pod.get("metadata") or {}).get("name")
        if ip is None or not isinstance(name, str):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        for port in ports:
            number = port if isinstance(port, int) else container_port(pod, port)
            if number is not None:
                out[f"{name}:{number}"] = f"http://{host}:{number}"
    return out


def changes(current: Mapping[str, str], wanted: Mapping[str, str]
            ) -> tuple[dict[str, str], list[str]]:
    """(replicas to add, replicas to remove): a pod whose address changed is both."""
    gone = [n for n, url in current.items() if wanted.get(n) != url]
    new = {n: url for n, url in wanted.items() if current.get(n) != url}
    return new, gone


class PodWatch:
    """List and watch the pods `target` selects in a thread; `publish(endpoints)` is called
    on the loop after every change."""

    def __init__(self, api: Any, namespace: str, target: Target, what: str,
                 publish: Callable[[dict[str, str]], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.api = api  # kubernetes.client.ApiClient
        self.namespace = namespace
        self.target = target
        self.what = what  # for the log: "InferencePool ns/vllm", "pods ns/app=vllm"
        self.publish = publish
        self.loop = loop
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="kube-pod-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No publish after this returns; the thread ends at its watch's next event or
        timeout (it is a daemon: nothing waits for it)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _send(self, endpoints: dict[str, str]) -> None:
        if not self._stop.is_set():
            self.loop.call_soon_threadsafe(self._publish, endpoints)

    def _publish(self, endpoints: dict[str, str]) -> None:
        if not self._stop.is_set():  # stopped while the call was queued
            self.publish(endpoints)

    def _run(self) -> None:
        from kubernetes import client, watch

        core: Any = client.CoreV1Api(self.api)
        plain: Callable[[Any], Any] = self.api.sanitize_for_serialization
        while not self._stop.is_set():
            try:
                selector, ports = self.target(self.api)
                listed: Any = plain(core.list_namespaced_pod(
                    self.namespace, label_selector=selector))
                pods: dict[str, Any] = {p["metadata"]["name"]: p
                                        for p in (listed.get("items") or [])[:MAX_PODS]}
                self._send(ready_endpoints(pods.values(), ports))
                watcher: Any = watch.Watch()  # type: ignore[no-untyped-call]
                self._watch = watcher
                for event in watcher.stream(
                        core.list_namespaced_pod, self.namespace, label_selector=selector,
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
                    self._send(ready_endpoints(pods.values(), ports))
            except Exception as exc:  # the API server is away, the pool is missing, ...
                if self._stop.is_set():
                    return
                log.warning("Kubernetes pod watch failed; retrying", extra={
                    "watch": self.what, "error": str(exc)[:300]})
                self._stop.wait(RETRY_S)
