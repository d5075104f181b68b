"""The gateway's ASGI application and the factory that builds it.

`create_app(settings, upstream=None, clock=time.time)` returns an ASGI callable: the
inference routes go straight to the raw-ASGI proxy (gateway.proxy.handler; a framework's
request objects would be most of that path's CPU), everything else to a Starlette app (the
gateway's own routes, 404/405 in OpenAI's shape, the lifespan). Every long-lived object
(upstream client, fleet and its monitor, router, hygiene analyzer, metrics, usage recorder)
is built at startup, in the lifespan, and owned by one `Services` value; nothing lives at
module level, so a test process can build as many apps as it likes. Tests that drive the
app without a server (httpx.ASGITransport skips the lifespan) use
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

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission.gate import Gate
from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.lograte import LogLimiter
from gateway.pd.stats import engine_split
from gateway.proxy.asgi import Receive, Scope, Send
from gateway.proxy.auth import Authenticator
from gateway.proxy.client import AiohttpUpstream, ClientLimits
from gateway.proxy.errors import GatewayError, error_response
from gateway.proxy.handler import Proxy
from gateway.proxy.inbound import Endpoint
from gateway.proxy.services import Services
from gateway.proxy.tenancy import TenantSalts
from gateway.proxy.tokenmode import SimRenderer, start_token_mode

if TYPE_CHECKING:
    from gateway.shared.redis_state import SharedState
from gateway.coerce import SettingsError
from gateway.replicas.fleet import Fleet
from gateway.replicas.membership import Membership
from gateway.replicas.monitor import FleetMonitor
from gateway.replicas.sources import FleetSources, Resolver, getaddrinfo
from gateway.routing.router import Router
from gateway.settings import Settings
from gateway.tracing import request_tracer
from gateway.upstream.counters import UpstreamCounters
from gateway.upstream.seam import Upstream
from gateway.usage.exposure import Audience, FleetMetrics, audience, stats_view
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.page import render_page
from gateway.usage.recorder import UsageRecorder

log = logging.getLogger("gateway.proxy.app")

JSON = "application/json"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
# With [redis]: how long start-up waits for discovered replicas to be listed and probed
# before replaying the others' facts (only facts about known replicas are applied)
CATCH_UP_JOIN_WAIT_S = 10.0
HTML = "text/html; charset=utf-8"
# The inference routes the gateway routes by prefix and accounts (POST only).
_ROUTED: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions",
    "/v1/responses": "responses", "/v1/messages": "messages",
}
# The prefix of GET /v1/models/{id} (answered here, not forwarded).
_MODEL_PREFIX = "/v1/models/"
# vLLM's own endpoints outside /v1/ (routers and `vllm bench serve` call /tokenize through
# whatever base URL they are given); forwarded by the body's model like /v1/* calls.
_NATIVE = frozenset({"/tokenize", "/detokenize", "/pooling", "/score", "/rerank",
                     "/classify"})


class GatewayApp:
    def __init__(
        self, settings: Settings, *, upstream: Upstream | None = None,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.perf_counter,
        sim_renderer: SimRenderer | None = None,
        reload: Callable[[], Settings] | None = None, resolver: Resolver = getaddrinfo,
    ) -> None:
        self.settings = settings
        # SIGHUP: the settings read again (`reload_settings`); DNS answers (`[discovery]`)
        self._reload, self._resolver = reload, resolver
        self.sources: FleetSources | None = None
        self._given_upstream = upstream
        self._sim_renderer = sim_renderer  # for [tokens] models = "sim" (serve.py's)
        self.clock = clock  # wall time: record timestamps, routing and stats windows
        self.timer = timer  # monotonic: latencies
        self.services: Services | None = None
        # The gateway's own routes that need a key when keys are configured (/health and
        # /ready stay open for probes).
        self._guard_models = bool(settings.auth.keys)
        self._guard_stats = bool(settings.auth.keys) and not settings.auth.public_metrics
        self._proxy: Proxy | None = None
        self._own = self._routes()

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
        salts = TenantSalts(set(settings.auth.keys.values()), settings.auth.tenant_cache_salt,
                            token_mode=tokens is not None)
        if salts.shared_index and settings.auth.keys:
            log.info("[tokens] with [auth] keys and no [auth] tenant_cache_salt: routing on "
                     "the engines' shared blocks; replica, prediction and route are withheld "
                     "from non-admin keys (set tenant_cache_salt to isolate tenants)")
        # a record of a replica that left is counted apart, never as a new series of it
        metrics = GatewayMetrics(live=fleet.replicas.__contains__)
        hygiene = settings.hygiene
        recorder = UsageRecorder(
            settings.usage, metrics, access_log=server.access_log, started_at=self.clock(),
            finding_log=LogLimiter(hygiene.log_interval_s, hygiene.log_max_per_s,
                                   hygiene.max_sessions + hygiene.max_templates),
            clock=self.clock)
        tracer = request_tracer(settings.tracing, dict(os.environ), metrics.registry)
        monitor = FleetMonitor(fleet, upstream, router, metrics, settings, self.clock,
                               recorder=recorder, probes=probes)
        services = Services(
            settings=settings, clock=self.clock, upstream=upstream, fleet=fleet, router=router,
            analyzer=HygieneAnalyzer(settings.hygiene), metrics=metrics, recorder=recorder,
            auth=Authenticator(settings.auth.keys, settings.auth.admin_tenants), monitor=monitor,
            probes=probes,
            feeds=tokens.feeds if tokens is not None else None, salts=salts, tracer=tracer,
        )
        await recorder.start()
        await monitor.start()
        if services.feeds is not None:
            await services.feeds.start(on_restart=router.replica_restarted)
        membership = Membership(fleet, monitor, services.remove_replica, settings.discovery,
                                self.clock, on_member=services.joined)
        self.sources = FleetSources(membership, self._resolver)
        await self.sources.start(settings.replicas)
        if settings.redis.enabled:
            # The catch-up applies only facts about replicas the router knows: a DNS name's
            # or a selector's replicas are known once resolved, listed and probed up
            # (bounded: one that takes longer starts without the others' memory of it).
            await self.sources.settled(CATCH_UP_JOIN_WAIT_S)
            services.shared = await start_shared_state(settings, router, services, metrics,
                                                      self.clock)
        gate = Gate(settings.admission, settings.routing, router, metrics, self.clock,
                    self.timer, fleet=fleet,
                    scrape_interval_s=settings.usage.scrape_interval_s,
                    suspect=monitor.suspect, scrape_soon=monitor.scrape_soon)
        services.gate = gate
        self.services = services
        self._proxy = Proxy(gate=gate,
            server=server, fleet=fleet, router=router, analyzer=services.analyzer,
            metrics=metrics, recorder=recorder, auth=services.auth, monitor=monitor,
            upstream=upstream, affinity=services.affinity, clock=self.clock, timer=self.timer,
            counters=UpstreamCounters(metrics.registry),
            salts=salts, tracer=services.tracer, pd=settings.pd)
        log.debug("gateway services started", extra={
            "replicas": [r.name for r in settings.replicas],
            "healthy": [r.name for r in fleet.healthy()]})

    async def shutdown(self) -> None:
        services, self.services, self._proxy = self.services, None, None
        if services is None:
            return
        if self.sources is not None:
            await self.sources.aclose()
            self.sources = None
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
        # the spans still queued go now, within [tracing] shutdown_timeout_s
        await asyncio.to_thread(services.tracer.close)

    async def reload_settings(self) -> bool:
        """SIGHUP: read the settings again; their [[replicas]] and [discovery] replace the
        running ones (gateway.replicas.sources), without a restart. False, and nothing
        changed, when there is nothing to read them from or they are not valid."""
        if self._reload is None or self.sources is None:
            return False
        try:
            new = self._reload()
        except (SettingsError, ValueError, OSError) as exc:
            log.error("settings not reloaded", extra={"error": str(exc)[:500]})
            return False
        old = self.settings
        if dataclasses.replace(new, replicas=old.replicas, discovery=old.discovery) != old:
            log.warning("settings reloaded: only [[replicas]] and [discovery] change without "
                        "a restart; the other sections keep their running values")
        self.settings = dataclasses.replace(old, replicas=new.replicas,
                                            discovery=new.discovery)
        await self.sources.reload(new.replicas, new.discovery)
        log.info("settings reloaded", extra={"replicas": [r.name for r in new.replicas],
                                             "dns": list(new.discovery.dns)})
        return True

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[GatewayApp]:
        await self.startup()
        try:
            yield self
        finally:
            await self.shutdown()

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        """Starlette's lifespan: a startup failure is reported to the server, which exits
        non-zero."""
        async with self.running():
            yield

    # dispatch ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The inference path goes straight to the raw-ASGI proxy (no framework objects on
        the hot path); everything else (lifespan, the gateway's own routes, 404/405) is
        the Starlette app's."""
        if scope["type"] == "http":
            proxy = self._proxy
            if proxy is None:
                await error_response(GatewayError(
                    503, "The gateway is not started.", code="not_started"))(scope, receive, send)
                return
            path = scope["path"]
            endpoint = _ROUTED.get(path)
            if endpoint is not None:
                if scope["method"] == "POST":
                    await proxy.handle(scope, receive, send, endpoint)
                    return
            elif path in _NATIVE or (path.startswith("/v1/") and not _models(path)):
                await proxy.handle(scope, receive, send, None)
                return
        await self._own(scope, receive, send)

    def _routes(self) -> Starlette:
        get = ["GET"]  # HEAD too (Starlette adds it)
        return Starlette(
            routes=[
                Route("/health", self._health, methods=get),
                Route("/ready", self._ready, methods=get),
                Route("/metrics", self._metrics, methods=get),
                Route("/stats", self._stats, methods=get),
                Route("/v1/models", self._models, methods=get),
                Route("/v1/models/{model:path}", self._model_card, methods=get),
                # the same raw-ASGI proxy __call__ sends POSTs to: here for the 405s
                *(Route(path, _Proxied(self, endpoint), methods=["POST"])
                  for path, endpoint in _ROUTED.items()),
            ],
            exception_handlers={GatewayError: _gateway_error, HTTPException: _http_error},
            lifespan=self._lifespan)

    # the gateway's own routes -------------------------------------------------------------

    def _live(self, request: Request, guarded: bool = False) -> Services:
        services = self.services
        if services is None:
            raise GatewayError(503, "The gateway is not started.", code="not_started")
        if guarded:  # only when keys are configured (/health and /ready stay open for probes)
            services.auth.tenant(_authorization(request.scope))
        return services

    async def _health(self, request: Request) -> Response:
        self._live(request)
        return Response(b'{"status":"ok"}', media_type=JSON)

    async def _ready(self, request: Request) -> Response:
        healthy = [r.name for r in self._live(request).fleet.healthy()]
        return Response(orjson.dumps({"ready": bool(healthy), "healthy": healthy}),
                        200 if healthy else 503, media_type=JSON)

    async def _metrics(self, request: Request) -> Response:
        s = self._live(request, self._guard_stats)
        for r in s.fleet.replicas.values():
            s.metrics.replica_state(r.name, r.healthy, r.in_flight, r.snapshot)
        if self._reader(s, request)[0] == "operator":
            return Response(s.metrics.render(), media_type=PROMETHEUS)
        shared = self._proxy is not None and self._proxy.salts.shared_index
        return Response(generate_latest(FleetMetrics(s.metrics.registry, shared_index=shared)),
                        media_type=PROMETHEUS)

    async def _stats(self, request: Request) -> Response:
        s = self._live(request, self._guard_stats)
        who, tenant = self._reader(s, request)
        shared = self._proxy is not None and self._proxy.salts.shared_index
        # tenant-scoped fields: exposure.py
        stats = stats_view(self.stats(s), who, tenant, shared_index=shared)
        # `format=html` (the query is the client's: only this one value is read)
        if request.query_params.getlist("format")[-1:] == ["html"]:
            return Response(render_page(stats), media_type=HTML)
        return Response(orjson.dumps(stats), media_type=JSON)

    def _reader(self, s: Services, request: Request) -> tuple[Audience, str | None]:
        """Who reads /stats or /metrics (gateway.usage.exposure): a key that is not valid
        reads as no key (only where the route is public: it was refused otherwise)."""
        authorization = _authorization(request.scope)
        tenant = None
        if s.auth.enabled:
            with contextlib.suppress(GatewayError):
                tenant = s.auth.tenant(authorization)
        admin = tenant is not None and s.auth.admin(authorization)
        return audience(s.auth.enabled, tenant, admin), tenant

    async def _models(self, request: Request) -> Response:
        s = self._live(request, self._guard_models)
        return Response(orjson.dumps({"object": "list", "data": s.fleet.model_list()}),
                        media_type=JSON)

    async def _model_card(self, request: Request) -> Response:
        s = self._live(request, self._guard_models)
        wanted = request.path_params["model"]
        for card in s.fleet.model_list():
            if card.get("id") == wanted:
                return Response(orjson.dumps(card), media_type=JSON)
        raise GatewayError(404, f"The model {wanted[:200]!r} does not exist.", param="model",
                           code="model_not_found")

    def stats(self, s: Services) -> dict[str, Any]:
        """The /stats document (every tenant's breakdown included)."""
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
        if self._proxy is not None and s.fleet.has_prefill():
            stats["pd"] = self._proxy.pd.stats.snapshot()  # P/D traffic (gateway.pd)
            stats["pd"]["prefill_engines"] = engine_split(
                {r.name: r.snapshot for r in reps if r.prefill_only})
        return stats


