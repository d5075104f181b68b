"""The gRPC transport's floor under the endpoint picker (bench/bench_epp.py): ext_proc
servers that answer every message with one prebuilt response, whatever it is, so what
they cost is what any Python picker pays for the messages alone before it decides
anything.

- per request (`bench_epp.py --floor`): grpc.aio on uvloop (as `gateway epp` runs), its
  read/write style, gRPC core's poll engine, grpc.aio on asyncio's loop, grpcio's
  synchronous server on threads; fed the 2, 3 or 4 messages of a JSON request.
- per message (in every `bench_epp.py` run, beside the picker): grpc.aio on uvloop fed the
  messages of a full-duplex stream as Envoy shapes them (request headers, the body, the
  response headers, then the answer's chunks), each answered with one prebuilt message;
  a response chunk's answer is a prebuilt BodyResponse carrying a chunk of the stream's
  size back (full duplex: Envoy forwards what the processor sends, so the bytes go both
  ways). The cost of one more chunk is the difference between a stream of the 66 chunks
  (64 events, the usage, `[DONE]`) and a 1-chunk one, over 65.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_proxy import cpu_seconds, free_port, prompts
from proxy_servers import COMPLETION, EVENT, STREAM

FLOOR_KINDS = ("aio+uvloop", "aio+uvloop read-write", "aio+uvloop poll", "aio+asyncio",
               "sync+threads")
# the per-message floor's server: what `gateway epp` runs, a response chunk's answer
# carrying a chunk back (the per-request kinds answer it "continue", as the buffered modes)
ECHO = "aio+uvloop echo"


def floor_server(kind: str, port: int) -> None:
    """An ext_proc server that answers every message with one prebuilt response: what
    any Python picker pays for the gRPC messages alone, whatever it decides."""
    if kind.endswith(" poll"):
        # gRPC core's poll(2) engine instead of its default epoll1 (read at its start)
        os.environ["GRPC_POLL_STRATEGY"] = "poll"
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

    # a chunk of the stream's size sent back, as the picker does in full duplex
    chunk = ext.BodyResponse(response=ext.CommonResponse(body_mutation=ext.BodyMutation(
        streamed_response=ext.StreamedBodyResponse(body=EVENT))))
    answers = {k: ext.ProcessingResponse(**{k: v}) for k, v in (
        ("request_headers", ext.HeadersResponse()), ("request_body", ext.BodyResponse()),
        ("response_headers", ext.HeadersResponse()),
        ("response_body", chunk if kind == ECHO else ext.BodyResponse()),
        ("response_trailers", ext.TrailersResponse()))}

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


def _headers(pairs: list[tuple[str, str]], end: bool) -> Any:
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    return ext.HttpHeaders(end_of_stream=end, headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))


def _request_headers(body: bytes) -> Any:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    return ext.ProcessingRequest(request_headers=_headers([
        (":authority", "127.0.0.1"), (":path", "/v1/chat/completions"),
        (":method", "POST"), (":scheme", "http"), ("content-type", "application/json"),
        ("content-length", str(len(body))), ("user-agent", "bench"),
        ("x-forwarded-proto", "http"), ("x-request-id", "0" * 36)], False))


def floor_messages(body: bytes) -> list[Any]:
    """The four messages of one JSON request, shaped as Envoy sends them."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    answer = COMPLETION
    return [
        _request_headers(body),
        ext.ProcessingRequest(request_body=ext.HttpBody(body=body, end_of_stream=True)),
        ext.ProcessingRequest(response_headers=_headers([
            (":status", "200"), ("content-type", "application/json"),
            ("content-length", str(len(answer)))], False)),
        ext.ProcessingRequest(response_body=ext.HttpBody(body=answer, end_of_stream=True)),
    ]


