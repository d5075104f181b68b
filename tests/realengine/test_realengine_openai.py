"""The official `openai` client, end to end through `gateway serve` (zero-config
`--backend` start) to two llama.cpp replicas: chat, streaming with and without
include_usage, completions, models, an OpenAI-shaped 404, and the engine's
`cached_tokens` passed through."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.realengine.model import Words
from tests.servers import gateway

pytestmark = pytest.mark.realengine


@pytest.fixture(scope="module")
def gw(llama_pair: list[str]) -> Iterator[str]:
    with gateway(llama_pair) as url:
        yield url


@pytest.fixture
def client(gw: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _messages(seed: int, words: int = 300) -> Any:  # the SDK wants its TypedDicts
    return [
        {"role": "system", "content": f"case {seed}. " + Words(seed).text(words)},
        {"role": "user", "content": Words(seed + 1).text(12)},
    ]


def _replica_names(llama_pair: list[str]) -> set[str]:
    # `--backend URL` replicas are named by host:port.
    return {u.removeprefix("http://") for u in llama_pair}


def test_models_lists_the_engine_model(client: openai.OpenAI) -> None:
    assert "tiny" in [m.id for m in client.models.list()]


def test_chat_then_repeat_hits_the_engine_cache_on_the_same_replica(
    client: openai.OpenAI, llama_pair: list[str]
) -> None:
    kwargs: Any = {"model": "tiny", "messages": _messages(101), "max_tokens": 4}
    raw1 = client.chat.completions.with_raw_response.create(**kwargs)
    raw2 = client.chat.completions.with_raw_response.create(**kwargs)
    first, second = raw1.parse(), raw2.parse()
    assert first.object == "chat.completion"
    assert isinstance(first.choices[0].message.content, str)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens > 300
    assert raw1.headers["x-gateway-replica"] in _replica_names(llama_pair)
    assert raw1.headers.get("x-request-id")
    assert raw2.headers["x-gateway-replica"] == raw1.headers["x-gateway-replica"]
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # llama.cpp recomputes only the last token of an identical prompt.
    assert details.cached_tokens == second.usage.prompt_tokens - 1


def test_stream_with_include_usage_ends_with_one_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=_messages(201), max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > 300 and usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].delta.content for c in chunks)


def test_stream_without_include_usage_carries_no_usage(gw: str) -> None:
    # The gateway injects include_usage upstream for its own accounting; the client did
    # not ask, so the extra usage chunk (and any usage field) must not reach it.
    body = {"model": "tiny", "messages": _messages(301), "max_tokens": 6, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks, "no chunks relayed"
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    assert all(c["choices"] for c in chunks), "an empty-choices usage chunk leaked"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_completions_endpoint(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny", prompt=Words(401).text(60), max_tokens=4)
    assert done.object == "text_completion"
    assert isinstance(done.choices[0].text, str)
    assert done.usage is not None and done.usage.prompt_tokens >= 60


def test_unknown_model_is_an_openai_shaped_404(client: openai.OpenAI, gw: str) -> None:
    # llama.cpp itself would answer any model name; the gateway knows the fleet's models.
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=_messages(501, 5))
    assert info.value.status_code == 404
    r = httpx.post(gw + "/v1/chat/completions", timeout=10,
                   json={"model": "no-such-model", "messages": _messages(501, 5)})  # fmt: skip
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert "no-such-model" in error["message"]


def test_streams_survive_llama_cpp_closing_the_connection(gw: str) -> None:
    # llama.cpp (cpp-httplib) closes the TCP connection after every streamed response while
    # advertising keep-alive; a pooled upstream connection reused in that window must not
    # turn into a client-visible error.
    with httpx.Client(base_url=gw, timeout=30) as c:
        for i in range(40):
            body = {"model": "tiny", "max_tokens": 2, "stream": True,
                    "messages": [{"role": "user", "content": f"ping {i}"}]}  # fmt: skip
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                text = r.read().decode()
            assert r.status_code == 200, text[:300]
            assert text.rstrip().endswith("data: [DONE]")


def test_gateway_accounting_sees_every_engine_usage(gw: str) -> None:
    # Every request on this gateway, streamed with or without include_usage, must have
    # been recorded with the engine's cached_tokens (the gateway injects include_usage
    # upstream for itself); engine metric names must not leak into the gateway's /metrics.
    for include in (False, True):
        body: dict[str, Any] = {"model": "tiny", "messages": _messages(601), "max_tokens": 2,
                                "stream": True}  # fmt: skip
        if include:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            r.read()
    window = httpx.get(gw + "/stats", timeout=10).json()["windows"]["1m"]
    assert window["requests"] >= 2
    assert window["records_without_cached_tokens"] == 0
    assert window["cached_tokens"] > 0
    metrics = httpx.get(gw + "/metrics", timeout=10).text
    names = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line[:1] != "#"}
    names.discard("")
    # the gateway's own families and its process's (process_*, python_gc_*, python_info),
    # never the engine's
    assert names and all(n.startswith(("gateway_", "process_", "python_")) for n in names)
    assert any(n.startswith("gateway_") for n in names)


def _engine_counters(urls: list[str]) -> tuple[float, float]:
    """(requests processing, tokens predicted) summed over the replicas' /metrics."""
    processing = predicted = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if line.startswith("llamacpp:requests_processing "):
                processing += float(line.split()[1])
            elif line.startswith("llamacpp:tokens_predicted_total "):
                predicted += float(line.split()[1])
    return processing, predicted


def test_client_disconnect_stops_generation_on_the_engine(gw: str, llama_pair: list[str]) -> None:
    _, before = _engine_counters(llama_pair)
    # ignore_eos (a llama.cpp extension, passed through) keeps the random model talking.
    body = {"model": "tiny", "messages": _messages(701, 20), "max_tokens": 3000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for i, _line in enumerate(r.iter_lines()):
            if i >= 10:
                break
    processing, after = 1.0, before
    for _ in range(160):  # bounded: 8 s (left alone it runs to the slot's ~2000-token end)
        time.sleep(0.05)
        processing, after = _engine_counters(llama_pair)
        if processing == 0:
            break
    assert processing == 0
    assert after - before < 1000, "the engine kept generating for a client that left"
