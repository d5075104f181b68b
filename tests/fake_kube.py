"""A fake Kubernetes API server on loopback for the InferencePool watch test (no real API
server can run here): one InferencePool, and pods that the test changes, served as the
official client reads them: GET the pool, list pods (with a resourceVersion), and watch
pods (`?watch=true`: one JSON event per line, kept open; the events after the watch's
`resourceVersion` first, as a real API server sends them). aiohttp, in its own thread and
event loop; stopped (and its thread joined) on exit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.servers import free_port


def pod(name: str, ip: str, ready: bool, labels: dict[str, str],
        ports: dict[str, int] | None = None) -> dict[str, Any]:
    """A pod; `ports`: its container's named ports (name -> containerPort)."""
    out: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": labels,
                     "resourceVersion": "1"},
        "status": {"podIP": ip, "phase": "Running", "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}}
    if ports is not None:
        out["spec"] = {"containers": [{"name": "vllm", "ports": [
            {"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()]}]}
    return out


def selected(p: dict[str, Any], selector: str) -> bool:
    """Whether the pod's labels match a `k=v,k2=v2` selector (equality terms only)."""
    labels = p["metadata"].get("labels") or {}
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return all(labels.get(k) == v for k, v in terms)


class FakeKube:
    def __init__(self, pool: dict[str, Any]) -> None:
        self.pool = pool
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 1
        self.watchers: list[asyncio.Queue[dict[str, Any]]] = []
        # every event, for a watch that starts from an older resourceVersion (as a real API
        # server replays them: events between a list and its watch are not lost)
        self.history: list[tuple[int, dict[str, Any]]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[str] = []
        # every request the API server was sent, whatever its route: (method, path?query)
        self.calls: list[tuple[str, str]] = []

    # the test's side (any thread) -----------------------------------------------------------

    def put(self, p: dict[str, Any]) -> None:
        kind = "MODIFIED" if p["metadata"]["name"] in self.pods else "ADDED"
        self._call(self._event, kind, p)

    def delete(self, name: str) -> None:
        self._call(self._event, "DELETED", self.pods[name])

    def _call(self, fn: Any, *args: Any) -> None:
        assert self.loop is not None
        done = threading.Event()

        def run() -> None:
            fn(*args)
            done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(5)

    def _event(self, kind: str, p: dict[str, Any]) -> None:
        self.version += 1
        p = {**p, "metadata": {**p["metadata"], "resourceVersion": str(self.version)}}
        if kind == "DELETED":
            self.pods.pop(p["metadata"]["name"], None)
        else:
            self.pods[p["metadata"]["name"]] = p
        event = {"type": kind, "object": p}
        self.history.append((self.version, event))
        for q in self.watchers:
            q.put_nowait(event)

    # the API server's side ------------------------------------------------------------------

    async def get_pool(self, request: web.Request) -> web.Response:
        self.requests.append(request.path_qs)
        if request.match_info["name"] != self.pool["metadata"]["name"]:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response(self.pool)

    async def pods_view(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path_qs)
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("true", "True", "1"):
            return web.json_response({
                "apiVersion": "v1", "kind": "PodList",
                "metadata": {"resourceVersion": str(self.version)},
                "items": [p for p in self.pods.values() if selected(p, selector)]})
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        since = request.query.get("resourceVersion", "")
        if since.isdigit():
            for version, event in self.history:
                if version > int(since):
                    q.put_nowait(event)
        self.watchers.append(q)
        try:
            while True:
                event = await q.get()
                if not selected(event["object"], selector):
                    continue
                await resp.write(json.dumps(event).encode() + b"\n")
        finally:
            self.watchers.remove(q)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": "ns"}}]}))
        return path


@contextlib.contextmanager
def fake_kube(pool: dict[str, Any]) -> Iterator[FakeKube]:
    kube = FakeKube(pool)
    ready = threading.Event()
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        kube.loop = asyncio.get_running_loop()
        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            kube.calls.append((request.method, request.path_qs))
            response: web.StreamResponse = await handler(request)
            return response

        app = web.Application(middlewares=[record])
        app.router.add_get(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
            kube.get_pool)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", kube.pods_view)
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", kube.port).start()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield kube
    finally:
        assert kube.loop is not None and stop is not None
        kube.loop.call_soon_threadsafe(stop.set)
        thread.join(10)
