"""Filling in `deploy/envoy/envoy.yaml.template` and `envoy-full-duplex.yaml.template`, the
standalone Envoys the tests and the benchmark run in front of `gateway epp` (pure: text
in, text out)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from string import Template

from gateway.epp.modes import NAMES

FULL_DUPLEX = "FULL_DUPLEX_STREAMED"
BODY_MODES = frozenset(NAMES.values())  # ProcessingMode.BodySendMode's names


def lb_endpoints(endpoints: Sequence[tuple[str, int]]) -> str:
    """The pool's endpoints as a flow-style YAML list (JSON is valid YAML)."""
    return json.dumps([{"endpoint": {"address": {"socket_address": {
        "address": host, "port_value": port}}}} for host, port in endpoints])


def render(template: str, *, listen_port: int, admin_port: int, epp_port: int,
           endpoints: Sequence[tuple[str, int]], fail_open: bool, epp_host: str = "127.0.0.1",
           response_body: bool = False, retries: int = 1,
           body_modes: tuple[str, str] = (FULL_DUPLEX, FULL_DUPLEX), trailers: bool = True,
           without_waiting: bool = False) -> str:
    """The Envoy configuration: every placeholder must be given (a KeyError otherwise).
    `response_body` is the project file's (`envoy.yaml.template`: the picker asks for the
    body by mode override); `body_modes` (request, response), `trailers` and
    `without_waiting` are the full-duplex file's, which a gateway generating its own
    ext_proc configuration may set otherwise (the default: llm-d's)."""
    for mode in body_modes:
        if mode not in BODY_MODES:
            raise ValueError(f"not an ext_proc body mode: {mode!r}")
    return Template(template).substitute(
        listen_port=listen_port, admin_port=admin_port, epp_host=epp_host, epp_port=epp_port,
        failure_mode_allow="true" if fail_open else "false",
        endpoints=lb_endpoints(endpoints),
        response_body_mode="STREAMED" if response_body else "NONE", retries=retries,
        request_body=body_modes[0], response_body=body_modes[1],
        trailer_mode="SEND" if trailers else "SKIP",
        without_waiting="true" if without_waiting else "false")
