"""The ext_proc wire shapes the picker reads and answers (`envoy.service.ext_proc.v3`):
request headers and metadata in, header mutations, dynamic metadata, mode overrides and
immediate responses out. Pure: protobuf values in, protobuf values out.

The answers are built in place (`out.response_body.response...` set on one new message)
rather than from nested constructors: upb copies a submessage given to a constructor, so
a nested build copies a streamed chunk once per level (four), and costs 2-3x the time;
bytes fields are read once each (every read is a copy). bench/RESULTS.md, issue 34."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2

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
        raw = h.raw_value
        value = raw.decode("latin-1") if raw else h.value
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


_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set(mutation: ext.HeaderMutation, headers: Sequence[tuple[str, str]]) -> None:
    """Fill `mutation` with `headers`, each set (overwriting or added); the mutation is
    present even when empty."""
    mutation.SetInParent()
    add = mutation.set_headers.add
    for k, v in headers:
        option = add(append_action=_OVERWRITE)
        option.header.key = k
        option.header.raw_value = v.encode("latin-1")


def routed(destination: str, *, body_phase: bool,
           headers: Sequence[tuple[str, str]] = (), body: bytes | None = None,
           remove: Sequence[str] = ()) -> ext.ProcessingResponse:
    """The pick: the destination header (the pick alone: an ORIGINAL_DST cluster reads it
    as one address) and `headers` (e.g. `Content-Length`); the pick and its fallbacks,
    `ip:port,ip:port...`, as `envoy.lb` metadata (where `override_host` reads them first);
    and `clear_route_cache` (a route chosen on the header is chosen again with it).
    `body` (a buffered body response only): the request body to forward instead.
    `remove`: request headers taken out (a client's trace context, gateway.tracing)."""
    out = ext.ProcessingResponse()
    common = (out.request_body if body_phase else out.request_headers).response
    _set(common.header_mutation,
         [(decision.DESTINATION, destination.split(",", 1)[0]), *headers])
    common.header_mutation.remove_headers.extend(remove)
    common.clear_route_cache = True
    if body is not None:
        common.body_mutation.body = body
    out.dynamic_metadata.fields[decision.LB_NAMESPACE].struct_value.fields[
        decision.DESTINATION].string_value = destination
    return out


# A body sent back in full duplex is cut into messages of at most this many bytes (the
# reference picker's size: well under gRPC's and Envoy's default message limits).
BODY_PIECE = 62_000


def streamed(chunk: bytes, end: bool, *, request: bool) -> ext.ProcessingResponse:
    """A body chunk sent back (full duplex: Envoy forwards what the processor sends);
    once per chunk of every answer, hence built in place."""
    out = ext.ProcessingResponse()
    piece = (out.request_body if request else out.response_body
             ).response.body_mutation.streamed_response
    piece.body = chunk
    if end:
        piece.end_of_stream = True
    return out


def streamed_body(body: bytes, end: bool) -> list[ext.ProcessingResponse]:
    """The whole request body back, in BODY_PIECE pieces; `end` on the last."""
    pieces = [body[i:i + BODY_PIECE] for i in range(0, len(body), BODY_PIECE)] or [b""]
    return [streamed(p, end and i == len(pieces) - 1, request=True)
            for i, p in enumerate(pieces)]


def request_body_continue() -> ext.ProcessingResponse:
    out = ext.ProcessingResponse()
    out.request_body.SetInParent()
    return out


def request_body_replaced(body: bytes | None) -> ext.ProcessingResponse:
    """A STREAMED chunk's answer when the picker changed the body: the first chunk
    becomes the whole new body (`body`), each later one is cleared (None)."""
    out = ext.ProcessingResponse()
    mutation = out.request_body.response.body_mutation
    if body is not None:
        mutation.body = body
    else:
        mutation.clear_body = True
    return out


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
    out = ext.ProcessingResponse()
    _set(out.response_headers.response.header_mutation, added)
    if override is not None:
        out.mode_override.response_body_mode = override
    return out


def response_body_continue() -> ext.ProcessingResponse:
    """Once per chunk of an answer read in STREAMED mode."""
    out = ext.ProcessingResponse()
    out.response_body.SetInParent()
    return out


def immediate(err: GatewayError, headers: Sequence[tuple[str, str]]) -> ext.ProcessingResponse:
    """An answer from the EPP itself: 503 no ready endpoint, 429 shed (with its
    `Retry-After`), 400 bad body..."""
    extra = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in err.headers()]
    out = ext.ProcessingResponse(immediate_response=ext.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status), body=err.body(),
        details=err.code[:64]))
    _set(out.immediate_response.headers,
         [("content-type", "application/json"), *headers, *extra])
    return out
