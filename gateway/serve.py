"""`gateway serve`: load the settings, then run the gateway under uvicorn (httptools parser
with the gateway's head bounds, gateway.proxy.protocol; uvloop loop, one worker, no access
log: the usage records are the access log).

Settings come from `--config FILE` (TOML), `GATEWAY_*` environment variables and the flags
(later wins; see gateway.settings); Kubernetes service-link variables and `GATEWAY_*` names
that are no setting are logged once at start and otherwise ignored. `--backend URL`
(repeatable) replaces the configured replicas. With no replica at all, an embedded
simulator (`SimCluster`, 4 replicas on free loopback ports) is started in the same process
and fronted: `gateway serve` alone is a working demo; its replicas start as a vLLM
deployment for agents does (`--enable-auto-tool-choice --tool-call-parser hermes`), so
clients that send `tools` work as they would against that deployment. Invalid settings, a
configured feature whose extra is not installed, or a listen address that cannot be bound
(a port in use) print one line and exit with status 2: the gateway binds its socket
itself, before anything else starts, and hands it to uvicorn.

Shutdown (SIGTERM, SIGINT): the listening socket closes at once (new connections are
refused), idle keep-alive connections close, requests in flight run on for up to
`server.shutdown_grace_s`; streams still open then are cancelled and end with an error
event (gateway.proxy.relay). The process exits with status 0: uvicorn re-raises the
signal it caught after serving, which would report the clean drain as a kill.

SIGHUP reads `--config`, the environment and the flags again: the [[replicas]] list and
[discovery] replace the running ones without a restart (gateway.replicas.sources); invalid
settings are logged and the running ones kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
import uvloop

from gateway.coerce import SettingsError
from gateway.events.config import SIM
from gateway.extras import MissingExtra, require
from gateway.logs import configure_logging
from gateway.proxy.app import GatewayApp, create_app
from gateway.proxy.protocol import bounded_protocol
from gateway.proxy.tokenmode import TokenModelError, load_renderers, require_token_mode
from gateway.settings import (
    Settings,
    parse_settings,
    replica_from_url,
    scan_env,
    with_replicas,
)
from gateway.tokens.render import TokenRenderer
from gateway.usage.recorder import require_redis

if TYPE_CHECKING:
    from gateway.sim.cluster import SimOptions

log = logging.getLogger("gateway.serve")

EMBEDDED_REPLICAS = 4
LONG_ANSWER_TOKENS = 32_700  # the example the start-up line gives (a near-full context)
# The cyclic collector's first threshold (CPython's default is 700 allocations). A request
# allocates a few hundred tracked objects and the requests in flight keep theirs alive, so
# at 700 (32 in flight) a young collection ran every ~14 requests and traversed all of
# them: 7% of the gateway's CPU per 2 KiB request (bench/RESULTS.md, "The fixed cost per
# request"). At 10,000 collections are rare; a cycle's garbage lives a little longer
# (reference counting frees everything else at once).
GC_YOUNG_THRESHOLD = 10_000


def add_arguments(parser: argparse.ArgumentParser, listener: str = "server",
                  default_port: int = 8080) -> None:
    """`listener`: the settings section --host/--port set (`gateway epp` names its gRPC
    listener's, [epp], with its own default port)."""
    parser.add_argument("--config", metavar="FILE", help="TOML settings file")
    parser.add_argument("--backend", metavar="URL", action="append", default=[],
                        help="replica base URL (repeatable); replaces [[replicas]]")
    if listener == "server":  # P/D legs are serve's (gateway.pd)
        parser.add_argument("--prefill", metavar="URL", action="append", default=[],
                            help="a prefill replica's base URL (repeatable, beside --backend; "
                            "[[replicas]] role = \"prefill\")")
        parser.add_argument("--decode", metavar="URL", action="append", default=[],
                            help="a decode replica's base URL (repeatable, beside --backend; "
                            "[[replicas]] role = \"decode\")")
    if listener == "server":  # the picker's replicas are its pool's or its list
        parser.add_argument("--dns", metavar="HOST:PORT", action="append", default=[],
                            help="a DNS name whose every address is a replica, re-resolved "
                            "(repeatable; discovery.dns)")
        parser.add_argument("--kubernetes-selector", metavar="LABELS",
                            help="the Ready pods this label selector picks are the replicas "
                            "(discovery.kubernetes_selector; give discovery."
                            "kubernetes_port or kubernetes_port_name)")
    parser.add_argument("--host",
                        help=f"listen address ({listener}.host, default 127.0.0.1)")
    parser.add_argument("--port", type=int,
                        help=f"listen port ({listener}.port, default {default_port})")
    parser.add_argument("--policy", help="routing policy (routing.policy): prefix, "
                        "least_loaded, round_robin, session, random")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="server.log_level (default info)")
    parser.add_argument("--log-format", choices=["json", "text"],
                        help="server.log_format: json (default, one object per line) or "
                        "text (for a person at a terminal)")
    parser.add_argument("--no-access-log", action="store_true",
                        help="no line per request (server.access_log = false)")
    if listener == "server":
        parser.add_argument("--demo-speed", type=float, metavar="X",
                            help="the embedded simulator's simulated seconds per wall second "
                            "(demo.speed, default 1 = real time; 10 = ten times faster)")


