"""`gateway epp`: the gateway's router as a Gateway API Inference Extension endpoint
picker, an Envoy ext_proc gRPC service (gateway.epp.server).

Same settings as `gateway serve` (`--config FILE`, `GATEWAY_*`, `--backend URL`...), and
the same collaborators built from them by `gateway serve`'s own factory
(`gateway.proxy.app.GatewayApp.startup`): replica fleet and health monitor, router, hygiene
analyzer, metrics, usage recorder and its sinks, token mode and shared Redis state where
configured. `--host`/`--port` are the gRPC listener's (`[epp] host/port`, default
127.0.0.1:9002). Replicas are required (the EPP picks among them, it starts no simulator):
configured, or the pods of an InferencePool (`[epp] pool`, gateway.epp.pool).

Shutdown (SIGTERM, SIGINT): health turns NOT_SERVING, the listener stops taking streams
and the ones open run on for up to `server.shutdown_grace_s`; exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

import uvloop

from gateway.coerce import SettingsError
from gateway.epp.decision import endpoint_of
from gateway.extras import MissingExtra, require
from gateway.logs import configure_logging
from gateway.proxy.app import GatewayApp
from gateway.proxy.tokenmode import TokenModelError
from gateway.serve import add_arguments as serve_arguments
from gateway.serve import check_extras, load_settings
from gateway.settings import EppSettings, Settings, scan_env
from gateway.tasks import FailureLog, every

if TYPE_CHECKING:
    from gateway.epp.picker import Picker

log = logging.getLogger("gateway.epp")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_arguments(parser, listener="epp", default_port=EppSettings().port)


def epp_settings(args: argparse.Namespace, env: dict[str, str]) -> Settings:
    """`gateway serve`'s settings, with `--host`/`--port` naming the gRPC listener."""
    rest = argparse.Namespace(**{**vars(args), "host": None, "port": None})
    settings = load_settings(rest, env)
    changes = {k: getattr(args, k) for k in ("host", "port") if getattr(args, k) is not None}
    if changes:
        try:
            settings = dataclasses.replace(
                settings, epp=dataclasses.replace(settings.epp, **changes))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    if settings.epp.pool:
        # the pool's pods are the candidates (gateway.epp.pool)
        return dataclasses.replace(settings, replicas=())
    if not settings.replicas:
        raise SettingsError("no replicas: give --backend URL (repeatable), [[replicas]] "
                            "in --config, GATEWAY_BACKENDS, or [epp] pool")
    return settings


async def resolve_endpoints(urls: dict[str, str]) -> dict[str, str]:
    """Replica name -> `ip:port`: Envoy names hosts by address, a replica URL may name a
    host (a StatefulSet pod's `vllm-0.vllm`); one that does not resolve keeps its name."""
    loop = asyncio.get_running_loop()
    out = {}
    for name, url in urls.items():
        endpoint = endpoint_of(url)
        host, _, port = endpoint.rpartition(":")
        if not _is_address(host.strip("[]")):
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                address = str(infos[0][4][0])
                endpoint = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
            except OSError as exc:
                log.warning("cannot resolve a replica's host", extra={
                    "replica": name, "host": host, "error": str(exc)})
        out[name] = endpoint
    return out


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def keep_resolving(picker: Picker, urls: dict[str, str], every_s: float) -> None:
    """Pods come back with new addresses: resolve again every health interval."""
    async def once() -> None:
        picker.set_endpoints(await resolve_endpoints(urls))

    await every(every_s, once, "endpoint resolution", FailureLog(log))


async def serve_epp(settings: Settings) -> int:
    from gateway.epp.picker import Picker
    from gateway.epp.server import EppServer

    app = GatewayApp(settings)
    await app.startup()
    try:
        assert app.services is not None
        services = app.services
        picker = Picker(services, settings.epp, time.perf_counter)
        epp = settings.epp
        watch = None
        if epp.pool:
            from gateway.epp.pool import watch_pool
            from gateway.replicas.kube import kube_api, own_namespace

            watch = watch_pool(services, kube_api(), own_namespace(epp.pool_namespace),
                               epp.pool, picker.set_endpoints)
            resolving = None
        else:
            urls = {r.name: r.url for r in settings.replicas}
            picker.set_endpoints(await resolve_endpoints(urls))
            resolving = asyncio.create_task(
                keep_resolving(picker, urls, settings.server.health_interval_s))
        try:
            server = EppServer(picker, epp.host, epp.port, epp.max_streams)
        except (OSError, RuntimeError) as exc:
            log.error("cannot listen", extra={"listen": f"{epp.host}:{epp.port}",
                                               "error": str(exc)})
            return 1
        await server.start()
        log.info("endpoint picker started", extra={
            "listen": f"{epp.host}:{server.port}", "replicas": list(picker.endpoints.values()),
            "policy": settings.routing.policy, "response": epp.response})
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("endpoint picker stopping")
        await server.stop(settings.server.shutdown_grace_s)
        if resolving is not None:
            resolving.cancel()
        if watch is not None:
            watch.stop()
        return 0
    finally:
        await app.shutdown()


def run(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    try:
        require("grpc", extra="epp", feature="the endpoint picker (gateway epp)")
        settings = epp_settings(args, env)
        if settings.epp.pool:
            require("kubernetes", extra="kubernetes",
                    feature="the InferencePool pod watch ([epp] pool)")
        check_extras(settings)
    except (SettingsError, MissingExtra, TokenModelError) as exc:
        print(f"gateway epp: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.server.log_level, settings.server.log_format)
    for level, message in scan_env(env).notes():
        log.log(logging.getLevelNamesMapping()[level.upper()], message)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(serve_epp(settings))
