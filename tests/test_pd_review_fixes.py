"""The fixes of the outside review of P/D (issue 35) beyond tests/test_pd_review.py's own
cases, on loopback against the vLLM-like double (tests/pd_replica.py):

- F1: a client's `kv_transfer_params` are dropped while the body is parsed, whatever the
  fleet: with no prefill replica at all (a `both` fleet whose engines run NixlConnector),
  on every inference endpoint and on a forwarded `/v1/*` body.

Mutations seen failing here: the strip in RequestFlow.prepare removed (the fleet and
endpoint rows), the strip in Proxy._forward_other removed (the forwarded row).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.pd.config import PdConfig
from tests.test_pd_loopback import CHAT, replicas, url
from tests.test_pd_review import LEASE, VICTIM, gateway, params_sent

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", CHAT),
    "chat-stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "once upon a time " * 40}),
    "responses": ("/v1/responses", {"model": "m", "input": "tell me a story " * 40}),
    "messages": ("/v1/messages", {"model": "m", "max_tokens": 50,
                                  "messages": [{"role": "user", "content": "a story"}]}),
    "forwarded": ("/v1/embeddings", {"model": "m", "input": "embed me"}),
}


@pytest.mark.parametrize("injected", [VICTIM, LEASE], ids=["decode-shape", "prefill-shape"])
@pytest.mark.parametrize("what", list(BODIES))
async def test_a_both_fleet_never_sends_a_clients_kv_transfer_params(
        what: str, injected: dict[str, Any]) -> None:
    """No prefill replica: P/D never runs, yet a `both` replica running NixlConnector
    would still load the blocks a client names from the engine it names."""
    path, body = BODIES[what]
    async with replicas(("b1", "ok"),) as (b,), gateway(
            [("b1", url(b), "both")], PdConfig()) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(gw.url + path, json={**body, "kv_transfer_params": injected})
        assert r.status_code == 200, r.text
        assert b.received == 1
        assert params_sent(b) == [None], f"the client's params reached an engine: {b.bodies}"
        assert {k: v for k, v in b.bodies[0].items() if k != "stream_options"} == {
            k: v for k, v in body.items() if k != "stream_options"}
