"""The P/D harness: a real gateway (uvicorn, its aiohttp upstream) on loopback, its usage
records kept (`served`, `gateway`), in front of replicas that answer the legs as vLLM 0.32
does (tests/pd_replica.py, `replicas`), and the bodies the P/D tests send.

Routing is `least_loaded` so a test can say which replica ranks first (a replica given a
few requests in flight by hand, `Gateway.busy`, ranks last)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn

from gateway.pd.config import PdConfig
from gateway.proxy.app import GatewayApp, create_app
from gateway.routing.config import RoutingConfig
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from gateway.usage.record import UsageRecord
from tests.pd_replica import PdReplica
from tests.test_fault_hang import InProcessServer, free_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "tell me a story " * 40}],
        "max_tokens": 300, "min_tokens": 5}


@dataclass
class Gateway:
    url: str
    app: GatewayApp
    records: list[UsageRecord]

    def busy(self, name: str, n: int) -> None:
        """`name` gets `n` requests in flight by hand (ranks last under least_loaded)."""
        assert self.app.services is not None
        self.app.services.fleet.replicas[name].in_flight += n

    def mark_up(self, name: str) -> None:
        assert self.app.services is not None
        self.app.services.fleet.probe_result(name, True, time.time())

    def stats(self) -> dict[str, Any]:
        assert self.app.services is not None
        return self.app.stats(self.app.services)


@contextlib.asynccontextmanager
async def gateway(replicas: list[tuple[str, str, str]], pd: PdConfig | None = None,
                  ) -> AsyncIterator[Gateway]:
    """`replicas`: (name, url, role)."""
    settings = Settings(
        replicas=tuple(ReplicaSettings(name=n, url=u, role=role, models=("m",))  # type: ignore[arg-type]
                       for n, u, role in replicas),
        server=ServerSettings(read_timeout_s=10, connect_timeout_s=5, health_timeout_s=5,
                              health_interval_s=60),
        routing=RoutingConfig(policy="least_loaded"),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=60),
        pd=pd or PdConfig(min_remote_prefill_tokens=16))
    async with served(settings) as gw:
        yield gw


@contextlib.asynccontextmanager
async def served(settings: Settings) -> AsyncIterator[Gateway]:
    """A gateway with `settings` on a loopback port, its usage records kept."""
    app = create_app(settings)
    port = free_port()
    srv = InProcessServer(uvicorn.Config(app, host="127.0.0.1", port=port, loop="none",
                                         lifespan="on", log_config=None, access_log=False))
    task = asyncio.create_task(srv.serve())
    deadline = time.monotonic() + 10
    while not srv.started:
        assert not task.done() and time.monotonic() < deadline, "the server did not start"
        await asyncio.sleep(0.01)
    records: list[UsageRecord] = []
    assert app.services is not None
    recorder = app.services.recorder
    original = recorder.record

    def spy(rec: UsageRecord, departed: bool = False) -> None:
        records.append(rec)
        original(rec, departed)

    recorder.record = spy  # type: ignore[method-assign]
    try:
        yield Gateway(f"http://127.0.0.1:{port}", app, records)
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def replicas(*specs: tuple[str, str]) -> AsyncIterator[list[PdReplica]]:
    """(name, mode) each."""
    started = [PdReplica(n, m) for n, m in specs]
    for r in started:
        await r.start()
    try:
        yield started
    finally:
        for r in started:
            await r.stop()


def url(r: PdReplica) -> str:
    return f"http://127.0.0.1:{r.port}"


def sse_texts(raw: bytes) -> list[str]:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            doc = orjson.loads(line[6:])
            out += [c["delta"].get("content", "") for c in doc.get("choices", [])]
            assert "usage" not in doc or doc["usage"] is None  # not asked: stripped
    return out


def reuse(**kw: Any) -> PdConfig:
    return PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True, **kw)


def next_turn(body: dict[str, Any], answer: str, user: str) -> dict[str, Any]:
    return {**body, "messages": [*body["messages"], {"role": "assistant", "content": answer},
                                 {"role": "user", "content": user}]}