def load_settings(args: argparse.Namespace, env: dict[str, str]) -> Settings:
    text = None
    source = "config"
    if args.config:
        source = args.config
        try:
            text = Path(args.config).read_text(encoding="utf-8")
        except OSError as exc:
            raise SettingsError(f"cannot read {args.config}: {exc.strerror}") from exc
    overrides: dict[str, dict[str, Any]] = {}
    if args.host is not None:
        overrides.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        overrides.setdefault("server", {})["port"] = args.port
    if args.policy is not None:
        overrides.setdefault("routing", {})["policy"] = args.policy
    for key in ("log_level", "log_format"):
        if getattr(args, key, None) is not None:
            overrides.setdefault("server", {})[key] = getattr(args, key)
    if getattr(args, "dns", None):
        overrides.setdefault("discovery", {})["dns"] = tuple(args.dns)
    if getattr(args, "kubernetes_selector", None):
        overrides.setdefault("discovery", {})["kubernetes_selector"] = args.kubernetes_selector
    if getattr(args, "no_access_log", False):
        overrides.setdefault("server", {})["access_log"] = False
    if getattr(args, "demo_speed", None) is not None:
        overrides.setdefault("demo", {})["speed"] = args.demo_speed
    return parse_settings(text, env, source=source, backends=args.backend, overrides=overrides,
                          prefill=getattr(args, "prefill", ()),
                          decode=getattr(args, "decode", ()))


def free_port_run(n: int) -> int:
    """First of n consecutive free loopback ports (the embedded simulator binds them all)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise OSError(f"no {n} consecutive free ports on 127.0.0.1")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, minus re-raising the caught signal once the drain is done."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        handled = (signal.SIGINT, signal.SIGTERM)
        for sig in handled:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)


def listen_socket(host: str, port: int) -> socket.socket:
    """The bound listening socket (as uvicorn binds one), or OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def serve(settings: Settings, reload: Callable[[], Settings] | None = None) -> int:
    host, port = settings.server.host, settings.server.port
    try:
        sock = listen_socket(host, port)
    except OSError as exc:
        why = exc.strerror or str(exc)
        print(f"gateway serve: cannot listen on {host}:{port}: {why} (server.port, --port)",
              file=sys.stderr)
        return 2
    with sock:
        return await _serve(settings, sock, reload)


