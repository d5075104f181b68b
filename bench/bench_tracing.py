"""CPU per request with tracing off, on at 100% and on at 1% (`[tracing]`), in process:
the gateway's ASGI app driven directly with an instant in-memory upstream (bench_proxy's
`--in-process` setup: no sockets on the request side), its spans exported over OTLP/HTTP
to a collector in another process (an aiohttp server that accepts every export), so the
figure holds the span's creation, its attributes, the trace context injected upstream and
the batch processor's export thread (protobuf encoding and the POST), not the collector's
work. The queue is flushed before the clock stops, so no export is left uncounted.

    .venv/bin/python bench/bench_tracing.py --requests 2000 --rounds 5

Modes alternate within each round; the figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from bench_proxy import _InstantResponse, _InstantUpstream, prompts

COLLECTOR = """
import sys
from aiohttp import web
async def traces(request):
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")
app = web.Application(client_max_size=64 << 20)
app.router.add_post("/v1/traces", traces)
app.router.add_get("/ready", lambda r: web.Response(text="ok"))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""

class Upstream(_InstantUpstream):
    """bench_proxy's instant upstream, with a body for the health probe and the scrape
    (the monitor reads them in chunks: an empty one fails, and no replica is healthy)."""

    async def send(self, method: str, url: str, headers: object, body: bytes | None,
                   timeouts: object) -> _InstantResponse:
        if body is None and not url.endswith("/v1/models"):  # /health, /metrics
            return _InstantResponse(False, b"\n")
        return await super().send(method, url, headers, body, timeouts)


MODES = {"off": None, "on, 100%": "1.0", "on, 1%": "0.01"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def one_mode(n: int, ratio: str | None, collector: str) -> tuple[float, float]:
    """(process CPU ms per request, of which the request path's thread)"""
    from gateway.proxy.app import create_app
    from gateway.settings import parse_settings

    env = {"GATEWAY_ADMISSION__ENABLED": "false"}  # tracing's cost alone, whatever the default
    if ratio is not None:
        env["GATEWAY_TRACING__ENABLED"] = "true"
        os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": collector,
                           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                           "OTEL_TRACES_SAMPLER_ARG": ratio})
    settings = parse_settings(None, env, backends=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    app = create_app(settings, upstream=Upstream())  # type: ignore[arg-type]
    async with app.running():
        assert app.services is not None
        for _ in range(100):  # the monitor's first probes mark the replicas up
            if len(app.services.fleet.healthy()) == 2:
                break
            await asyncio.sleep(0.01)
        flush = getattr(app.services.tracer, "flush", lambda: True)
        bodies = prompts(n + 200)
        never = asyncio.get_running_loop().create_future()

        statuses: dict[int, int] = {}

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])  # type: ignore[call-overload]
                statuses[status] = statuses.get(status, 0) + 1

        async def one(body: bytes) -> None:
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, object]:
                if messages:
                    return messages.pop()
                await never
                return {"type": "http.disconnect"}

            await app({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "query_string": b"", "headers": [
                           (b"host", b"gw"), (b"content-type", b"application/json"),
                           (b"content-length", b"%d" % len(body))]}, receive, send)

        for body in bodies[:200]:
            await one(body)
        flush()
        c0, t0 = time.process_time(), time.thread_time()
        for body in bodies[200:]:
            await one(body)
        path = (time.thread_time() - t0) / n * 1000  # the event loop's thread alone
        flush()  # the export thread's work is part of the cost
        cpu = (time.process_time() - c0) / n * 1000
        assert statuses == {200: n + 200}, statuses  # answers, not errors, were measured
        return cpu, path


def main(argv: list[str] | None = None) -> int:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", COLLECTOR, str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode, ratio in MODES.items():
                runs[mode].append(uvloop.run(one_mode(args.requests, ratio,
                                                      f"http://127.0.0.1:{port}")))
    finally:
        proc.terminate()
        proc.wait(10)
    base = statistics.median(v for v, _ in runs["off"])
    base_path = statistics.median(p for _, p in runs["off"])
    print("| tracing | CPU ms/request (median) | vs off | of which the request path's thread "
          "| rounds (all threads) |")
    print("|---|---|---|---|---|")
    for mode, values in runs.items():
        med = statistics.median(v for v, _ in values)
        path = statistics.median(p for _, p in values)
        print(f"| {mode} | {med:.4f} | {med / base:.2f}x (+{(med - base) * 1000:.0f} us) | "
              f"{path:.4f} (+{(path - base_path) * 1000:.0f} us) | "
              f"{' '.join(f'{v:.4f}' for v, _ in values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
