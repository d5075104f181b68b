"""Filling in `deploy/envoy/envoy.yaml.template`, the standalone Envoy the tests and the
benchmark run in front of `gateway epp` (pure: text in, text out)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from string import Template


def lb_endpoints(endpoints: Sequence[tuple[str, int]]) -> str:
    """The pool's endpoints as a flow-style YAML list (JSON is valid YAML)."""
    return json.dumps([{"endpoint": {"address": {"socket_address": {
        "address": host, "port_value": port}}}} for host, port in endpoints])


def render(template: str, *, listen_port: int, admin_port: int, epp_port: int,
           endpoints: Sequence[tuple[str, int]], fail_open: bool, epp_host: str = "127.0.0.1",
           response_body: bool = False, retries: int = 1) -> str:
    """The Envoy configuration: every placeholder must be given (a KeyError otherwise)."""
    return Template(template).substitute(
        listen_port=listen_port, admin_port=admin_port, epp_host=epp_host, epp_port=epp_port,
        failure_mode_allow="true" if fail_open else "false",
        endpoints=lb_endpoints(endpoints),
        response_body_mode="STREAMED" if response_body else "NONE", retries=retries)
