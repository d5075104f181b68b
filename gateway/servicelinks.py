"""Recognize the environment variables Kubernetes injects for Services (pure).

For every Service in a pod's namespace, the kubelet sets (unless the pod says
`enableServiceLinks: false`) Docker-link style variables named after the Service, upper
case, dashes as underscores. A Service `gateway` on port 8080 gives:

    GATEWAY_SERVICE_HOST=10.0.0.11          GATEWAY_PORT=tcp://10.0.0.11:8080
    GATEWAY_SERVICE_PORT=8080               GATEWAY_PORT_8080_TCP=tcp://10.0.0.11:8080
    GATEWAY_SERVICE_PORT_HTTP=8080          GATEWAY_PORT_8080_TCP_PROTO=tcp
                                            GATEWAY_PORT_8080_TCP_PORT=8080
                                            GATEWAY_PORT_8080_TCP_ADDR=10.0.0.11

and a Service `gateway-redis` the same with `GATEWAY_REDIS_` in front. They share the
gateway's `GATEWAY_` configuration prefix by accident; `GATEWAY_PORT` even names a real
setting (`server.port`), so it is told apart by its value, a `proto://host:port` URL.
"""

from __future__ import annotations

import re

_SERVICE = r"(?:[A-Z0-9]+(?:_[A-Z0-9]+)*_)?"  # the service name's tail after GATEWAY_, if any
_PROTO = r"(?:TCP|UDP|SCTP)"

# names that are service links whatever their value
_BY_NAME = re.compile(
    rf"^GATEWAY_{_SERVICE}(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
    rf"|PORT_[0-9]+_{_PROTO}(?:_PROTO|_PORT|_ADDR)?)$"
)
# `<SERVICE>_PORT`: a service link only when it holds a link URL (GATEWAY_PORT=9000 is config)
_PORT_NAME = re.compile(rf"^GATEWAY_{_SERVICE}PORT$")
_LINK_URL = re.compile(r"^(?:tcp|udp|sctp)://[^\s/]+:[0-9]+$")


def is_service_link(name: str, value: str) -> bool:
    """True for a variable Kubernetes injected for a Service (`name` as set, upper case)."""
    if _BY_NAME.match(name):
        return True
    return bool(_PORT_NAME.match(name) and _LINK_URL.match(value.strip()))
