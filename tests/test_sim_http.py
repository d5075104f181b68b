"""`gateway sim` over real loopback sockets: response bodies, SSE sequences, tokenize, the
small endpoints, prefix-cache reset and the openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.servers import sim
from tests.sim_http import FAST, MODEL, chat, sse


@pytest.fixture(scope="module")
def fast() -> Iterator[str]:
    with sim(2, FAST) as urls:
        yield urls[0]


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
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert b["system_fingerprint"].startswith("vllm-0.32.0")
    assert b["id"] == "chatcmpl-abc-1" and b["object"] == "chat.completion"
    choice = b["choices"][0]
    assert list(choice) == [
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "routed_experts",
    ]
    assert choice["finish_reason"] == "length"
    # 0.32 leaves an empty tool_calls list out of the message.
    assert "tool_calls" not in choice["message"] and choice["message"]["refusal"] is None
    assert list(b["usage"]) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ]
    assert b["usage"]["completion_tokens"] == 7
    details = b["usage"]["prompt_tokens_details"]
    # created_cache_tokens: the prompt's full 16-token blocks, all new on a cold request.
    full = b["usage"]["prompt_tokens"] // 16 * 16
    assert details == {"cached_tokens": 0, "created_cache_tokens": full, "multimodal_tokens": None}
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
        "prompt_tokens_details": {
            "cached_tokens": 0,
            "created_cache_tokens": usage["usage"]["prompt_tokens"] // 16 * 16,
        },
    }
    assert usage["system_fingerprint"].startswith("vllm-0.32.0")


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
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    ]
    assert b["usage"]["completion_tokens"] == 5



def test_small_endpoints(fast: str) -> None:
    h = httpx.get(fast + "/health")
    assert h.status_code == 200 and h.content == b""
    assert httpx.get(fast + "/ping").status_code == 200
    assert httpx.post(fast + "/ping").status_code == 200
    assert httpx.get(fast + "/version").json() == {"version": "0.32.0"}
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
    assert httpx.post(fast + "/reset_prefix_cache").json() == {"success": True}
    assert (
        chat(fast, content, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        == 0
    )
    other = fast.rsplit(":", 1)[0] + ":" + str(int(fast.rsplit(":", 1)[1]) + 1)
    assert (
        chat(other, content, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        == 0
    )



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
