"""`gateway sim` over real loopback sockets: OpenAI-shaped errors, contract-version and
usage options, Prometheus metric names, and client disconnects that abort and free blocks."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import sim
from tests.sim_http import FAST, MODEL, OLD, chat, expect_error, scrape, sse


@pytest.fixture(scope="module")
def fast() -> Iterator[str]:
    with sim(2, FAST) as urls:
        yield urls[0]


@pytest.fixture(scope="module")
def old() -> Iterator[str]:
    """Contract 0.23, force-include-usage, legacy metric names, real-time speed."""
    with sim(1, OLD) as urls:
        yield urls[0]


@pytest.fixture(scope="module")
def nodetails() -> Iterator[str]:
    with sim(1, ["--speed", "1000", "--no-prompt-tokens-details"]) as urls:
        yield urls[0]


@pytest.mark.parametrize(
    ("body", "status", "typ", "fragment"),
    [
        (b"{not json", 400, "BadRequestError", "Invalid JSON"),
        (b"[1, 2]", 400, "BadRequestError", "JSON object"),
        (b'{"model": "' + MODEL.encode() + b'"}', 400, "BadRequestError", "messages"),
        (b'{"messages": "hi"}', 400, "BadRequestError", "messages"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "BadRequestError", "role"),
        (b'{"messages": [{"role": "user", "content": 5}]}', 400, "BadRequestError", "content"),
        (b'{"messages": [], "max_tokens": "ten"}', 400, "BadRequestError", "max_tokens"),
        (b'{"messages": [], "stream": "yes"}', 400, "BadRequestError", "stream"),
        (b'{"messages": [], "temperature": "hot"}', 400, "BadRequestError", "temperature"),
        (b'{"messages": [], "n": 2}', 400, "BadRequestError", "n > 1"),
        (b'{"messages": [], "cache_salt": ""}', 400, "BadRequestError", "cache_salt"),
        (b'{"messages": [], "cache_salt": "a/b"}', 400, "BadRequestError", "cache_salt"),
        (b'{"messages": [], "cache_salt": 7}', 400, "BadRequestError", "cache_salt"),
        (
            b'{"model": "nope", "messages": []}',
            404,
            "NotFoundError",
            "The model `nope` does not exist.",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}',
            400,
            "BadRequestError",
            "too large",
        ),
    ],
)
def test_bad_requests(fast: str, body: bytes, status: int, typ: str, fragment: str) -> None:
    r = httpx.post(
        fast + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    expect_error(r, status, typ, fragment)


def test_prompt_too_long_and_huge_body(fast: str) -> None:
    long = " ".join(["word"] * 5000)
    expect_error(
        chat(fast, long),
        400,
        "BadRequestError",
        "This model's maximum context length is 4096 tokens. However, your prompt contains",
    )
    r = httpx.post(fast + "/v1/completions", content=b'{"prompt": "' + b"a" * (33 << 20) + b'"}')
    expect_error(r, 400, "BadRequestError", "exceeds")


def test_old_contract_omits_zero_details_and_uses_old_message(old: str) -> None:
    cold = [{"role": "system", "content": "Old"}, {"role": "user", "content": "a"}]
    u = httpx.post(old + "/v1/chat/completions", json={"messages": cold, "max_tokens": 2})
    assert u.json()["usage"]["prompt_tokens_details"] is None
    cold[0]["content"] = "Old stream"
    events = sse(old, {"messages": cold, "stream": True, "max_tokens": 2, "stream_options": {}})
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and "prompt_tokens_details" not in last["usage"]
    cached = chat(old, "old contract prompt " * 10, max_tokens=2)
    again = chat(old, "old contract prompt " * 10, max_tokens=2).json()["usage"]
    assert cached.status_code == 200 and again["prompt_tokens_details"]["cached_tokens"] > 0
    expect_error(chat(old, "w " * 9000), 400, "BadRequestError", "your request has")
    expect_error(chat(old, "hi", max_tokens=8190), 400, "BadRequestError", "too large")


def test_new_contract_clamps_max_tokens(fast: str) -> None:
    r = chat(fast, "clamp me", max_tokens=4090)
    assert r.status_code == 200
    assert r.json()["usage"]["total_tokens"] == 4096


def test_no_prompt_tokens_details(nodetails: str) -> None:
    for _ in range(2):
        u = chat(nodetails, "details off " * 20, max_tokens=1).json()["usage"]
        assert u["prompt_tokens_details"] is None


def test_force_include_usage(old: str) -> None:
    events = sse(
        old, {"messages": [{"role": "user", "content": "force"}], "stream": True, "max_tokens": 2}
    )
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert all("usage" in c for c in chunks) and chunks[-1]["choices"] == []



def test_metrics_names_and_labels(old: str) -> None:
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    m = scrape(old)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_cached_total",
        "vllm:gpu_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm:request_queue_time_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
    ):
        assert name + labels in m, name
    assert any(
        k.startswith('vllm:cache_config_info{block_size="16",')
        and 'num_gpu_blocks="2048"' in k
        and 'enable_prefix_caching="True"' in k
        for k in m
    )
    assert (
        f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}}'
        in m
    )



def _raw_request(base: str, body: dict[str, Any]) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )
    return s


def _wait_idle(base: str) -> dict[str, float]:
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = scrape(base)
        if (
            m["vllm:num_requests_running" + labels] == 0
            and m["vllm:kv_cache_usage_perc" + labels] == 0
        ):
            return m
        time.sleep(0.05)
    raise AssertionError(f"blocks not freed: {m}")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(old: str, stream: bool) -> None:
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    s = _raw_request(
        old,
        {
            "messages": [{"role": "user", "content": "long " * 300}],
            "max_tokens": 5000,
            "stream": stream,
        },
    )
    try:
        if stream:
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 10
        while scrape(old)["vllm:num_requests_running" + labels] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert scrape(old)["vllm:kv_cache_usage_perc" + labels] > 0
        assert httpx.get(old + "/load").json() == {"server_load": 1}
    finally:
        s.close()
    m = _wait_idle(old)
    assert (
        m[f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}']
        >= 1
    )
    assert httpx.get(old + "/load").json() == {"server_load": 0}