class _Proxied:
    """One inference route as the raw ASGI app it is (Starlette calls an object that is
    neither a function nor a method as ASGI)."""

    def __init__(self, app: GatewayApp, endpoint: Endpoint) -> None:
        self.app, self.endpoint = app, endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        proxy = self.app._proxy
        if proxy is None:
            raise GatewayError(503, "The gateway is not started.", code="not_started")
        await proxy.handle(scope, receive, send, self.endpoint)


async def start_shared_state(settings: Settings, router: Router, services: Services,
                             metrics: GatewayMetrics, clock: Callable[[], float]
                             ) -> SharedState:
    """Share this instance's routing facts through Redis and apply the others' (the
    Responses API store included); the loops run in the background from here on."""
    from gateway.shared.affinity import SharedAffinity
    from gateway.shared.redis_state import SharedState as Shared

    fleet = services.fleet
    shared = Shared(settings.redis, router.apply, services.affinity, clock,
                    registry=metrics.registry, known=lambda name: name in fleet.replicas)
    router.share(shared.publish)
    services.affinity = SharedAffinity(services.affinity, shared)
    await shared.start()
    return shared


def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return error_response(exc)


def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    path = request.scope["path"]
    if exc.status_code != 405:
        return error_response(GatewayError(exc.status_code, f"No route {path}.",
                                           code="not_found"))
    allow = ", ".join(sorted((exc.headers or {}).get("Allow", "").split(", ")))
    return error_response(GatewayError(
        405, f"Method {request.method} is not allowed on {path}; use {allow}.",
        code="method_not_allowed"), [(b"allow", allow.encode())])


def _models(path: str) -> bool:
    """GET /v1/models and /v1/models/{id} are the gateway's own, whatever the method."""
    return path == "/v1/models" or path.startswith(_MODEL_PREFIX)


def _authorization(scope: Scope) -> bytes | None:
    for key, value in scope["headers"]:
        if key == b"authorization":
            return bytes(value)
    return None


def create_app(
    settings: Settings, *, upstream: Upstream | None = None,
    clock: Callable[[], float] = time.time, timer: Callable[[], float] = time.perf_counter,
    sim_renderer: SimRenderer | None = None, reload: Callable[[], Settings] | None = None,
    resolver: Resolver = getaddrinfo,
) -> GatewayApp:
    return GatewayApp(settings, upstream=upstream, clock=clock, timer=timer,
                      sim_renderer=sim_renderer, reload=reload, resolver=resolver)
