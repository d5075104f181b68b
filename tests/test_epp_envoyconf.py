"""deploy/envoy/envoy-full-duplex.yaml.template rendered in each processing mode a gateway
may generate (gateway.epp.envoyconf.render), as a table: the default is llm-d's shape."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.epp.envoyconf import render
from tests.epp_stack import FULL_DUPLEX, TEMPLATE

FD = "FULL_DUPLEX_STREAMED"


def _ext_proc(text: str) -> dict[str, Any]:
    doc = yaml.safe_load(text)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (proc,) = [f["typed_config"] for f in hcm["typed_config"]["http_filters"]
               if f["name"] == "envoy.filters.http.ext_proc"]
    return dict(proc)


def _rendered(template: str, **kw: Any) -> dict[str, Any]:
    return _ext_proc(render(template, listen_port=1001, admin_port=1002, epp_port=1003,
                            endpoints=[("127.0.0.1", 2001)], fail_open=False, **kw))


@pytest.mark.parametrize(("kw", "request_mode", "response_mode", "trailers", "waiting"), [
    ({}, FD, FD, "SEND", False),  # llm-d's shape, as shipped
    ({"body_modes": ("STREAMED", "STREAMED"), "trailers": False, "without_waiting": True},
     "STREAMED", "STREAMED", "SKIP", True),
    ({"body_modes": ("BUFFERED_PARTIAL", "BUFFERED_PARTIAL"), "trailers": False},
     "BUFFERED_PARTIAL", "BUFFERED_PARTIAL", "SKIP", False),
    ({"body_modes": ("BUFFERED", "NONE")}, "BUFFERED", "NONE", "SEND", False),
])
def test_full_duplex_template_in_each_mode(kw: dict[str, Any], request_mode: str,
                                           response_mode: str, trailers: str,
                                           waiting: bool) -> None:
    proc = _rendered(FULL_DUPLEX.read_text(), **kw)
    mode = proc["processing_mode"]
    assert (mode["request_body_mode"], mode["response_body_mode"]) == (
        request_mode, response_mode)
    assert mode["request_trailer_mode"] == mode["response_trailer_mode"] == trailers
    assert proc["send_body_without_waiting_for_header_response"] is waiting
    assert "allow_mode_override" not in proc  # a generated configuration forbids it


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="FULL_DUPLEX"):
        _rendered(FULL_DUPLEX.read_text(), body_modes=("FULL_DUPLEX", FD))


def test_the_project_file_ignores_the_body_modes() -> None:
    mode = _rendered(TEMPLATE.read_text(), body_modes=("STREAMED", "STREAMED"),
                     response_body=True)["processing_mode"]
    assert (mode["request_body_mode"], mode["response_body_mode"]) == ("BUFFERED", "STREAMED")
