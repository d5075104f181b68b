"""The gateway in front of two real vLLM 0.32 CPU replicas, driven by the official `openai`
client: chat, streams with and without `include_usage`, completions, tool calls, cached
tokens on follow-ups equal to the gateway's prediction, the replicas' `/metrics` read by the
gateway (block size and capacity from `vllm:cache_config_info`), vLLM's errors passed
through unchanged, and a replica that restarts."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.realvllm.gateways import fronted, records
from tests.realvllm.vllm import MODEL_NAME, VllmOptions
from tests.servers import free_port, running

pytestmark = pytest.mark.realvllm


@pytest.fixture(scope="module")
def gw(vllm_pair: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("usage") / "usage.jsonl"
    with fronted(vllm_pair, log) as url:
        yield url


@pytest.fixture
def client(gw: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _messages(tag: str, words: int = 300) -> Any:  # the SDK wants its TypedDicts
    body = " ".join(f"{tag}{i % 17} cache block token {i}" for i in range(words // 4))
    return [{"role": "system", "content": body}, {"role": "user", "content": f"{tag} go"}]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_chat_and_follow_up_hits_the_cache(client: openai.OpenAI) -> None:
    msgs = _messages("chat")
    first = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=4)
    again = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=4)
    assert first.usage is not None and again.usage is not None
    assert first.usage.completion_tokens == 4
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # vLLM hits whole 32-token blocks: everything but the partial last block.
    assert details.cached_tokens == again.usage.prompt_tokens // 32 * 32 > 0


def test_stream_with_include_usage_ends_with_one_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=_messages("su"), max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None and chunks[-1].choices == []
    assert usage[0].completion_tokens == 5
    assert usage[0].prompt_tokens_details is not None


def test_stream_without_include_usage_carries_no_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=_messages("nu"), max_tokens=3, stream=True,
    ))  # fmt: skip
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_endpoint(client: openai.OpenAI) -> None:
    prompt = "completions " * 80
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3)
    done = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3)
    assert done.usage is not None and done.usage.completion_tokens == 3
    assert done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == done.usage.prompt_tokens // 32 * 32


def test_tool_calls_reach_vllm_with_the_tool_parser(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }}  # fmt: skip
    history: Any = [
        {"role": "user", "content": "read a.txt"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello from a.txt"},
    ]  # fmt: skip
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=[tool], tool_choice="auto", max_tokens=4
    )
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage is not None and r.usage.prompt_tokens > 50  # the tools were rendered


def test_vllm_errors_pass_through_unchanged(gw: str, vllm_pair: list[str]) -> None:
    # Errors only the engine can find (the gateway answers malformed bodies itself).
    too_long = {"model": MODEL_NAME, "max_tokens": 2,
                "messages": [{"role": "user", "content": "long " * 5000}]}  # fmt: skip
    max_tokens = {"model": MODEL_NAME, "max_tokens": 100_000,
                  "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    required = {"model": MODEL_NAME, "max_tokens": 2, "tool_choice": "required",
                "messages": [{"role": "user", "content": "hi"}]}  # tool_choice without tools
    for body in (too_long, max_tokens, required):
        direct = httpx.post(vllm_pair[0] + "/v1/chat/completions", json=body, timeout=60)
        via = httpx.post(gw + "/v1/chat/completions", json=body, timeout=60)
        assert direct.status_code == via.status_code == 400
        assert via.json() == direct.json()
        assert set(via.json()["error"]) == {"message", "type", "param", "code"}
    own = httpx.post(gw + "/v1/chat/completions", timeout=60,
                     json={"model": MODEL_NAME, "messages": "not a list"})  # fmt: skip
    assert own.status_code == 400
    assert set(own.json()["error"]) == {"message", "type", "param", "code"}


def test_gateway_reads_block_size_and_capacity_from_vllm_metrics(
    gw: str, vllm_pair: list[str]
) -> None:
    info = [line for line in httpx.get(vllm_pair[0] + "/metrics", timeout=10).text.splitlines()
            if line.startswith("vllm:cache_config_info{")]  # fmt: skip
    assert len(info) == 1 and 'block_size="32"' in info[0]
    blocks = int(info[0].split('num_gpu_blocks="')[1].split('"')[0])
    stats = httpx.get(gw + "/stats", timeout=10).json()
    text = json.dumps(stats)
    assert str(blocks * 32) in text, text[:2000]  # capacity in tokens = blocks x block size
    gw_metrics = httpx.get(gw + "/metrics", timeout=10).text
    assert "vllm:" not in gw_metrics and "gateway_" in gw_metrics


def test_predicted_equals_delivered_on_follow_ups(
    vllm_pair: list[str], tmp_path: Path
) -> None:
    """Follow-ups extend the conversation with the model's own replies. vLLM also caches the
    blocks its generated tokens fill; the follow-up hits them only if the reply, rendered
    back into the prompt, tokenizes to the same ids. The random model's gibberish often does
    not (BPE merges it differently), and then vLLM delivers one block less than the gateway
    expects: a real model's replies re-tokenize to themselves almost always. So: exact on
    most follow-ups, never more than that one block apart, never above the prediction's
    block either way."""
    log = tmp_path / "usage.jsonl"
    with fronted(vllm_pair, log) as url, openai.OpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        for conv in range(3):
            msgs = _messages(f"pd{conv}-", 400)
            for _turn in range(3):
                r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8)
                msgs = [*msgs, {"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": f"next step {_turn} " * 20}]  # fmt: skip
    recs = records(log)  # the gateway has stopped: its usage log is complete
    assert len(recs) == 9
    follow_ups = [r for r in recs if r["cached_tokens"]]
    assert len(follow_ups) >= 6
    table = [(r["replica"], r["prompt_tokens"], r["cached_tokens"], r["predicted_cached_tokens"])
             for r in recs]  # fmt: skip
    exact = [r for r in follow_ups if r["predicted_cached_tokens"] == r["cached_tokens"]]
    for r in follow_ups:
        assert r["predicted_cached_tokens"] - r["cached_tokens"] in (0, 32), table
    assert len(exact) >= len(follow_ups) // 2, table


def test_a_replica_that_restarts_is_used_again(
    vllm_options: VllmOptions, vllm_pair: list[str], tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = url.removeprefix("http://")  # `--backend URL` replicas are named host:port
    log = tmp_path / "usage.jsonl"

    def replica() -> contextlib.AbstractContextManager[Any]:
        return running(vllm_options.argv(port), [url + "/health"], vllm_options.start_timeout_s,
                       env=vllm_options.env(), log_path=tmp_path / f"vllm-{port}.log")  # fmt: skip

    def send(gw: str, n: int) -> None:
        for i in range(n):
            body = {"model": MODEL_NAME, "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"restart {i} " * 30}]}  # fmt: skip
            r = httpx.post(gw + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text

    with replica(), fronted([vllm_pair[0], url], log, "--policy", "round_robin") as gw:
        send(gw, 4)
    before = records(log)
    log = tmp_path / "usage-restart.jsonl"
    with fronted([vllm_pair[0], url], log, "--policy", "round_robin") as gw:
        send(gw, 4)  # the second replica is down: everything goes to the first
        with replica():
            deadline = time.monotonic() + 60
            while name not in httpx.get(gw + "/ready", timeout=5).json()["healthy"]:
                assert time.monotonic() < deadline, "gateway never saw the replica come back"
                time.sleep(0.5)
            send(gw, 4)
    recs = before + records(log)
    assert [r["status"] for r in recs] == [200] * 12
    assert {r["replica"] for r in recs[:4]} == {vllm_pair[0].removeprefix("http://"), name}
    assert {r["replica"] for r in recs[4:8]} == {vllm_pair[0].removeprefix("http://")}
    assert name in {r["replica"] for r in recs[8:]}
