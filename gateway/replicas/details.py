"""The details probe: does a replica report `cached_tokens`? (monitor.py's module docstring,
"details probe"). Once a replica is up and its models known, it is sent
`POST /v1/completions` with a fixed ~40-token prompt and `max_tokens: 1`, twice (the second
hits the prefix cache: vLLM <= 0.23 leaves `prompt_tokens_details` out when nothing was
cached). If neither answer carries `cached_tokens` the replica runs without
`--enable-prompt-tokens-details` (`UsageRecorder.probe_cached_tokens`). The probe goes
straight to the replica: no router, no usage record."""

from __future__ import annotations

import logging

import orjson

from gateway.replicas.fleet import Fleet, Replica
from gateway.upstream.errors import UpstreamError
from gateway.upstream.seam import Timeouts, Upstream
from gateway.usage.extract import usage_from_body
from gateway.usage.recorder import UsageRecorder

log = logging.getLogger("gateway.replicas")

# ~40 tokens with common tokenizers (over two 16-token KV blocks, so the repeat is a hit)
DETAILS_PROBE_PROMPT = (
    "This is a start-up check from the gateway in front of this server. It sends the "
    "same short prompt twice and reads the usage of both answers to see if cached "
    "prompt tokens are reported."
)


async def probe_details(upstream: Upstream, fleet: Fleet, replica: Replica,
                        recorder: UsageRecorder, timeouts: Timeouts) -> None:
    """The details probe of `replica` through `upstream` (the client pool: it is an
    inference); no verdict when no answer carried usage, nor when the replica left the
    fleet meanwhile."""
    if not replica.models:
        log.debug("details probe skipped: models unknown", extra={"replica": replica.name})
        return
    body = orjson.dumps({"model": min(replica.models), "prompt": DETAILS_PROBE_PROMPT,
                         "max_tokens": 1, "temperature": 0})
    headers = [("content-type", "application/json"), *replica.upstream_headers]
    answered = False
    for _ in range(2):
        if not fleet.holds(replica):
            return
        try:
            resp = await upstream.send("POST", replica.url + "/v1/completions",
                                       headers, body, timeouts)
            try:
                data = await resp.read()
            except BaseException:
                resp.abort()
                raise
            resp.release()
        except UpstreamError as exc:
            log.debug("details probe failed", extra={"replica": replica.name,
                                                     "error": str(exc)})
            return
        if not fleet.holds(replica):
            return  # it left meanwhile: no verdict about a name that is gone
        usage = usage_from_body(data) if resp.status == 200 else None
        if usage is None or usage.prompt_tokens is None:
            continue
        answered = True
        if usage.cached_tokens is not None:
            recorder.probe_cached_tokens(replica.name, True)
            return
    if answered:
        recorder.probe_cached_tokens(replica.name, False)
