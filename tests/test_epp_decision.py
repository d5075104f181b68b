"""The endpoint picker's pure parts, by tables: endpoints of replica URLs, the subset hint,
the destination with its fallbacks, the served endpoint, the ext_proc messages
built from them, and the shipped Envoy template filled in."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from google.protobuf import struct_pb2

from gateway.admission.shedding import Shed
from gateway.epp import decision, messages
from gateway.epp.envoyconf import render
from gateway.proxy.errors import GatewayError
from tests.epp_stack import TEMPLATE


@pytest.mark.parametrize(("url", "want"), [
    ("http://10.0.3.7:8000", "10.0.3.7:8000"),
    ("http://10.0.3.7:8000/", "10.0.3.7:8000"),
    ("http://10.0.3.7", "10.0.3.7:80"),
    ("https://10.0.3.7", "10.0.3.7:443"),
    ("http://[fd00::7]:8000", "[fd00::7]:8000"),
])
def test_endpoint_of(url: str, want: str) -> None:
    assert decision.endpoint_of(url) == want


@pytest.mark.parametrize(("values", "want"), [
    (None, None),
    ([], None),  # an empty hint restricts nothing
    (["10.0.0.1:8000", "10.0.0.2:8000"], {"10.0.0.1:8000", "10.0.0.2:8000"}),
    ([" 10.0.0.1:08000 "], {"10.0.0.1:8000"}),
    (["10.0.0.1", 7, None, "x" * 100, ":80", "h:p"], set()),  # nothing valid: allows none
    ([f"10.0.0.{i}:80" for i in range(2000)], None),  # cut at MAX_HINT_ENDPOINTS
])
def test_subset_hint(values: list[object] | None, want: set[str] | None) -> None:
    got = decision.subset_hint(values)
    if values is not None and len(values) > decision.MAX_HINT_ENDPOINTS:
        assert got is not None and len(got) == decision.MAX_HINT_ENDPOINTS
        return
    assert got == (frozenset(want) if want is not None else None)


EPS = {"a": "10.0.0.1:80", "b": "10.0.0.2:80", "c": "10.0.0.3:80", "d": "10.0.0.1:80"}


@pytest.mark.parametrize(("allowed", "want"), [
    (None, ["a", "b", "c"]),
    (frozenset({"10.0.0.2:80"}), ["b"]),
    (frozenset({"10.9.9.9:80"}), []),
    (frozenset(), []),
])
def test_restrict(allowed: frozenset[str] | None, want: list[str]) -> None:
    assert decision.restrict(["a", "b", "c"], EPS, allowed) == want


@pytest.mark.parametrize(("ranked", "usable", "fallbacks", "want"), [
    (("a", "b", "c"), ["a", "b", "c"], 0, "10.0.0.1:80"),
    (("a", "b", "c"), ["a", "b", "c"], 1, "10.0.0.1:80,10.0.0.2:80"),
    (("a", "b", "c"), ["a", "b", "c"], 5, "10.0.0.1:80,10.0.0.2:80,10.0.0.3:80"),
    (("a", "b", "c"), ["a", "c"], 1, "10.0.0.1:80,10.0.0.3:80"),  # b is not usable
    (("a", "d", "b"), ["a", "b", "d"], 1, "10.0.0.1:80,10.0.0.2:80"),  # no endpoint twice
])
def test_destination(ranked: tuple[str, ...], usable: list[str], fallbacks: int,
                     want: str) -> None:
    assert decision.destination(ranked, EPS, usable, fallbacks) == want


@pytest.mark.parametrize(("meta", "attrs", "want"), [
    ({}, {}, None),
    ({decision.SERVED: "10.0.0.2:80"}, {decision.UPSTREAM_ADDRESS: "10.0.0.1:80"},
     "10.0.0.2:80"),  # the protocol's metadata first
    ({}, {decision.UPSTREAM_ADDRESS: "10.0.0.1:80"}, "10.0.0.1:80"),
    ({decision.SERVED: "10.0.0.2:80,10.0.0.3:80"}, {}, "10.0.0.2:80"),
    ({decision.SERVED: ""}, {decision.UPSTREAM_ADDRESS: "x" * 100}, None),
])
def test_served_endpoint(meta: dict[str, object], attrs: dict[str, object],
                         want: str | None) -> None:
    assert decision.served_endpoint(meta, attrs) == want


@pytest.mark.parametrize(("status", "details", "want"), [
    (503, "upstream_reset_before_response_started{remote_connection_failure}", True),
    (503, "upstream_reset_before_response_started{connection_failure}", True),
    (200, "via_upstream", False),
    (503, "via_upstream", False),  # the replica itself answered 503
    (500, "ext_proc_error_gRPC_error_14", False),  # the EPP failed, not the replica
    (503, None, False),
])
def test_unreachable(status: int, details: object, want: bool) -> None:
    assert decision.unreachable(status, details) is want


def test_routed_sets_the_pick_in_the_header_and_the_list_in_metadata() -> None:
    """The header names the pick alone (an ORIGINAL_DST cluster reads one address); the
    metadata lists the fallbacks too (override_host tries them in order)."""
    for body_phase in (True, False):
        out = messages.routed("10.0.0.1:80,10.0.0.2:80", body_phase=body_phase)
        phase = out.request_body if body_phase else out.request_headers
        assert out.WhichOneof("response") == ("request_body" if body_phase
                                              else "request_headers")
        (h,) = phase.response.header_mutation.set_headers
        assert (h.header.key, h.header.raw_value) == (decision.DESTINATION, b"10.0.0.1:80")
        assert phase.response.clear_route_cache
        lb = out.dynamic_metadata.fields[decision.LB_NAMESPACE].struct_value
        assert lb.fields[decision.DESTINATION].string_value == "10.0.0.1:80,10.0.0.2:80"


@pytest.mark.parametrize(("err", "extra"), [
    (Shed("queue_full", 3), {"retry-after": b"3"}),  # the admission queue's 429
    (decision.no_ready_endpoint(True), {}),
    (GatewayError(400, "bad", code="invalid_json"), {})])
def test_immediate_answers_in_openai_shape(err: GatewayError, extra: dict[str, bytes]) -> None:
    out = messages.immediate(err, [("x-request-id", "r1")])
    im = out.immediate_response
    assert im.status.code == err.status
    assert im.body == err.body()
    got = {h.header.key: h.header.raw_value for h in im.headers.set_headers}
    assert got == {"content-type": b"application/json", "x-request-id": b"r1", **extra}


def _request_with(namespace: str, key: str, value: Any) -> ext.ProcessingRequest:
    req = ext.ProcessingRequest()
    s = struct_pb2.Struct()
    s.update({key: value})
    req.metadata_context.filter_metadata[namespace].CopyFrom(s)
    return req


@pytest.mark.parametrize(("value", "want"), [
    (["10.0.0.1:80"], ["10.0.0.1:80"]),
    ([1, "10.0.0.2:80"], [None, "10.0.0.2:80"]),
    ("10.0.0.1:80", [None]),  # not a list: allows nothing
])
def test_subset_values_from_metadata(value: Any, want: list[object]) -> None:
    req = _request_with(decision.SUBSET_NAMESPACE, decision.SUBSET, value)
    assert messages.subset_values(req) == want
    assert decision.subset_hint(messages.subset_values(req)) is not None
    assert messages.subset_values(ext.ProcessingRequest()) is None


def test_headers_prefer_raw_values_and_drop_huge_ones() -> None:
    hdrs = ext.HttpHeaders()
    hdrs.headers.headers.add(key=":path", raw_value=b"/v1/chat/completions")
    hdrs.headers.headers.add(key="x-old", value="text")
    hdrs.headers.headers.add(key="x-big", raw_value=b"x" * 10_000)
    assert messages.headers_of(hdrs) == {":path": "/v1/chat/completions", "x-old": "text"}


@pytest.mark.parametrize("fail_open", [True, False])
def test_envoy_template_renders_to_a_valid_configuration(fail_open: bool) -> None:
    text = render(TEMPLATE.read_text(), listen_port=1001, admin_port=1002, epp_port=1003,
                  endpoints=[("127.0.0.1", 2001), ("127.0.0.1", 2002)], fail_open=fail_open)
    doc = yaml.safe_load(text)
    listener = doc["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 1001
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = [f["name"] for f in hcm["http_filters"]]
    # the client's destination headers are dropped before the EPP runs
    assert filters == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc",
                       "envoy.filters.http.router"]
    proc = hcm["http_filters"][1]["typed_config"]
    assert proc["failure_mode_allow"] is fail_open
    assert proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    pool = doc["static_resources"]["clusters"][0]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [2001, 2002]


@pytest.mark.parametrize(("url", "want"), [
    ("http://10.0.0.7:8000", {"10.0.0.7:8000"}),  # an address stays as it is
    ("http://[fd00::7]:8000", {"[fd00::7]:8000"}),
    ("http://localhost:8000", {"127.0.0.1:8000", "[::1]:8000"}),  # a name is resolved
])
async def test_replica_hosts_are_resolved_to_addresses(url: str, want: set[str]) -> None:
    from gateway.epp.run import resolve_endpoints

    assert (await resolve_endpoints({"r": url}))["r"] in want


@pytest.mark.parametrize(("value", "hint", "want"), [
    (None, None, None),
    (None, frozenset({"a:1"}), frozenset({"a:1"})),
    ("10.0.0.1:80", None, frozenset({"10.0.0.1:80"})),
    ("10.0.0.1:80, 10.0.0.2:80", frozenset({"10.0.0.2:80"}), frozenset({"10.0.0.2:80"})),
    ("", None, frozenset()),  # names nothing: allows nothing (503), not everything
    ("garbage", None, frozenset()),
])
def test_conformance_selection(value: str | None, hint: frozenset[str] | None,
                               want: frozenset[str] | None) -> None:
    assert decision.test_selection(value, hint) == want
