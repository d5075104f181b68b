"""The EPP over real gRPC on loopback, driven message by message as a data plane would
(grpc.aio client), in front of real simulated replicas: the subset hint restricts the
pick (an impossible one is a 503), a body-less call is routed at its headers, the served
endpoint moves a retried request, and gRPC health says SERVING (admission through the
picker: tests/test_flow_epp_admission.py). Replica counts: the EPP sends nothing to replicas itself,
so every check here is on what it names and records."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.admission.config import AdmissionConfig
from gateway.epp import decision
from gateway.epp.picker import Picker
from gateway.epp.server import SERVICE_NAME, EppServer
from gateway.proxy.app import GatewayApp
from gateway.settings import AuthSettings, EppSettings, parse_settings
from gateway.usage.record import UsageRecord
from tests.servers import sim

MODEL = "Qwen/Qwen2.5-7B-Instruct"


@pytest.fixture(scope="module")
def urls() -> Iterator[list[str]]:
    with sim(2, ["--speed", "1000"]) as found:
        yield found


@dataclasses.dataclass
class Epp:
    stub: ext_grpc.ExternalProcessorStub
    channel: grpc.aio.Channel
    app: GatewayApp
    records: list[UsageRecord]
    endpoints: list[str]
    picker: Picker


@contextlib.asynccontextmanager
async def running_epp(urls: list[str], admission: AdmissionConfig | None = None,
                      auth: AuthSettings | None = None, **epp: object) -> AsyncIterator[Epp]:
    settings = parse_settings(None, {}, backends=urls)
    settings = dataclasses.replace(
        settings, epp=EppSettings(port=0, **epp),  # type: ignore[arg-type]
        usage=dataclasses.replace(settings.usage, startup_probe=False),
        admission=admission or settings.admission, auth=auth or settings.auth)
    app = GatewayApp(settings)
    async with app.running():
        services = app.services
        assert services is not None
        records: list[UsageRecord] = []
        original = services.recorder.record

        def keep(rec: UsageRecord, departed: bool = False) -> None:
            records.append(rec)
            original(rec, departed)

        services.recorder.record = keep  # type: ignore[method-assign]
        picker = Picker(services, settings.epp, time.perf_counter)
        server = EppServer(picker, "127.0.0.1", 0, 64)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                yield Epp(ext_grpc.ExternalProcessorStub(channel), channel, app, records,
                          [decision.endpoint_of(u) for u in urls], picker)
        finally:
            await server.stop(0)


def headers(path: str, method: str = "POST", end: bool = False,
            hint: list[str] | None = None) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    for k, v in ((":path", path), (":method", method), ("x-request-id", "req-1")):
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    req.request_headers.end_of_stream = end
    if hint is not None:
        s = struct_pb2.Struct()
        s.update({decision.SUBSET: hint})
        req.metadata_context.filter_metadata[decision.SUBSET_NAMESPACE].CopyFrom(s)
    return req


def body(content: str, hint: list[str] | None = None) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    req.request_body.body = orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}]})
    req.request_body.end_of_stream = True
    if hint is not None:
        s = struct_pb2.Struct()
        s.update({decision.SUBSET: hint})
        req.metadata_context.filter_metadata[decision.SUBSET_NAMESPACE].CopyFrom(s)
    return req


def response_headers(status: int, served: str | None = None,
                     content_type: str = "application/json") -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    for k, v in ((":status", str(status)), ("content-type", content_type)):
        req.response_headers.headers.headers.add(key=k, raw_value=v.encode())
    if served is not None:
        s = struct_pb2.Struct()
        s.update({decision.UPSTREAM_ADDRESS: served})
        req.attributes["envoy.filters.http.ext_proc"].CopyFrom(s)
    return req


def destination(resp: ext.ProcessingResponse) -> str:
    phase = resp.request_body if resp.HasField("request_body") else resp.request_headers
    (h,) = phase.response.header_mutation.set_headers
    assert h.header.key == decision.DESTINATION
    return h.header.raw_value.decode()


class Stream:
    """One ext_proc stream, one message at a time."""

    def __init__(self, epp: Epp) -> None:
        self.queue: asyncio.Queue[ext.ProcessingRequest | None] = asyncio.Queue()
        self.call = epp.stub.Process(self._requests())

    async def _requests(self) -> AsyncIterator[ext.ProcessingRequest]:
        while (item := await self.queue.get()) is not None:
            yield item

    async def ask(self, req: ext.ProcessingRequest) -> ext.ProcessingResponse:
        await self.queue.put(req)
        return await asyncio.wait_for(self.call.read(), 10)

    async def close(self) -> None:
        await self.queue.put(None)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await asyncio.wait_for(self.call.read(), 10)


async def test_health_is_serving(urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        stub = health_pb2_grpc.HealthStub(epp.channel)
        for name in ("", SERVICE_NAME):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_subset_hint_restricts_the_pick(urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        for only in epp.endpoints:
            for i in range(3):
                s = Stream(epp)
                await s.ask(headers("/v1/chat/completions", hint=[only]))
                picked = destination(await s.ask(body(f"prompt {i}", hint=[only])))
                assert picked == only  # no fallback outside the subset either
                await s.close()
        s = Stream(epp)
        await s.ask(headers("/v1/chat/completions"))
        answer = await s.ask(body("x", hint=["10.9.9.9:80"]))
        assert answer.immediate_response.status.code == 503
        assert b"no_healthy_replica" in answer.immediate_response.body
        await s.close()
    assert [r.status for r in epp.records][-1] == 503
    assert [r.replica for r in epp.records[:3]] == [epp.records[0].replica] * 3


async def test_a_call_without_body_is_routed_at_its_headers(urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        s = Stream(epp)
        picked = destination(await s.ask(headers("/v1/models", method="GET", end=True)))
        assert picked.split(",")[0] in epp.endpoints
        await s.close()
    assert epp.records[-1].route == "forward"


async def test_the_served_endpoint_moves_a_retried_request(urls: list[str]) -> None:
    async with running_epp(urls) as epp:
        s = Stream(epp)
        await s.ask(headers("/v1/chat/completions"))
        picked = await s.ask(body("retried"))
        first, fallback = picked.dynamic_metadata.fields[decision.LB_NAMESPACE].struct_value \
            .fields[decision.DESTINATION].string_value.split(",")
        assert destination(picked) == first
        answer = await s.ask(response_headers(200, served=fallback))
        added = {h.header.key: h.header.raw_value.decode()
                 for h in answer.response_headers.response.header_mutation.set_headers}
        by_endpoint = dict(zip(epp.endpoints, urls, strict=True))
        assert added["x-gateway-replica"] == by_endpoint[fallback].split("//")[1]
        await s.close()
        assert epp.app.services is not None
        fleet = epp.app.services.fleet.replicas
        # the pick Envoy says it could not reach is probed now; only probes mark a replica
        # down, and both of these answer them (busy is not down)
        assert first in epp.endpoints
        assert all(r.healthy for r in fleet.values())
    assert epp.records[-1].replica == added["x-gateway-replica"]


BUFFERED, STREAMED, NONE = 3, 1, 0  # ProcessingMode.BodySendMode: BUFFERED_PARTIAL, ...


@pytest.mark.parametrize(("mode", "content_type", "status", "want"), [
    ("json", "application/json", 200, BUFFERED),
    ("json", "text/event-stream", 200, None),  # a stream's chunks are not read
    ("json", "application/json", 500, None),
    ("body", "text/event-stream", 200, STREAMED),
    ("body", "application/json", 200, BUFFERED),
    ("headers", "application/json", 200, None),
])
async def test_what_of_the_response_is_read(urls: list[str], mode: str, content_type: str,
                                            status: int, want: int | None) -> None:
    async with running_epp(urls, response=mode) as epp:
        s = Stream(epp)
        await s.ask(headers("/v1/chat/completions"))
        await s.ask(body("which body"))
        answer = await s.ask(response_headers(status, content_type=content_type))
        if want is None:
            assert not answer.HasField("mode_override")
        else:
            assert answer.mode_override.response_body_mode == want
            chunk = ext.ProcessingRequest()
            chunk.response_body.body = (b'{"usage": {"prompt_tokens": 7, "completion_tokens": 1,'
                                        b' "prompt_tokens_details": {"cached_tokens": 5}}}'
                                        if want == BUFFERED else
                                        b'data: {"choices":[],"usage":{"prompt_tokens":7,'
                                        b'"completion_tokens":1,"prompt_tokens_details":'
                                        b'{"cached_tokens":5}}}\n\ndata: [DONE]\n\n')
            chunk.response_body.end_of_stream = True
            await s.ask(chunk)
        await s.close()
    (rec,) = epp.records
    assert (rec.prompt_tokens, rec.cached_tokens) == ((7, 5) if want else (None, None))


async def test_a_json_answer_over_envoys_buffer_is_recorded_once(urls: list[str]) -> None:
    """BUFFERED_PARTIAL: the first part only (no usage in it); the record ends there."""
    async with running_epp(urls) as epp:
        s = Stream(epp)
        await s.ask(headers("/v1/chat/completions"))
        await s.ask(body("a long answer"))
        await s.ask(response_headers(200))
        part = ext.ProcessingRequest()
        part.response_body.body = b'{"id": "x", "choices": [{"text": "' + b"y" * 1000
        part.response_body.end_of_stream = False
        await s.ask(part)
        assert len(epp.records) == 1
        await s.close()
        assert epp.app.services is not None
        assert not any(r.in_flight for r in epp.app.services.fleet.replicas.values())
    (rec,) = epp.records
    assert (rec.status, rec.prompt_tokens) == (200, None)
