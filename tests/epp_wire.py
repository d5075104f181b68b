"""An ext_proc stream as a data plane drives it, for the picker's tests over real gRPC
(tests/test_epp_modes.py): `Wire` sends messages and reads the answers; the builders make
each message as Envoy sends it (headers, body chunks, trailers, the response's phases) and
read the answers' mutations; two upstream answers carrying usage (JSON and SSE)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2

from gateway.epp import decision, modes
from tests.test_epp_grpc import MODEL, Epp

FD = modes.FULL_DUPLEX_STREAMED


class Wire:
    """One ext_proc stream: messages sent as a data plane sends them, answers read."""

    def __init__(self, epp: Epp) -> None:
        self.queue: asyncio.Queue[ext.ProcessingRequest | None] = asyncio.Queue()
        self.call = epp.stub.Process(self._requests())

    async def _requests(self) -> AsyncIterator[ext.ProcessingRequest]:
        while (item := await self.queue.get()) is not None:
            yield item

    async def send(self, *reqs: ext.ProcessingRequest) -> None:
        for r in reqs:
            await self.queue.put(r)

    async def read(self, n: int = 1) -> list[ext.ProcessingResponse]:
        out = []
        for _ in range(n):
            got = await asyncio.wait_for(self.call.read(), 10)
            assert isinstance(got, ext.ProcessingResponse), f"stream ended after {out}"
            out.append(got)
        return out

    async def ended(self) -> bool:
        """The picker ended the stream (after an immediate response)."""
        return await asyncio.wait_for(self.call.read(), 10) is grpc.aio.EOF

    async def close(self) -> None:
        await self.queue.put(None)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await asyncio.wait_for(self.call.read(), 10)


def _struct(values: dict[str, object]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(values)
    return s


def headers(path: str = "/v1/chat/completions", method: str = "POST", *, end: bool = False,
            mode: tuple[int, int] | None = (FD, FD),
            without_waiting: bool = False,
            hint: list[str] | None = None, extra: Sequence[tuple[str, str]] = (),
            ) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    for k, v in ((":path", path), (":method", method), *extra):
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    req.request_headers.end_of_stream = end
    if mode is not None:
        req.protocol_config.request_body_mode = mode[0]  # type: ignore[assignment]
        req.protocol_config.response_body_mode = mode[1]  # type: ignore[assignment]
        req.protocol_config.send_body_without_waiting_for_header_response = without_waiting
    if hint is not None:
        req.metadata_context.filter_metadata[decision.SUBSET_NAMESPACE].CopyFrom(
            _struct({decision.SUBSET: hint}))
    return req


def chat(content: str) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})


def chunks(raw: bytes, n: int, *, end: bool = True) -> list[ext.ProcessingRequest]:
    size = -(-len(raw) // n)
    out = []
    for i in range(0, len(raw), size):
        req = ext.ProcessingRequest()
        req.request_body.body = raw[i:i + size]
        req.request_body.end_of_stream = end and i + size >= len(raw)
        out.append(req)
    return out


def request_trailers() -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    req.request_trailers.SetInParent()
    return req


def response_headers(status: int = 200, content_type: str = "application/json",
                     served: str | None = None, end: bool = False) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    for k, v in ((":status", str(status)), ("content-type", content_type)):
        req.response_headers.headers.headers.add(key=k, raw_value=v.encode())
    req.response_headers.end_of_stream = end
    if served is not None:  # the protocol's report of the endpoint that served it
        req.metadata_context.filter_metadata[decision.LB_NAMESPACE].CopyFrom(
            _struct({decision.SERVED: served}))
    return req


def response_body(chunk: bytes, end: bool) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    req.response_body.body = chunk
    req.response_body.end_of_stream = end
    return req


def set_headers(resp: ext.HeadersResponse | ext.BodyResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in resp.response.header_mutation.set_headers}


def lb(resp: ext.ProcessingResponse) -> str:
    return resp.dynamic_metadata.fields[decision.LB_NAMESPACE].struct_value.fields[
        decision.DESTINATION].string_value


def streamed(resps: Sequence[ext.ProcessingResponse], phase: str) -> tuple[bytes, list[bool]]:
    """The body sent back and each message's end_of_stream."""
    parts = [getattr(r, phase).response.body_mutation.streamed_response for r in resps]
    assert all(r.WhichOneof("response") == phase for r in resps)
    return b"".join(p.body for p in parts), [p.end_of_stream for p in parts]


USAGE_JSON = (b'{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}],'
              b'"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8,'
              b'"prompt_tokens_details":{"cached_tokens":5}}}')
USAGE_SSE = [b'data: {"choices":[{"index":0,"delta":{"content":"o"}}]}\n\n',
             b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1,',
             b'"prompt_tokens_details":{"cached_tokens":5}}}\n\ndata: [DONE]\n\n']
