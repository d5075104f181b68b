"""What a failed try on one replica allows: one table, pure (Envoy's retry policy and outlier
detection are the model: failure classes named once, each with what it allows).

    what happened                          retry elsewhere  suspect replica  client sees
    not delivered (refused, DNS, connect   yes              yes              502 if none left
      timeout)
    pool busy (no free connection within   no               no               503 + Retry-After
      the pool wait)
    delivered, no answer in time           no               no               504
    delivered, connection broke / garbage  no               no               502
    answered 4xx                           no               no               relayed as is
    answered 5xx                           no               no               relayed as is

Only what provably never reached the replica moves to another one: a request reaches each
engine at most once. "Suspect" asks the monitor to probe that replica now; health itself
comes from probes alone (gateway.replicas.fleet), so no single client-side failure marks a
replica down, and a full pool, the gateway's own congestion, never counts against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.upstream.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolBusy,
    UpstreamTimeout,
)

Happened = Literal["not_delivered", "pool_busy", "timeout", "broken", "client_error",
                   "server_error"]


@dataclass(frozen=True, slots=True)
class Verdict:
    retry: bool  # try the next ranked healthy replica: nothing reached this one
    suspect: bool  # probe this replica now (its health is still the probes' call)
    relay: bool  # the replica answered: relay its status and body as is


_TABLE: dict[Happened, Verdict] = {
    "not_delivered": Verdict(retry=True, suspect=True, relay=False),
    "pool_busy": Verdict(retry=False, suspect=False, relay=False),
    "timeout": Verdict(retry=False, suspect=False, relay=False),
    "broken": Verdict(retry=False, suspect=False, relay=False),
    "client_error": Verdict(retry=False, suspect=False, relay=True),
    "server_error": Verdict(retry=False, suspect=False, relay=True),
}


def verdict(happened: Happened) -> Verdict:
    return _TABLE[happened]


def happened(exc: UpstreamError) -> Happened:
    """The failure class of a transport error."""
    if isinstance(exc, UpstreamConnectError):
        return "not_delivered"
    if isinstance(exc, UpstreamPoolBusy):
        return "pool_busy"
    if isinstance(exc, UpstreamTimeout):
        return "timeout"
    return "broken"


def answered(status: int) -> Happened | None:
    """The failure class of an answer's status, None for a success."""
    if status >= 500:
        return "server_error"
    if status >= 400:
        return "client_error"
    return None


def client_error(exc: UpstreamError, replica: str | None, retry_after_s: int = 1
                 ) -> GatewayError:
    """What the client is told when `exc` ends the request (502, 503 or 504). `replica`
    None: the client may not learn which replica was tried (proxy/tenancy.py `withheld`),
    so neither its name nor the library's text (which names its address) is given."""
    named = f"replica {replica}" if replica is not None else "the replica"
    subject = named[0].upper() + named[1:]  # at the start of a sentence
    detail = f": {exc}" if replica is not None else ""
    if isinstance(exc, UpstreamPoolBusy):
        return GatewayError(
            503, f"The gateway has no free connection to {named}: too many "
            "requests in flight. Retry later.", code="upstream_pool_busy",
            retry_after=retry_after_s)
    if isinstance(exc, UpstreamTimeout):
        return GatewayError(
            504, f"{subject} did not answer in time.", code="upstream_timeout")
    if isinstance(exc, UpstreamConnectError):
        return GatewayError(
            502, f"Could not connect to {named}{detail}", code="upstream_connect_error")
    return GatewayError(502, f"{subject} failed{detail}", code="upstream_protocol_error")
