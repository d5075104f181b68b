"""`gateway sim` over real loopback sockets: bodies, SSE, errors, metrics, disconnects, openai."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import sim

MODEL = "Qwen/Qwen2.5-7B-Instruct"
FAST = ["--speed", "1000", "--kv-blocks", "512", "--max-model-len", "4096", "--timing-comments"]


@pytest.fixture(scope="module")
def fast() -> Iterator[str]:
    with sim(2, FAST) as urls:
        yield urls[0]


@pytest.fixture(scope="module")
def old() -> Iterator[str]:
    """Contract 0.23, force-include-usage, legacy metric names, real-time speed."""
    extra = [
        "--contract",
        "0.23",
        "--enable-force-include-usage",
        "--deprecated-metrics",
        "--max-model-len",
        "8192",
    ]
    with sim(1, extra) as urls:
        yield urls[0]


@pytest.fixture(scope="module")
def nodetails() -> Iterator[str]:
    with sim(1, ["--speed", "1000", "--no-prompt-tokens-details"]) as urls:
        yield urls[0]


def chat(base: str, content: str, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30)


def sse(base: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> list[str]:
    """Raw SSE lines (without the blank separators)."""
    with httpx.stream("POST", base + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all("\n" not in e for e in events)
    return events


def test_chat_body_has_vllm_fields_and_usage_order(fast: str) -> None:
    msgs = [{"role": "system", "content": "Cold"}, {"role": "user", "content": "cold one"}]
    r = httpx.post(
        fast + "/v1/chat/completions",
        headers={"X-Request-Id": "abc-1"},
        json={"model": MODEL, "messages": msgs, "max_tokens": 7},
        timeout=30,
    )
    assert r.status_code == 200
    b = r.json()
    assert list(b) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "kv_transfer_params",
    ]
    assert b["id"] == "chatcmpl-abc-1" and b["object"] == "chat.completion"
    choice = b["choices"][0]
    assert list(choice) == [
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
    ]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"] == [] and choice["message"]["refusal"] is None
    assert list(b["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
    ]
    assert b["usage"]["completion_tokens"] == 7
    assert b["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    timing = json.loads(r.headers["x-sim-timing"])
    assert set(timing) == {
        "arrival_s",
        "queue_ms",
        "ttft_ms",
        "e2e_ms",
        "prompt_tokens",
        "cached_tokens",
    }
    assert 0 < timing["ttft_ms"] <= timing["e2e_ms"]


@pytest.mark.parametrize(
    ("n", "cached"), [(10, 0), (16, 0), (17, 16), (32, 16), (33, 32), (1000, 992)]
)
def test_repeated_prompt_reports_cached_tokens(fast: str, n: int, cached: int) -> None:
    ids = [7_000_000 + 10_000 * n + i for i in range(n)]  # unique per case: a cold start
    got = []
    for _ in range(3):
        r = httpx.post(fast + "/v1/completions", json={"prompt": ids, "max_tokens": 2})
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == n
        got.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert got == [0, cached, cached]


def test_tokenize_matches_engine_prompt_and_detokenize_round_trips(fast: str) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    tok = httpx.post(fast + "/tokenize", json={"model": MODEL, "messages": msgs}).json()
    assert list(tok) == ["count", "max_model_len", "tokens", "token_strs"]
    usage = httpx.post(
        fast + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}
    ).json()["usage"]
    assert tok["count"] == len(tok["tokens"]) == usage["prompt_tokens"]
    text = httpx.post(fast + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    plain = httpx.post(
        fast + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}
    ).json()
    assert plain["token_strs"] == ["hello", " world"]


def test_sse_sequence_chat(fast: str) -> None:
    msgs = [{"role": "system", "content": "SSE"}, {"role": "user", "content": "stream me"}]
    events = sse(
        fast,
        {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith(": sim-timing {")
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    role, *content, finish, usage = chunks
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert role["prompt_token_ids"] is None and "usage" not in role
    assert len(content) == 3
    for c in content:
        assert list(c["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
        assert c["choices"][0]["finish_reason"] is None and "usage" not in c
    f = finish["choices"][0]
    assert f["finish_reason"] == "length" and f["stop_reason"] is None
    assert usage["choices"] == []
    assert list(usage["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
    ]
    assert usage["usage"] == {
        "prompt_tokens": usage["usage"]["prompt_tokens"],
        "total_tokens": usage["usage"]["prompt_tokens"] + 4,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_sse_continuous_usage_and_stop_finish(fast: str) -> None:
    events = sse(
        fast,
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    running = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert running == list(range(len(running)))
    assert all("prompt_tokens_details" not in c["usage"] for c in chunks[:-1])
    last = chunks[-2]["choices"][0]
    assert last["finish_reason"] == "stop" and last["delta"] == {"content": ""}
    assert "prompt_tokens_details" in chunks[-1]["usage"]


def test_sse_without_include_usage_has_no_usage_chunk(fast: str) -> None:
    events = sse(
        fast, {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 2}
    )
    datas = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert all(d["choices"] for d in datas) and events[-1] == "data: [DONE]"


def test_sse_completions(fast: str) -> None:
    events = sse(
        fast,
        {
            "prompt": "Once upon",
            "stream": True,
            "max_tokens": 3,
            "stream_options": {"include_usage": True},
        },
        "/v1/completions",
    )
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert [c["object"] for c in chunks] == ["text_completion"] * 4
    assert chunks[0]["id"].startswith("cmpl-") and "text" in chunks[0]["choices"][0]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3


def test_completions_body(fast: str) -> None:
    b = httpx.post(
        fast + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5}
    ).json()
    assert b["object"] == "text_completion" and b["id"].startswith("cmpl-")
    assert list(b["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_logprobs",
        "prompt_token_ids",
        "token_ids",
    ]
    assert b["usage"]["completion_tokens"] == 5


def _error(r: httpx.Response, status: int, typ: str, fragment: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == typ and fragment in err["message"]


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
    _error(r, status, typ, fragment)


def test_prompt_too_long_and_huge_body(fast: str) -> None:
    long = " ".join(["word"] * 5000)
    _error(
        chat(fast, long),
        400,
        "BadRequestError",
        "This model's maximum context length is 4096 tokens. However, your prompt contains",
    )
    r = httpx.post(fast + "/v1/completions", content=b'{"prompt": "' + b"a" * (33 << 20) + b'"}')
    _error(r, 400, "BadRequestError", "exceeds")


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
    _error(chat(old, "w " * 9000), 400, "BadRequestError", "your request has")
    _error(chat(old, "hi", max_tokens=8190), 400, "BadRequestError", "too large")


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


def scrape(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_names_and_labels(old: str) -> None:
    labels = f'{{model_name="{MODEL}",engine="0"}}'
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
        f'vllm:request_success_total{{model_name="{MODEL}",engine="0",finished_reason="length"}}'
        in m
    )


def test_small_endpoints(fast: str) -> None:
    h = httpx.get(fast + "/health")
    assert h.status_code == 200 and h.content == b""
    assert httpx.get(fast + "/ping").status_code == 200
    assert httpx.post(fast + "/ping").status_code == 200
    assert httpx.get(fast + "/version").json() == {"version": "0.24.0"}
    assert httpx.get(fast + "/load").json() == {"server_load": 0}
    models = httpx.get(fast + "/v1/models").json()
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == MODEL and card["max_model_len"] == 4096
    assert card["owned_by"] == "vllm" and card["permission"][0]["object"] == "model_permission"
    assert httpx.get(fast + "/nope").status_code == 404
    assert httpx.get(fast + "/v1/chat/completions").status_code == 405


def test_reset_prefix_cache_and_replicas_are_independent(fast: str) -> None:
    content = "reset test " * 40
    chat(fast, content, max_tokens=1)
    assert (
        chat(fast, content, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        > 0
    )
    assert httpx.post(fast + "/reset_prefix_cache").status_code == 200
    assert (
        chat(fast, content, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        == 0
    )
    other = fast.rsplit(":", 1)[0] + ":" + str(int(fast.rsplit(":", 1)[1]) + 1)
    assert (
        chat(other, content, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        == 0
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
    labels = f'{{model_name="{MODEL}",engine="0"}}'
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
    labels = f'{{model_name="{MODEL}",engine="0"}}'
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
        m[f'vllm:request_success_total{{model_name="{MODEL}",engine="0",finished_reason="abort"}}']
        >= 1
    )
    assert httpx.get(old + "/load").json() == {"server_load": 0}


def test_openai_client(fast: str) -> None:
    import openai

    client = openai.OpenAI(base_url=fast + "/v1", api_key="x", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = client.chat.completions.create(
        model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello openai"}]
    )
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hello openai"}],
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert (
        chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens // 16 * 16
        or chunks[-1].usage.prompt_tokens_details.cached_tokens
        == (r.usage.prompt_tokens - 1) // 16 * 16
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="Say", max_tokens=3)
    assert c.usage is not None and c.usage.completion_tokens == 3
