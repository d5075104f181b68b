"""Calls on one stored response, through `gateway serve` to three simulated replicas with the
Responses store on, `round_robin` routing (without the affinity, two calls in three would go
to a replica that never stored the response and get vLLM's 404): `GET /v1/responses/{id}`
returns the stored object every time, `POST /v1/responses/{id}/cancel` gets the creator's
own answer (vLLM's 400 for a response not running in the background), and `POST /tokenize`
/ `/detokenize` reach a replica."""

from __future__ import annotations

import httpx

from tests.servers import gateway, sim

FAST = {"GATEWAY_HEALTH_INTERVAL_S": "0.2", "GATEWAY_HEALTH_TIMEOUT_S": "0.5"}
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def test_stored_responses_follow_their_creator_and_native_endpoints_are_routed() -> None:
    with sim(3, ["--speed", "50", "--responses-store"]) as sims, gateway(
        sims, ["--policy", "round_robin"], env=FAST
    ) as url, httpx.Client(timeout=10) as client:
        created = {}
        for i in range(3):  # round robin: one on each replica
            r = client.post(url + "/v1/responses", json={
                "model": MODEL, "input": f"Say something short {i}.", "max_output_tokens": 4})
            assert r.status_code == 200, r.text
            created[r.json()["id"]] = r.headers["x-gateway-replica"]
        assert len(set(created.values())) == 3
        for _ in range(2):
            for rid, creator in created.items():
                got = client.get(f"{url}/v1/responses/{rid}")
                assert got.status_code == 200, got.text
                assert got.json()["id"] == rid and got.headers["x-gateway-replica"] == creator
                cancel = client.post(f"{url}/v1/responses/{rid}/cancel")
                assert cancel.status_code == 400, cancel.text
                assert cancel.headers["x-gateway-replica"] == creator
                assert "synchronous" in cancel.json()["error"]["message"]
        unknown = client.get(f"{url}/v1/responses/resp_unknown")
        assert unknown.status_code == 404  # the gateway does not know it: any replica says so
        tok = client.post(url + "/tokenize", json={"model": MODEL, "prompt": "hello world"})
        assert tok.status_code == 200, tok.text
        tokens = tok.json()["tokens"]
        assert tokens and tok.json()["count"] == len(tokens)
        text = client.post(url + "/detokenize", json={"model": MODEL, "tokens": tokens})
        assert text.status_code == 200 and "hello" in text.json()["prompt"]
