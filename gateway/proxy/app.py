"""The gateway's ASGI application and the factory that builds it.

`create_app(settings, upstream=None, clock=time.time)` returns a plain ASGI callable. Every
long-lived object (upstream client, fleet and its monitor, router, hygiene analyzer,
metrics, usage recorder) is built at startup, in the lifespan, and owned by one `Services`
value; nothing lives at module level, so a test process can build as many apps as it likes.
Tests that drive the app without a server (httpx.ASGITransport skips the lifespan) use
`async with app.running(): ...`.

Routes:
    POST /v1/chat/completions, POST /v1/completions   routed + recorded (gateway.proxy.handler)
    POST /v1/responses, POST /v1/messages             routed + recorded the same way
    GET  /v1/models                                   union of the healthy replicas' models
    *    /v1/...                                      forwarded to a replica serving `model`
    POST /tokenize, /detokenize, /pooling, /score,    vLLM's own endpoints, forwarded the
         /rerank, /classify, /v1/.../render           same way (by the body's `model`)
    GET|DELETE /v1/responses/{id}, POST .../cancel    to the replica that stored it, if known
    GET  /health                                      200 while the gateway runs
    GET  /ready                                       200 with >= 1 healthy replica, else 503
    GET  /metrics                                     GatewayMetrics (Prometheus text 0.0.4)
    GET  /stats                                       UsageRecorder.stats JSON
    GET  /stats?format=html                           the same as a page (gateway.usage.page)
    GET  /v1/models/{id}                              that model's card, or 404
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import orjson

from gateway.admission.gate import Gate
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.lograte import LogLimiter
from gateway.proxy.asgi import Receive, Scope, Send, respond, respond_error
from gateway.proxy.auth import Authenticator, without_tenants
from gateway.proxy.client import AiohttpUpstream, ClientLimits
from gateway.proxy.errors import GatewayError
from gateway.proxy.handler import Proxy
from gateway.proxy.inbound import Endpoint
from gateway.proxy.tokenmode import EventFeeds, SimRenderer, start_token_mode

if TYPE_CHECKING:
    from gateway.shared.redis_state import SharedState
from gateway.replicas.fleet import Fleet
from gateway.replicas.monitor import FleetMonitor
from gateway.routing.affinity import AffinityStore, ResponseAffinity
from gateway.routing.router import Router
from gateway.settings import Settings
from gateway.upstream.counters import UpstreamCounters
from gateway.upstream.seam import Upstream
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.page import render_page
from gateway.usage.recorder import UsageRecorder

log = logging.getLogger("gateway.proxy.app")

PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"
HTML = b"text/html; charset=utf-8"
# The inference routes the gateway routes by prefix and accounts (POST only).
_ROUTED: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions",
    "/v1/responses": "responses", "/v1/messages": "messages",
}
# The gateway's own GET routes, and the prefix of GET /v1/models/{id}.
_OWN_GET = frozenset({"/health", "/ready", "/metrics", "/stats", "/v1/models"})
_MODEL_PREFIX = "/v1/models/"
# vLLM's own endpoints outside /v1/ (routers and `vllm bench serve` call /tokenize through
# whatever base URL they are given); forwarded by the body's model like /v1/* calls.
_NATIVE = frozenset({"/tokenize", "/detokenize", "/pooling", "/score", "/rerank",
                     "/classify"})


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


class GatewayApp:
    def __init__(
        self, settings: Settings, *, upstream: Upstream | None = None,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.perf_counter,
        sim_renderer: SimRenderer | None = None,
    ) -> None:
        self.settings = settings
        self._given_upstream = upstream
        self._sim_renderer = sim_renderer  # for [tokens] models = "sim" (serve.py's)
        self.clock = clock  # wall time: record timestamps, routing and stats windows
        self.timer = timer  # monotonic: latencies
        self.services: Services | None = None
        # The gateway's own GET routes that need a key when keys are configured (/health
        # and /ready stay open for probes).
        self._guarded = frozenset(
            () if not settings.auth.keys else
            ("/v1/models",) if settings.auth.public_metrics else
            ("/v1/models", "/metrics", "/stats"))
        self._proxy: Proxy | None = None

    # lifecycle --------------------------------------------------------------------------

    async def startup(self) -> None:
        settings = self.settings
        server = settings.server
        upstream = self._given_upstream or AiohttpUpstream(ClientLimits(
            connections_per_replica=server.upstream_connections, idle_s=server.upstream_idle_s,
            pool_wait_s=server.upstream_pool_wait_s, max_body_bytes=server.max_response_bytes))
        # Probes never wait behind client traffic: their own pool, a few connections each.
        probes = self._given_upstream or AiohttpUpstream(ClientLimits(
            connections_per_replica=server.probe_connections, idle_s=server.upstream_idle_s,
            pool_wait_s=server.health_timeout_s, max_body_bytes=server.max_response_bytes))
        fleet = Fleet(settings.replicas, unhealthy_after=settings.server.unhealthy_after)
        tokens = await start_token_mode(settings, fleet, self.clock, self._sim_renderer)
        router = Router(settings.routing, tokens.mode if tokens is not None else None)
        metrics = GatewayMetrics()
        hygiene = settings.hygiene
        recorder = UsageRecorder(
            settings.usage, metrics, access_log=server.access_log, started_at=self.clock(),
            finding_log=LogLimiter(hygiene.log_interval_s, hygiene.log_max_per_s,
                                   hygiene.max_sessions + hygiene.max_templates),
            clock=self.clock)
        monitor = FleetMonitor(fleet, upstream, router, metrics, settings, self.clock,
                               recorder=recorder, probes=probes)
        services = Services(
            settings=settings, clock=self.clock, upstream=upstream, fleet=fleet, router=router,
            analyzer=HygieneAnalyzer(settings.hygiene), metrics=metrics, recorder=recorder,
            auth=Authenticator(settings.auth.keys, settings.auth.admin_tenants), monitor=monitor,
            probes=probes,
            feeds=tokens.feeds if tokens is not None else None,
        )
        await recorder.start()
        await monitor.start()
        if services.feeds is not None:
            await services.feeds.start(on_restart=router.replica_restarted)
        if settings.redis.enabled:
            services.shared = await start_shared_state(settings, router, services, metrics,
                                                      self.clock)
        gate = Gate(settings.admission, settings.routing, router, metrics, self.clock,
                    self.timer)
        services.gate = gate
        self.services = services
        self._proxy = Proxy(gate=gate,
            server=server, fleet=fleet, router=router, analyzer=services.analyzer,
            metrics=metrics, recorder=recorder, auth=services.auth, monitor=monitor,
            upstream=upstream, affinity=services.affinity, clock=self.clock, timer=self.timer,
            counters=UpstreamCounters(metrics.registry))
        log.debug("gateway services started", extra={
            "replicas": [r.name for r in settings.replicas],
            "healthy": [r.name for r in fleet.healthy()]})

    async def shutdown(self) -> None:
        services, self.services, self._proxy = self.services, None, None
        if services is None:
            return
        if services.gate is not None:
            await services.gate.aclose()
        if services.shared is not None:
            services.router.share(None)
            await services.shared.aclose()
        if services.feeds is not None:
            await services.feeds.aclose()
        await services.monitor.aclose()
        await services.recorder.aclose()
        if self._given_upstream is None:
            await services.upstream.aclose()
            await services.probes.aclose()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[GatewayApp]:
        await self.startup()
        try:
            yield self
        finally:
            await self.shutdown()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # reported to the server, which exits non-zero
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # dispatch ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        services, proxy = self.services, self._proxy
        if services is None or proxy is None:
            await respond_error(send, GatewayError(
                503, "The gateway is not started.", code="not_started"), [])
            return
        path, method = scope["path"], scope["method"]
        endpoint = _ROUTED.get(path)
        if endpoint is not None:
            if method == "POST":
                await proxy.handle(scope, receive, send, endpoint)
            else:
                await _not_allowed(send, method, path, b"POST")
            return
        model_card = path.startswith(_MODEL_PREFIX)  # GET /v1/models/{id}: answered here
        if path in _OWN_GET or model_card:
            if method not in ("GET", "HEAD"):
                await _not_allowed(send, method, path, b"GET, HEAD")
                return
            if path in self._guarded or (model_card and "/v1/models" in self._guarded):
                try:
                    services.auth.tenant(_authorization(scope))
                except GatewayError as err:
                    await respond_error(send, err, [])
                    return
            status, body, content_type = self._simple_get(services, path)
            if path == "/stats" and not services.auth.admin(_authorization(scope)):
                body = orjson.dumps(without_tenants(orjson.loads(body)))  # admins only
            if path == "/stats" and _wants_html(scope):
                body, content_type = render_page(orjson.loads(body)), HTML
            await respond(send, status, body, [], content_type)
            return
        if path.startswith("/v1/") or path in _NATIVE:
            await proxy.handle(scope, receive, send, None)
            return
        await respond_error(send, GatewayError(404, f"No route {path}.", code="not_found"), [])

    def _simple_get(self, s: Services, path: str) -> tuple[int, bytes, bytes]:
        json = b"application/json"
        if path == "/health":
            return 200, b'{"status":"ok"}', json
        if path == "/ready":
            healthy = [r.name for r in s.fleet.healthy()]
            status = 200 if healthy else 503
            return status, orjson.dumps({"ready": bool(healthy), "healthy": healthy}), json
        if path == "/metrics":
            for r in s.fleet.replicas.values():
                s.metrics.replica_state(r.name, r.healthy, r.in_flight, r.snapshot)
            return 200, s.metrics.render(), PROMETHEUS
        if path == "/stats":
            reps = s.fleet.replicas.values()
            stats = s.recorder.stats(
                s.clock(), {r.name: r.snapshot for r in reps},
                configured_capacity={r.name: r.settings.capacity_tokens for r in reps},
                default_capacity_tokens=s.settings.routing.default_capacity_tokens,
                fleet_warnings=[f"replica {r.name} ({r.url}) is unreachable: {r.failures} "
                                "failed health probe(s)" for r in reps if not r.healthy])
            for r in reps:  # what the fleet knows beside the last scrape
                stats["replicas"][r.name].update(url=r.url, healthy=r.healthy,
                                                 in_flight=r.in_flight)
            if s.feeds is not None:
                stats["token_mode"] = s.feeds.status(s.clock())
            if s.gate is not None:
                stats["admission"] = s.gate.stats()
            return 200, orjson.dumps(stats), json
        if path == "/v1/models":
            return 200, orjson.dumps({"object": "list", "data": s.fleet.model_list()}), json
        wanted = path[len(_MODEL_PREFIX):]
        for card in s.fleet.model_list():
            if card.get("id") == wanted:
                return 200, orjson.dumps(card), json
        err = GatewayError(404, f"The model {wanted[:200]!r} does not exist.", param="model",
                           code="model_not_found")
        return 404, err.body(), json


async def start_shared_state(settings: Settings, router: Router, services: Services,
                             metrics: GatewayMetrics, clock: Callable[[], float]
                             ) -> SharedState:
    """Share this instance's routing facts through Redis and apply the others' (the
    Responses API store included); the loops run in the background from here on."""
    from gateway.shared.redis_state import SharedAffinity
    from gateway.shared.redis_state import SharedState as Shared

    shared = Shared(settings.redis, router.apply, services.affinity, clock,
                    registry=metrics.registry)
    router.share(shared.publish)
    services.affinity = SharedAffinity(services.affinity, shared)
    await shared.start()
    return shared


async def _not_allowed(send: Send, method: str, path: str, allow: bytes) -> None:
    error = GatewayError(405, f"Method {method} is not allowed on {path}; use "
                         f"{allow.decode()}.", code="method_not_allowed")
    await respond_error(send, error, [(b"allow", allow)])


def _wants_html(scope: Scope) -> bool:
    """`/stats?format=html` (the query is the client's: only this one value is read)."""
    query = bytes(scope.get("query_string", b"")).decode("latin-1")
    return parse_qs(query).get("format", [""])[-1] == "html"


def _authorization(scope: Scope) -> bytes | None:
    for key, value in scope["headers"]:
        if key == b"authorization":
            return bytes(value)
    return None


def create_app(
    settings: Settings, *, upstream: Upstream | None = None,
    clock: Callable[[], float] = time.time, timer: Callable[[], float] = time.perf_counter,
    sim_renderer: SimRenderer | None = None,
) -> GatewayApp:
    return GatewayApp(settings, upstream=upstream, clock=clock, timer=timer,
                      sim_renderer=sim_renderer)
