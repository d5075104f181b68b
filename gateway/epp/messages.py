"""The ext_proc wire shapes the picker reads and answers (`envoy.service.ext_proc.v3`):
request headers and metadata in, header mutations, dynamic metadata, mode overrides and
immediate responses out. Pure: protobuf values in, protobuf values out."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from gateway.epp import decision
from gateway.proxy.errors import GatewayError

# The namespace Envoy files ext_proc attributes under.
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
MAX_HEADER_CHARS = 8192

CONTINUE = ext.ProcessingResponse  # alias for readability at call sites


def headers_of(message: ext.HttpHeaders) -> dict[str, str]:
    """Header name -> value (lower-case names, Envoy sends them so; the last of repeated
    names wins; values over MAX_HEADER_CHARS are dropped)."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        value = h.raw_value.decode("latin-1") if h.raw_value else h.value
        if len(value) <= MAX_HEADER_CHARS:
            out[h.key] = value
    return out


def subset_values(request: ext.ProcessingRequest) -> list[object] | None:
    """The subset hint's raw list (`envoy.lb.subset_hint`), None when absent."""
    meta = request.metadata_context.filter_metadata
    if decision.SUBSET_NAMESPACE not in meta:
        return None
    fields = meta[decision.SUBSET_NAMESPACE].fields
    if decision.SUBSET not in fields:
        return None
    value = fields[decision.SUBSET]
    if value.WhichOneof("kind") != "list_value":
        return [None]  # a hint that cannot be read allows nothing (not everything)
    return [v.string_value if v.WhichOneof("kind") == "string_value" else None
            for v in value.list_value.values[: decision.MAX_HINT_ENDPOINTS]]


def served_values(request: ext.ProcessingRequest) -> tuple[dict[str, object], dict[str, object]]:
    """(the `envoy.lb` metadata, the ext_proc attributes) that may name the served
    endpoint and why Envoy answered, as plain strings."""
    meta: dict[str, object] = {}
    lb = request.metadata_context.filter_metadata
    if decision.LB_NAMESPACE in lb:
        fields = lb[decision.LB_NAMESPACE].fields
        if decision.SERVED in fields:
            meta[decision.SERVED] = fields[decision.SERVED].string_value
    attrs: dict[str, object] = {}
    if ATTRIBUTES_NAMESPACE in request.attributes:
        fields = request.attributes[ATTRIBUTES_NAMESPACE].fields
        for key in (decision.UPSTREAM_ADDRESS, decision.CODE_DETAILS):
            if key in fields:
                attrs[key] = fields[key].string_value[: decision.MAX_ENDPOINT_CHARS * 4]
    return meta, attrs


def _set(headers: Sequence[tuple[str, str]]) -> ext.HeaderMutation:
    return ext.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in headers])


def routed(destination: str, *, body_phase: bool,
           headers: Sequence[tuple[str, str]] = (), body: bytes | None = None,
           ) -> ext.ProcessingResponse:
    """The pick: the destination header (the pick alone: an ORIGINAL_DST cluster reads it
    as one address) and `headers` (e.g. `Content-Length`); the pick and its fallbacks,
    `ip:port,ip:port...`, as `envoy.lb` metadata (where `override_host` reads them first);
    and `clear_route_cache` (a route chosen on the header is chosen again with it).
    `body` (a buffered body response only): the request body to forward instead."""
    common = ext.CommonResponse(
        header_mutation=_set([(decision.DESTINATION, destination.split(",", 1)[0]),
                              *headers]),
        clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    meta = struct_pb2.Struct()
    meta.fields[decision.LB_NAMESPACE].struct_value.fields[
        decision.DESTINATION].string_value = destination
    if body_phase:
        return ext.ProcessingResponse(request_body=ext.BodyResponse(response=common),
                                      dynamic_metadata=meta)
    return ext.ProcessingResponse(request_headers=ext.HeadersResponse(response=common),
                                  dynamic_metadata=meta)


# A body sent back in full duplex is cut into messages of at most this many bytes (the
# reference picker's size: well under gRPC's and Envoy's default message limits).
BODY_PIECE = 62_000


def streamed(chunk: bytes, end: bool, *, request: bool) -> ext.ProcessingResponse:
    """A body chunk sent back (full duplex: Envoy forwards what the processor sends)."""
    body = ext.BodyResponse(response=ext.CommonResponse(body_mutation=ext.BodyMutation(
        streamed_response=ext.StreamedBodyResponse(body=chunk, end_of_stream=end))))
    if request:
        return ext.ProcessingResponse(request_body=body)
    return ext.ProcessingResponse(response_body=body)


def streamed_body(body: bytes, end: bool) -> list[ext.ProcessingResponse]:
    """The whole request body back, in BODY_PIECE pieces; `end` on the last."""
    pieces = [body[i:i + BODY_PIECE] for i in range(0, len(body), BODY_PIECE)] or [b""]
    return [streamed(p, end and i == len(pieces) - 1, request=True)
            for i, p in enumerate(pieces)]


def request_body_continue() -> ext.ProcessingResponse:
    return ext.ProcessingResponse(request_body=ext.BodyResponse())


def request_body_replaced(body: bytes | None) -> ext.ProcessingResponse:
    """A STREAMED chunk's answer when the picker changed the body: the first chunk
    becomes the whole new body (`body`), each later one is cleared (None)."""
    mutation = (ext.BodyMutation(body=body) if body is not None
                else ext.BodyMutation(clear_body=True))
    return ext.ProcessingResponse(request_body=ext.BodyResponse(
        response=ext.CommonResponse(body_mutation=mutation)))


def trailers(request: bool) -> ext.ProcessingResponse:
    if request:
        return ext.ProcessingResponse(request_trailers=ext.TrailersResponse())
    return ext.ProcessingResponse(response_trailers=ext.TrailersResponse())


def request_headers_continue() -> ext.ProcessingResponse:
    return ext.ProcessingResponse(request_headers=ext.HeadersResponse())


def response_headers(added: Sequence[tuple[str, str]], override: int | None,
                     ) -> ext.ProcessingResponse:
    """The gateway's headers on the answer, and the response body mode asked for
    (`gateway.epp.modes.response_override`; None: none)."""
    out = ext.ProcessingResponse(response_headers=ext.HeadersResponse(
        response=ext.CommonResponse(header_mutation=_set(added))))
    if override is not None:
        out.mode_override.response_body_mode = override
    return out


def response_body_continue() -> ext.ProcessingResponse:
    return ext.ProcessingResponse(response_body=ext.BodyResponse())


def immediate(err: GatewayError, headers: Sequence[tuple[str, str]]) -> ext.ProcessingResponse:
    """An answer from the EPP itself: 503 no ready endpoint, 429 shed (with its
    `Retry-After`), 400 bad body..."""
    extra = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in err.headers()]
    return ext.ProcessingResponse(immediate_response=ext.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status),
        headers=_set([("content-type", "application/json"), *headers, *extra]),
        body=err.body(), details=err.code[:64]))
