"""`gateway epp`'s InferencePool pods get their KV-event feed as they join, and lose it as
they leave, as `gateway serve`'s sources' replicas do (`watch_pool`, gateway.epp.pool:
joiners go through `Services.joined`, leavers through `Services.remove_replica`): a
`gateway sim --kv-events` replica behind a pod of a fake Kubernetes API server
(tests/fake_kube.py), watched by the official client."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.epp.pool import watch_pool
from gateway.events.config import TokenSettings
from gateway.proxy.app import GatewayApp
from gateway.serve import sim_renderer
from tests.fake_kube import fake_kube, pod
from tests.servers import free_ports, sim
from tests.test_fleet_sources_loopback import settings, until

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("kubernetes")

SUBSCRIBED = ("waiting for events", "live")
LABELS = {"app": "vllm"}


def _pool(port: int) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "vllm", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": LABELS}, "targetPorts": [{"number": port}]}}


async def test_a_pool_pod_gets_its_feed_as_it_joins_and_loses_it_as_it_leaves(
        tmp_path: Path) -> None:
    from kubernetes import config

    kv_port = free_ports(2)
    with sim(1, ["--model", "sim", "--speed", "50", "--kv-events", "--kv-events-port",
                 str(kv_port), "--dev-mode"]) as urls:
        port = int(urls[0].rsplit(":", 1)[1])
        name = f"vllm-0:{port}"
        app = GatewayApp(dataclasses.replace(settings(),
                                             tokens=TokenSettings(models={"sim": "sim"})),
                         sim_renderer=sim_renderer)
        async with app.running(), httpx.AsyncClient(timeout=30) as client:
            services = app.services
            assert services is not None and services.feeds is not None
            feeds = services.feeds

            def state() -> str | None:
                entry = feeds.status(services.clock())["replicas"].get(name)
                return None if entry is None else entry.get("state")

            endpoints: list[dict[str, str]] = []
            with fake_kube(_pool(port)) as kube:
                api = config.new_client_from_config(  # type: ignore[no-untyped-call]
                    config_file=str(kube.kubeconfig(tmp_path / "kubeconfig")))
                watch = watch_pool(services, api, "ns", "vllm",
                                   lambda e: endpoints.append(dict(e)))
                try:
                    assert state() is None
                    kube.put(pod("vllm-0", "127.0.0.1", True, LABELS))
                    await until("the pod joined", lambda: name in services.fleet.replicas)
                    assert endpoints[-1] == {name: f"127.0.0.1:{port}"}
                    await until("its feed subscribed", lambda: state() in SUBSCRIBED)
                    r = await client.post(f"{urls[0]}/v1/chat/completions", json={
                        "model": "sim", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hello " * 40}]})
                    assert r.status_code == 200, r.text
                    await until("its events read", lambda: state() == "live")
                    assert feeds._index.held_blocks(name) > 0
                    task = feeds._tasks[name]

                    kube.delete("vllm-0")
                    await until("the pod left", lambda: name not in services.fleet.replicas)
                    await until("its feed ended", task.done)
                    assert state() is None
                    assert name not in feeds._tasks
                    assert feeds._index.state(name) is None
                finally:
                    watch.stop()