def stream_messages(body: bytes, chunks: int) -> list[Any]:
    """A full-duplex stream's messages: request headers, the body (one chunk, at end of
    stream), the response headers of an event stream, then `chunks` of the answer (the
    stream's events, the last with end_of_stream)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    events = STREAM[-chunks:] if chunks <= len(STREAM) else [EVENT] * chunks
    return [
        _request_headers(body),
        ext.ProcessingRequest(request_body=ext.HttpBody(body=body, end_of_stream=True)),
        ext.ProcessingRequest(response_headers=_headers([
            (":status", "200"), ("content-type", "text/event-stream")], False)),
        *(ext.ProcessingRequest(response_body=ext.HttpBody(
            body=e, end_of_stream=i == len(events) - 1)) for i, e in enumerate(events)),
    ]


async def floor_load(port: int, streams: int, conc: int, messages: list[Any],
                     replies: list[int] | None = None) -> None:
    """`streams` streams of these messages, `conc` at a time, each message written and
    its answers read (`replies`: how many per message, one each by default) before the
    next (as a paced stream's chunks come: each answered before the next arrives)."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

    counts = replies or [1] * len(messages)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_grpc.ExternalProcessorStub(channel)
        left = iter(range(streams))

        async def worker() -> None:
            for _ in left:
                call = stub.Process()
                for m, n in zip(messages, counts, strict=True):
                    await call.write(m)
                    for _ in range(n):
                        got = await call.read()
                        assert got is not grpc.aio.EOF, "the stream ended early"
                await call.done_writing()
                await call.read()  # the end of the stream: every answer was counted

        await asyncio.gather(*(worker() for _ in range(conc)))


def picker_stream(body: bytes, chunks: int) -> tuple[list[Any], list[int]]:
    """stream_messages() as llm-d's Envoy sends them to `gateway epp` (both bodies
    FULL_DUPLEX_STREAMED, named in the first message), and how many answers each gets:
    none to the request headers (the body is gathered), the pick and the body back to the
    body, one to the response headers and to each chunk."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    messages = stream_messages(body, chunks)
    config = ext.ProtocolConfiguration(request_body_mode=4, response_body_mode=4)
    messages[0] = ext.ProcessingRequest(request_headers=messages[0].request_headers,
                                        protocol_config=config)
    return messages, [0, 2, 1, *[1] * chunks]


def start_echo(start: Callable[[list[str], Path], subprocess.Popen[bytes]], work: Path,
               kind: str = ECHO) -> tuple[int, subprocess.Popen[bytes]]:
    port = free_port()
    proc = start([sys.executable, str(Path(__file__).with_name("bench_epp.py")),
                  "--floor-server", kind, str(port)], work / f"floor-{kind}.log")
    wait_port(port)
    return port, proc


class PerMessage:
    """CPU per streamed chunk of one ext_proc server fed full-duplex streams by a gRPC
    client: (CPU of `streams` streams of the 66 chunks - CPU of as many 1-chunk ones) /
    65 / streams, in milliseconds; and its CPU per message over the 66-chunk streams (69
    messages), for scale. `picker`: the server is `gateway epp` (the messages as llm-d's
    Envoy sends them, `picker_stream`), else the prebuilt-answer echo."""

    def __init__(self, port: int, proc: subprocess.Popen[bytes], streams: int,
                 picker: bool = False) -> None:
        self.port, self.proc, self.streams = port, proc, streams
        body = prompts(1)[0]
        if picker:
            self.long, self.long_replies = picker_stream(body, len(STREAM))
            self.short, self.short_replies = picker_stream(body, 1)
        else:
            self.long, self.short = stream_messages(body, len(STREAM)), stream_messages(body, 1)
            self.long_replies, self.short_replies = [1] * len(self.long), [1] * len(self.short)
        self.conc = 1
        self.chunk: list[float] = []
        self.message: list[float] = []

    def reset(self, conc: int) -> None:
        """New rounds at this concurrency (after a warm-up)."""
        self.conc, self.chunk, self.message = conc, [], []
        asyncio.run(floor_load(self.port, 50, conc, self.long, self.long_replies))

    def _cpu(self, messages: list[Any], replies: list[int]) -> float:
        c0 = cpu_seconds(self.proc.pid)
        asyncio.run(floor_load(self.port, self.streams, self.conc, messages, replies))
        return cpu_seconds(self.proc.pid) - c0

    def round(self) -> None:
        long = self._cpu(self.long, self.long_replies)
        short = self._cpu(self.short, self.short_replies)
        extra = len(self.long) - len(self.short)
        self.chunk.append((long - short) / extra / self.streams * 1000)
        self.message.append(long / len(self.long) / self.streams * 1000)

    def medians(self) -> tuple[float, float]:
        return statistics.median(self.chunk), statistics.median(self.message)


def per_request(args: argparse.Namespace,
                start: Callable[[list[str], Path], subprocess.Popen[bytes]],
                work: Path) -> None:
    """`--floor`: CPU per JSON request of each server kind, by messages per stream."""
    messages = floor_messages(prompts(1)[0])
    servers = {kind: start_echo(start, work, kind) for kind in FLOOR_KINDS}
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
