"""Responses and Messages APIs end to end: the official `openai` and `anthropic` clients
through a real gateway in front of `gateway sim` replicas on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from tests.servers import free_port, running, script, sim

MODEL = "Qwen/Qwen2.5-7B-Instruct"
FAST = {"GATEWAY_HEALTH_INTERVAL_S": "0.2", "GATEWAY_HEALTH_TIMEOUT_S": "0.5"}
# Long enough that whole 16-token blocks are cached on a repeat.
INSTRUCTIONS = "You are a careful build engineer. " + " ".join(
    f"Rule {i}: keep the build reproducible and the logs short." for i in range(40))


@pytest.fixture(scope="module")
def sims() -> Iterator[list[str]]:
    with sim(3, ["--speed", "50", "--responses-store"]) as urls:
        yield urls


def _gateway(backends: list[str], log: Path, policy: str) -> Any:
    port = free_port()
    argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy]
    for b in backends:
        argv += ["--backend", b]
    url = f"http://127.0.0.1:{port}"
    return url, running(argv, [url + "/ready"],
                        env={**FAST, "GATEWAY_USAGE__LOG_PATH": str(log)})


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def gw(sims: list[str], logs: Path) -> Iterator[str]:
    url, ctx = _gateway(sims, logs / "prefix.jsonl", "prefix")
    with ctx:
        yield url


@pytest.fixture(scope="module")
def gw_rr(sims: list[str], logs: Path) -> Iterator[str]:
    """round_robin: without the response affinity a chain would hop replicas and 404."""
    url, ctx = _gateway(sims, logs / "rr.jsonl", "round_robin")
    with ctx:
        yield url


def _records(path: Path, n: int, endpoint: str | None = None) -> list[dict[str, Any]]:
    """The last n usage records (of one endpoint), waiting for the log to have them."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        recs = [orjson.loads(x) for x in lines]
        recs = [r for r in recs if endpoint is None or r["endpoint"] == endpoint]
        if len(recs) >= n:
            return recs[-n:]
        time.sleep(0.05)
    raise AssertionError(f"expected {n} usage records in {path}")


