"""Proxy overhead benchmark: the gateway (routing on, default settings, the admission queue
pinned off, its default, so the figure keeps its meaning) in front of two instant
backends, against the same load sent straight to a backend.

Backends: a raw-asyncio HTTP/1.1 server in its own process that answers every POST at once,
with a canned chat completion carrying usage, or, for `"stream": true`, 64 SSE events plus
the usage chunk and `[DONE]`. Prompts are ~2 KB (a shared 1.5 KB system prompt plus a unique
user message), so the router hashes and indexes real blocks.

Load: one client process (aiohttp), a fixed number of requests at concurrency C. Measured:
the gateway process's CPU time per request (utime+stime from /proc/<pid>/stat, 10 ms ticks:
use >= 500 requests per case) and the client-side latency percentiles, gateway vs direct,
side by side in one run.

Yardstick: a bare aiohttp relay (aiohttp's server and client, nothing else: read, forward
round robin, relay) runs beside the gateway on the same backends and load, measured in the
same rounds; the summary prints the gateway's CPU per request as a multiple of the relay's.

Before/after: `--baseline SRC` runs a second gateway from another source tree next to this
one (same backends, same load, measured alternately `--rounds` times; medians), e.g.

    mkdir -p /tmp/base && git archive <commit> gateway | tar -x -C /tmp/base
    .venv/bin/python bench/bench_proxy.py --requests 2000 --serial-requests 600 \
        --rounds 5 --baseline /tmp/base

`--in-process` drives the ASGI app directly with an instant in-memory upstream (no sockets,
no uvicorn, no HTTP client): the gateway's own Python per request (routing, hygiene, usage,
glue). `PYTHONPATH=/tmp/base` runs it against the baseline tree.
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
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
from proxy_servers import COMPLETION, MODELS, STREAM, serve_asgi_relay, serve_backend, serve_relay

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
# the gateway's own overhead, the admission queue pinned off whatever the default
# (`--gateway-env GATEWAY_ADMISSION__ENABLED=true` measures it with the queue)
QUEUE_OFF = {"GATEWAY_ADMISSION__ENABLED": "false"}

# -- load -------------------------------------------------------------------------------------

def prompts(n: int) -> list[bytes]:
    system = ("You are a careful assistant for the bench corporation. " * 28)[:1500]
    out = []
    for i in range(n):
        user = f"Question {i}: " + ("please summarise the attached notes " * 14)[:480]
        out.append(orjson.dumps({"model": "bench", "max_tokens": 16, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]}))
    return out


async def load(url: str, bodies: list[bytes], concurrency: int, stream: bool) -> list[float]:
    if stream:
        bodies = [b[:-1] + b',"stream":true}' for b in bodies]
    latencies: list[float] = []
    queue = list(reversed(bodies))
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            while queue:
                body = queue.pop()
                t0 = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers=headers) as r:
                    async for _ in r.content.iter_any():
                        pass
                    assert r.status == 200, r.status
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


# -- in process: the gateway's own Python, no sockets ----------------------------------------

class _InstantResponse:
    """An `UpstreamResponse` that is already complete (JSON, or the stream in 3 reads)."""

    def __init__(self, stream: bool, body: bytes) -> None:
        self.status = 200
        ctype = b"text/event-stream" if stream else b"application/json"
        self.headers = [(b"content-type", ctype), (b"content-length", b"%d" % len(body))]
        self._body = body

    async def read(self) -> bytes:
        return self._body

    async def chunks(self) -> AsyncIterator[bytes]:
        step = max(1, -(-len(self._body) // 3))  # an empty body (/health) is no chunk
        for i in range(0, len(self._body), step):
            yield self._body[i:i + step]

    def release(self) -> None:
        return None

    def abort(self) -> None:
        return None


class _InstantUpstream:
    async def send(self, method: str, url: str, headers: object, body: bytes | None,
                   timeouts: object) -> _InstantResponse:
        if url.endswith("/v1/models"):
            return _InstantResponse(False, MODELS)
        if body is None:
            return _InstantResponse(False, b"")
        if b'"stream":true' in body:
            return _InstantResponse(True, b"".join(STREAM))
        return _InstantResponse(False, COMPLETION)

    async def aclose(self) -> None:
        return None


async def _in_process(n: int, stream: bool) -> float:
    from gateway.proxy.app import create_app
    from gateway.settings import parse_settings

    settings = parse_settings(None, QUEUE_OFF,
                              backends=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    app = create_app(settings, upstream=_InstantUpstream())  # type: ignore[arg-type]
    async with app.running():
        assert app.services is not None
        for _ in range(100):  # the monitor's first probes mark the replicas up
            if len(app.services.fleet.healthy()) == 2:
                break
            await asyncio.sleep(0.01)
        bodies = prompts(n + 200)
        if stream:
            bodies = [b[:-1] + b',"stream":true}' for b in bodies]
        never = asyncio.get_running_loop().create_future()

        async def send(message: object) -> None:
            return None

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
        c0 = time.process_time()
        for body in bodies[200:]:
            await one(body)
        return (time.process_time() - c0) / n * 1000


def run_in_process(n: int, rounds: int) -> int:
    import uvloop

    for stream in (False, True):
        runs = [uvloop.run(_in_process(n, stream)) for _ in range(rounds)]
        print(f"{'64-chunk SSE (3 reads)' if stream else 'JSON'}: gateway CPU ms/req median "
              f"{statistics.median(runs):.4f} (runs: {' '.join(f'{r:.4f}' for r in runs)})")
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_gateway(backends: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([str(ROOT / ".venv/bin/gateway"), "serve", "--port", str(port),
                             *(a for b in backends for a in ("--backend", b))], env=env)
    return proc, f"http://127.0.0.1:{port}"


def measure(pid: int, url: str, bodies: list[bytes], concurrency: int, stream: bool,
            ) -> tuple[float, list[float], float]:
    """CPU ms/request of pid, client latencies, wall seconds."""
    c0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    lat = asyncio.run(load(url, bodies, concurrency, stream))
    wall = time.perf_counter() - t0
    return (cpu_seconds(pid) - c0) / len(bodies) * 1000, lat, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--serial-requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each case this many times (alternating gateways); medians")
    ap.add_argument("--baseline", metavar="SRC",
                    help="also run a gateway from this source tree (PYTHONPATH=SRC, e.g. a "
                    "`git archive HEAD~n gateway` unpacked), measured alternately with this one")
    ap.add_argument("--in-process", action="store_true",
                    help="no sockets: drive the ASGI app directly (gateway Python cost only)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the gateway, e.g. GATEWAY_HYGIENE__ENABLED=0")
    ap.add_argument("--no-relay", action="store_true",
                    help="skip the bare aiohttp relay measured beside the gateway")
    ap.add_argument("--asgi-relay", action="store_true",
                    help="also measure the bare relay as an ASGI app on uvicorn (the front "
                    "the gateway runs on)")
    ap.add_argument("--asgi-relay-server", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--backend-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--relay-server", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.backend_server:
        asyncio.run(serve_backend(args.backend_server))
        return 0
    if args.relay_server:
        import uvloop

        uvloop.run(serve_relay(int(args.relay_server[0]), args.relay_server[1:]))
        return 0
    if args.asgi_relay_server:
        import uvloop

        uvloop.run(serve_asgi_relay(int(args.asgi_relay_server[0]),
                                    args.asgi_relay_server[1:]))
        return 0
    if args.in_process:
        return run_in_process(args.requests, args.rounds)

    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = [free_port(), free_port()]
        for p in ports:
            procs.append(subprocess.Popen([sys.executable, __file__, "--backend-server", str(p)]))
        backends = [f"http://127.0.0.1:{p}" for p in ports]
        for b in backends:
            wait(b + "/health")
        env = {**os.environ, "GATEWAY_LOG_LEVEL": "warning", **QUEUE_OFF,
               **dict(kv.split("=", 1) for kv in args.gateway_env)}
        gateways: list[tuple[str, subprocess.Popen[bytes], str]] = []
        proc, url = start_gateway(backends, env)
        procs.append(proc)
        gateways.append(("this", proc, url))
        if args.baseline:
            base_env = {**env, "PYTHONPATH": str(Path(args.baseline).resolve())}
            proc, url = start_gateway(backends, base_env)
            procs.append(proc)
            gateways.append(("baseline", proc, url))
        if not args.no_relay:
            port = free_port()
            proc = subprocess.Popen([sys.executable, __file__, "--relay-server", str(port),
                                     *backends])
            procs.append(proc)
            gateways.append(("bare aiohttp relay", proc, f"http://127.0.0.1:{port}"))
        if args.asgi_relay:
            port = free_port()
            proc = subprocess.Popen([sys.executable, __file__, "--asgi-relay-server",
                                     str(port), *backends])
            procs.append(proc)
            gateways.append(("bare ASGI relay on uvicorn", proc, f"http://127.0.0.1:{port}"))
        for _, _, url in gateways:
            wait(url + "/ready")
        rows = []
        for stream in (False, True):
            for concurrency, n in ((32, args.requests), (1, args.serial_requests)):
                bodies = prompts(n)
                asyncio.run(load(backends[0], bodies[:50], concurrency, stream))  # warm up
                for _, _, url in gateways:
                    asyncio.run(load(url, bodies[:50], concurrency, stream))
                direct: list[float] = []
                got: dict[str, list[tuple[float, float, float, float]]] = {
                    g[0]: [] for g in gateways}
                for r in range(args.rounds):
                    d = asyncio.run(load(backends[0], bodies, concurrency, stream))
                    direct.append(statistics.median(d))
                    order = gateways if r % 2 == 0 else gateways[::-1]
                    for label, proc, url in order:
                        cpu, lat, wall = measure(proc.pid, url, bodies, concurrency, stream)
                        got[label].append((cpu, statistics.median(lat), pct(lat, 0.99), n / wall))
                d50 = statistics.median(direct)
                for label, _, _ in gateways:
                    runs = got[label]
                    cpu = statistics.median(x[0] for x in runs)
                    v50 = statistics.median(x[1] for x in runs)
                    rows.append((
                        "64-chunk SSE" if stream else "JSON", label, concurrency, n, cpu,
                        d50 * 1000, v50 * 1000, (v50 - d50) * 1000,
                        statistics.median(x[2] for x in runs) * 1000,
                        statistics.median(x[3] for x in runs),
                        " ".join(f"{x[0]:.3f}" for x in runs),
                    ))
        header = ("| response | gateway | conc. | requests | gateway CPU ms/req | p50 direct ms | "
                  "p50 via gateway ms | added p50 ms | p99 via gateway ms | req/s via gateway | "
                  "CPU per round |\n|---|---|---|---|---|---|---|---|---|---|---|")
        lines = [header] + [
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.3f} | "
            f"{r[7]:.3f} | {r[8]:.3f} | {r[9]:.0f} | {r[10]} |" for r in rows
        ]
        table = "\n".join(lines)
        ratios = [
            f"{r[0]} c={r[2]}: gateway CPU / bare relay CPU = {r[4] / b[4]:.2f}x, "
            f"added p50 {r[7]:.3f} ms (relay {b[7]:.3f} ms)"
            for r in rows if r[1] == "this"
            for b in rows if b[1] == "bare aiohttp relay" and b[:1] + b[2:4] == r[:1] + r[2:4]
        ]
        ratios += [
            f"{r[0]} c={r[2]}: gateway CPU / bare ASGI relay on uvicorn CPU = "
            f"{r[4] / b[4]:.2f}x; that relay / the bare aiohttp relay = {b[4] / a[4]:.2f}x"
            for r in rows if r[1] == "this"
            for b in rows if b[1] == "bare ASGI relay on uvicorn"
            and b[:1] + b[2:4] == r[:1] + r[2:4]
            for a in rows if a[1] == "bare aiohttp relay" and a[:1] + a[2:4] == r[:1] + r[2:4]
        ]
        table += "\n\n" + "\n".join(f"- {line}" for line in ratios)
        print(table)
        if args.out:
            args.out.write_text(args.out.read_text() + "\n" + table + "\n"
                                if args.out.exists() else table + "\n")
        return 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
