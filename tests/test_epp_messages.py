"""The picker's answers (gateway.epp.messages), built in place for speed, against the
same answers built the plain way (nested constructors, as the protocol reads): equal
field for field and byte for byte, as a table."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from gateway.epp import decision, messages
from gateway.proxy.errors import GatewayError


def _mutation(headers: Sequence[tuple[str, str]]) -> ext.HeaderMutation:
    return ext.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in headers])


def _same(got: ext.ProcessingResponse, want: ext.ProcessingResponse) -> None:
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(
        deterministic=True)


@pytest.mark.parametrize("request_side", [True, False])
@pytest.mark.parametrize(("chunk", "end"), [
    (b"data: {}\n\n", False), (b"data: [DONE]\n\n", True), (b"", True), (b"", False),
    (bytes(range(256)) * 300, False),
])
def test_streamed(chunk: bytes, end: bool, request_side: bool) -> None:
    body = ext.BodyResponse(response=ext.CommonResponse(body_mutation=ext.BodyMutation(
        streamed_response=ext.StreamedBodyResponse(body=chunk, end_of_stream=end))))
    want = (ext.ProcessingResponse(request_body=body) if request_side
            else ext.ProcessingResponse(response_body=body))
    _same(messages.streamed(chunk, end, request=request_side), want)


@pytest.mark.parametrize("body_phase", [True, False])
@pytest.mark.parametrize(("destination", "headers"), [
    ("10.0.0.1:8000", ()),
    ("10.0.0.1:8000,10.0.0.2:8000", [("content-length", "12")]),
    ("[fd00::1]:80", [("content-length", "0"), ("x-a", "é")]),
])
def test_routed(destination: str, headers: Sequence[tuple[str, str]],
                body_phase: bool) -> None:
    common = ext.CommonResponse(header_mutation=_mutation(
        [(decision.DESTINATION, destination.split(",", 1)[0]), *headers]),
        clear_route_cache=True)
    meta = struct_pb2.Struct()
    meta.fields[decision.LB_NAMESPACE].struct_value.fields[
        decision.DESTINATION].string_value = destination
    want = (ext.ProcessingResponse(request_body=ext.BodyResponse(response=common),
                                   dynamic_metadata=meta) if body_phase
            else ext.ProcessingResponse(request_headers=ext.HeadersResponse(response=common),
                                        dynamic_metadata=meta))
    _same(messages.routed(destination, body_phase=body_phase, headers=headers), want)


@pytest.mark.parametrize(("added", "override"), [
    ([], None),  # no header to add: the mutation is still there, empty
    ([("x-request-id", "r1"), ("x-gateway-route", "prefix")], None),
    ([("x-request-id", "r1")], 3),
    ([], 0),
])
def test_response_headers(added: list[tuple[str, str]], override: int | None) -> None:
    want = ext.ProcessingResponse(response_headers=ext.HeadersResponse(
        response=ext.CommonResponse(header_mutation=_mutation(added))))
    if override is not None:
        want.mode_override.response_body_mode = override  # type: ignore[assignment]
    got = messages.response_headers(added, override)
    _same(got, want)
    assert got.WhichOneof("response") == "response_headers"
    assert got.response_headers.response.HasField("header_mutation")


def test_continues_and_immediate() -> None:
    _same(messages.request_body_continue(),
          ext.ProcessingResponse(request_body=ext.BodyResponse()))
    _same(messages.response_body_continue(),
          ext.ProcessingResponse(response_body=ext.BodyResponse()))
    assert messages.response_body_continue().WhichOneof("response") == "response_body"
    err = GatewayError(429, "shed", code="overloaded")
    _same(messages.immediate(err, [("x-request-id", "r1")]),
          ext.ProcessingResponse(immediate_response=ext.ImmediateResponse(
              status=http_status_pb2.HttpStatus(code=429),
              headers=_mutation([("content-type", "application/json"),
                                 ("x-request-id", "r1")]),
              body=err.body(), details="overloaded")))