def test_responses_repeat_is_cached_and_recorded(gw: str, logs: Path) -> None:
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS,
                                    input="Summarize rule 3.", max_output_tokens=8)
    again = client.responses.create(model=MODEL, instructions=INSTRUCTIONS,
                                    input="Summarize rule 3.", max_output_tokens=8)
    assert first.id.startswith("resp_") and first.output_text
    assert first.usage is not None and again.usage is not None
    assert first.usage.input_tokens == again.usage.input_tokens > 400
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16

    events = list(client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input="Summarize rule 3.",
        max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    done = events[-1].response  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.input_tokens_details.cached_tokens > 400

    recs = _records(logs / "prefix.jsonl", 3, "responses")
    assert [r["stream"] for r in recs] == [False, False, True]
    assert [r["status"] for r in recs] == [200, 200, 200]
    assert recs[0]["cached_tokens"] == 0 and recs[1]["cached_tokens"] > 400
    assert recs[2]["cached_tokens"] == done.usage.input_tokens_details.cached_tokens
    assert recs[1]["prompt_tokens"] == first.usage.input_tokens
    assert recs[1]["predicted_cached_tokens"] > 0  # routed by prefix, like chat
    assert recs[1]["replica"] == recs[0]["replica"]


def test_responses_chain_of_six_turns_stays_on_its_replica(gw_rr: str, logs: Path) -> None:
    client = openai.OpenAI(base_url=gw_rr + "/v1", api_key="x", max_retries=0)
    previous: str | None = None
    replicas, routes, cached = [], [], []
    for turn in range(6):
        kwargs: dict[str, Any] = {"model": MODEL, "input": f"Step {turn}: go on.",
                                  "max_output_tokens": 6, "instructions": INSTRUCTIONS}
        if previous is not None:
            kwargs["previous_response_id"] = previous
        if turn % 2:
            with client.responses.with_streaming_response.create(stream=True, **kwargs) as raw:
                replicas.append(raw.headers["x-gateway-replica"])
                routes.append(raw.headers["x-gateway-route"])
                final = [e for e in raw.parse() if e.type == "response.completed"][-1]
                response = final.response  # type: ignore[union-attr]
        else:
            raw = client.responses.with_raw_response.create(**kwargs)
            replicas.append(raw.headers["x-gateway-replica"])
            routes.append(raw.headers["x-gateway-route"])
            response = raw.parse()
        assert response.status in ("completed", "incomplete")  # incomplete: max_output_tokens
        assert response.usage is not None
        cached.append(response.usage.input_tokens_details.cached_tokens)
        previous = response.id
    assert len(set(replicas)) == 1, replicas
    assert routes[1:] == ["response"] * 5
    assert all(c > 400 for c in cached[1:]), cached  # the history is that replica's prefix
    recs = _records(logs / "rr.jsonl", 6, "responses")
    assert [r["route"] for r in recs[1:]] == ["response"] * 5


def test_unknown_previous_response_is_the_replicas_404(gw_rr: str) -> None:
    client = openai.OpenAI(base_url=gw_rr + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_" + "0" * 32)
    assert "Response with id 'resp_00000000000000000000000000000000' not found." in str(
        err.value)


def test_messages_with_anthropic_client(gw: str, logs: Path) -> None:
    client = anthropic.Anthropic(base_url=gw, api_key="x", max_retries=0)
    kwargs: dict[str, Any] = {
        "model": MODEL, "max_tokens": 8,
        "system": [{"type": "text", "text": "Messages. " + INSTRUCTIONS,
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Summarize rule 7."}]}
    first = client.messages.create(**kwargs)
    again = client.messages.create(**kwargs)
    assert first.content[0].type == "text" and first.stop_reason in ("end_turn", "max_tokens")
    assert first.usage.cache_read_input_tokens == 0
    read = again.usage.cache_read_input_tokens
    assert read is not None and read > 400
    assert again.usage.input_tokens + read == first.usage.input_tokens  # uncached + cached

    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.usage.cache_read_input_tokens is not None
    assert final.usage.cache_read_input_tokens > 400

    recs = _records(logs / "prefix.jsonl", 3, "messages")
    assert [r["stream"] for r in recs] == [False, False, True]
    prompt = first.usage.input_tokens
    assert [r["prompt_tokens"] for r in recs] == [prompt] * 3  # normalized: uncached + read
    assert recs[1]["cached_tokens"] == read
    assert recs[2]["cached_tokens"] == final.usage.cache_read_input_tokens
    assert recs[2]["completion_tokens"] == final.usage.output_tokens


def test_the_three_apis_share_one_prefix(gw: str, logs: Path) -> None:
    """vLLM renders all three into the same chat prompt: a chat request warms the cache
    for Responses and Messages requests, and the gateway predicts it."""
    system = "Shared. " + INSTRUCTIONS
    question = "Which rule is first?"
    log = logs / "prefix.jsonl"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    chat = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
    warm = chat.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])
    assert warm.usage is not None
    resp = chat.responses.create(model=MODEL, instructions=system, input=question,
                                 max_output_tokens=4)
    msg = anthropic.Anthropic(base_url=gw, api_key="x", max_retries=0).messages.create(
        model=MODEL, max_tokens=4, system=system,
        messages=[{"role": "user", "content": question}])
    assert resp.usage is not None
    assert resp.usage.input_tokens == warm.usage.prompt_tokens  # the same rendered prompt
    assert resp.usage.input_tokens_details.cached_tokens >= warm.usage.prompt_tokens - 16
    assert msg.usage.cache_read_input_tokens is not None
    assert msg.usage.cache_read_input_tokens >= warm.usage.prompt_tokens - 16
    recs = _records(log, before + 3)[before:]
    assert [r["endpoint"] for r in recs] == ["chat", "responses", "messages"]
    assert len({r["replica"] for r in recs}) == 1
    assert all(r["predicted_cached_tokens"] >= warm.usage.prompt_tokens - 16 for r in recs[1:])


def test_metrics_and_stats_by_endpoint(gw: str) -> None:
    client = anthropic.Anthropic(base_url=gw, api_key="x", max_retries=0)
    client.messages.create(model=MODEL, max_tokens=4,
                           messages=[{"role": "user", "content": "ping"}])
    # its own Responses request: the module's others may be deselected (`-k`)
    openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0).responses.create(
        model=MODEL, input="ping", max_output_tokens=4)
    metrics = httpx.get(gw + "/metrics").text
    assert 'gateway_endpoint_requests_total{endpoint="messages",status="200"}' in metrics
    assert 'gateway_endpoint_cached_tokens_total{endpoint="responses"}' in metrics
    stats = httpx.get(gw + "/stats").json()
    by_endpoint = stats["windows"]["all"]["by_endpoint"]
    assert by_endpoint["messages"]["requests"] >= 1


def test_sim_errors_as_vllm_0_32(sims: list[str]) -> None:
    """Shapes read from real vLLM 0.32: the store's 404 (also with the store off), a
    Messages validation error in the OpenAI shape, a Messages engine error in Anthropic's."""
    with sim(1, ["--speed", "50"]) as (url,):
        r = httpx.post(url + "/v1/responses", json={
            "model": MODEL, "input": "hi", "previous_response_id": "resp_abc"})
        missing = httpx.post(url + "/v1/messages", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        unknown = httpx.post(url + "/v1/messages", json={
            "model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        ok = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi"}).json()
        no_input = httpx.post(url + "/v1/responses", json={"model": MODEL})
    assert no_input.status_code == 400 and no_input.json()["error"] == {
        "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.input', 'msg': "
                   "'Field required', 'input': '<dict of 1 items>'}",
        "type": "Bad Request", "param": "body.input", "code": 400}
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "body.max_tokens"
    assert missing.json()["error"]["type"] == "Bad Request"
    assert unknown.status_code == 404
    assert unknown.json() == {"type": "error", "error": {
        "type": "NotFoundError", "message": "The model `nope` does not exist."}}
    assert len(ok["id"]) == len("resp_") + 16 and ok["tool_choice"] == "none"
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "Response with id 'resp_abc' not found.",
                                 "type": "invalid_request_error", "param": "response_id",
                                 "code": 404}