async def _serve(settings: Settings, sock: socket.socket,
                 reload: Callable[[], Settings] | None) -> int:
    cluster = None
    if (not settings.replicas and not settings.discovery.dns
            and not settings.discovery.kubernetes_selector):
        from gateway.sim.cluster import AGENT_TOOL_CALL_PARSER, SimCluster, SimOptions
        from gateway.sim.kvpublish import KVEventsOptions

        # With `[tokens] models = {"<model>" = "sim"}` the embedded replicas serve that
        # model and publish KV events, and the gateway routes by them (token mode on the
        # demo). One run of free ports: HTTP first, then a PUB and a replay port each.
        sim_models = [m for m, where in settings.tokens.models.items() if where == SIM]
        n = EMBEDDED_REPLICAS
        base = free_port_run(3 * n if sim_models else n)
        demo = settings.demo
        options = SimOptions(replicas=n, port=base, block_size=settings.tokens.block_size,
                             tool_call_parser=AGENT_TOOL_CALL_PARSER, speed=demo.speed,
                             tool_call_probability=demo.tool_call_probability)
        if sim_models:
            options = dataclasses.replace(options, model=sim_models[0],
                                          kv_events=KVEventsOptions(port=base + n))
        cluster = SimCluster(options)
        await cluster.start()
        settings = with_replicas(settings, [replica_from_url(u) for u in cluster.urls])
        log.info(demo_line(options), extra={"urls": cluster.urls, "speed": demo.speed})
    try:
        # SIGHUP reads the settings again (not for the embedded simulator's fleet)
        app = create_app(settings, sim_renderer=sim_renderer,
                         reload=reload if cluster is None else None)
        config = uvicorn.Config(
            app, host=settings.server.host, port=settings.server.port,
            http=bounded_protocol(settings.server.max_head_bytes, settings.server.head_timeout_s),
            loop="none", lifespan="on", access_log=False, log_config=None,
            # No WebSocket endpoint: an Upgrade request is answered as plain HTTP, whatever
            # WebSocket library happens to be installed beside uvicorn.
            ws="none",
            server_header=False, proxy_headers=False, workers=1,
            timeout_graceful_shutdown=settings.server.shutdown_grace_s,
            timeout_keep_alive=settings.server.keep_alive_s,
        )
        server = DrainingServer(config)
        # before serving: once /ready answers, a SIGHUP must reload, never kill (its
        # default action) in the moment between the bind and the handler; one sent
        # while the app still starts reloads nothing (`reload_settings`: no sources yet)
        hangup(app)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        # "Started" only once the port is bound (uvicorn sets `started` after the bind), so
        # an "address already in use" is never preceded by it.
        while not server.started and not serving.done():
            await asyncio.wait([serving], timeout=0.05)
        if server.started:
            # What start-up built (modules, settings, the app) lives as long as the process:
            # out of the collector's way, so its rare full collections walk only what
            # requests left behind.
            gc.freeze()
            services = app.services
            log.info("gateway started", extra={
                "listen": f"http://{settings.server.host}:{sock.getsockname()[1]}",
                "replicas": [r.name for r in settings.replicas],
                "healthy": [r.name for r in services.fleet.healthy()] if services else [],
                "policy": settings.routing.policy,
            })
        await serving
        return 0 if server.started else 1
    finally:
        if cluster is not None:
            await cluster.stop()


def demo_line(options: SimOptions) -> str:
    """The start-up line of the embedded simulator: its speed, and what that means for a
    long answer, so that a 32k-token max_tokens is no silent wait."""
    step = options.step_time
    per_token = step.t_base_s + step.t_weights_s
    n = LONG_ANSWER_TOKENS
    # batch-1 decode: a fixed cost per token plus the KV read growing with the context
    long_s = (n * per_token + step.t_kv_token_s * n * n / 2) / options.speed
    return (f"embedded simulator started: {options.replicas} simulated vLLM replicas of "
            f"{options.model} at {options.speed:g}x an H100's real time (about "
            f"{1000 * per_token / options.speed:.2g} ms per output token alone; max_tokens "
            f"{n} takes about {long_s:.0f} s); demo.speed or --demo-speed sets it")


def hangup(app: GatewayApp) -> None:
    """SIGHUP reloads the replica sources (`GatewayApp.reload_settings`), one at a time."""
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[bool]] = set()

    def reload() -> None:
        task = loop.create_task(app.reload_settings())
        pending.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(pending.discard)

    loop.add_signal_handler(signal.SIGHUP, reload)


def sim_renderer(model: str, block_size: int, max_pieces: int) -> TokenRenderer:
    """`[tokens] models = {"<model>" = "sim"}`: the simulator's template and tokenizer,
    handed to the proxy from here so that the proxy never imports the simulator."""
    from gateway.sim.render import sim_renderer as build

    return build(model, block_size, max_pieces)


def check_extras(settings: Settings) -> None:
    """Fail before start-up, with the install command, when a configured feature's
    optional package is missing (raises `MissingExtra`)."""
    if settings.usage.redis_url:
        require_redis()
    if settings.redis.enabled:
        require("redis", extra="redis", feature="shared routing state ([redis] url)")
    if settings.tokens.enabled:
        require_token_mode(settings.tokens)
        load_renderers(settings.tokens, sim_renderer)  # a missing tokenizer or template fails here
    if settings.tracing.enabled:
        require("opentelemetry.sdk.trace", extra="otel", feature="[tracing] enabled")
    if settings.discovery.kubernetes_selector:
        require("kubernetes", extra="kubernetes",
                feature="the pod watch ([discovery] kubernetes_selector)")


def run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    try:
        settings = load_settings(args, env)
        check_extras(settings)
    except (SettingsError, MissingExtra, TokenModelError) as exc:
        print(f"gateway serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.server.log_level, settings.server.log_format)
    if settings.server.log_level != "debug":
        # The embedded simulator's periodic engine lines are its own business, not the
        # gateway's: only its warnings show.
        logging.getLogger("gateway.sim").setLevel(logging.WARNING)
    for level, message in scan_env(env).notes():
        log.log(logging.getLevelNamesMapping()[level.upper()], message)
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(serve(settings, lambda: load_settings(args, dict(os.environ))))
