"""Responses and Messages APIs through the gateway in front of two real vLLM 0.32 CPU
replicas with the response store on: the official `openai` client (`responses.create`,
streamed and not, a 6-turn `previous_response_id` chain under round_robin, which without
the gateway's affinity would hop to the replica that does not hold the response and 404)
and the official `anthropic` client (`messages.create`, streamed and not): cached tokens
on repeats, usage records by endpoint."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

gateways = pytest.importorskip("tests.realvllm.gateways", reason="the real-vLLM tier fixtures")

from tests.realvllm.vllm import MODEL_NAME  # noqa: E402

INSTRUCTIONS = "You are a careful build engineer. " + " ".join(
    f"Rule {i}: keep builds reproducible and logs short." for i in range(50))


@pytest.fixture(scope="module")
def store_pair(vllm_options: Any) -> Iterator[list[str]]:
    from tests.realvllm.vllm import vllm_replicas

    with pytest.MonkeyPatch.context() as mp:
        # vLLM reads it at start-up; the replicas inherit this process's environment
        mp.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        with vllm_replicas(vllm_options, 2) as urls:
            yield urls


@pytest.fixture(scope="module")
def rr(store_pair: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[str, Path]]:
    log = tmp_path_factory.mktemp("usage") / "usage.jsonl"
    with gateways.fronted(store_pair, log, "--policy", "round_robin") as url:
        yield url, log


@pytest.fixture(scope="module")
def px(store_pair: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[str, Path]]:
    log = tmp_path_factory.mktemp("usage") / "usage.jsonl"
    with gateways.fronted(store_pair, log, "--policy", "prefix") as url:
        yield url, log


def test_previous_response_chain_never_404s(rr: tuple[str, Path]) -> None:
    url, _ = rr
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    previous = None
    seen = []
    for turn in range(6):
        kwargs: dict[str, Any] = {"model": MODEL_NAME, "instructions": INSTRUCTIONS,
                                  "input": f"Step {turn}: go on.", "max_output_tokens": 6}
        if previous is not None:
            kwargs["previous_response_id"] = previous
        if turn % 2:
            with client.responses.with_streaming_response.create(stream=True, **kwargs) as raw:
                seen.append((raw.headers["x-gateway-replica"], raw.headers["x-gateway-route"]))
                events = list(raw.parse())
                response = [e for e in events if e.type == "response.completed"][-1].response  # type: ignore[union-attr]
        else:
            raw = client.responses.with_raw_response.create(**kwargs)
            seen.append((raw.headers["x-gateway-replica"], raw.headers["x-gateway-route"]))
            response = raw.parse()
        assert response.usage is not None
        if turn:
            # the replica holds the whole history: all but the partial last block is cached
            assert response.usage.input_tokens_details.cached_tokens >= (
                response.usage.input_tokens - 64)
        previous = response.id
    assert len({replica for replica, _ in seen}) == 1, seen
    assert [route for _, route in seen[1:]] == ["response"] * 5


def test_responses_and_messages_repeats_are_cached_and_recorded(px: tuple[str, Path]) -> None:
    url, log = px
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "instructions": INSTRUCTIONS,
                              "input": "Summarize rule 3.", "max_output_tokens": 4}
    first = client.responses.create(**kwargs)
    again = client.responses.create(**kwargs)
    streamed = [e for e in client.responses.create(stream=True, **kwargs)
                if e.type == "response.completed"][-1].response  # type: ignore[union-attr]
    assert first.usage is not None and again.usage is not None and streamed.usage is not None
    whole = again.usage.input_tokens // 32 * 32
    assert again.usage.input_tokens_details.cached_tokens == whole > 0
    assert streamed.usage.input_tokens_details.cached_tokens == whole

    ac = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    mkw: dict[str, Any] = {
        "model": MODEL_NAME, "max_tokens": 4,
        "system": [{"type": "text", "text": "Messages. " + INSTRUCTIONS,
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Summarize rule 7."}]}
    ac.messages.create(**mkw)
    m2 = ac.messages.create(**mkw)
    with ac.messages.stream(**mkw) as stream:
        assert "".join(stream.text_stream) is not None
        m3 = stream.get_final_message()
    for m in (m2, m3):
        assert m.usage.cache_read_input_tokens is not None
        assert m.usage.cache_read_input_tokens > 0
        assert m.usage.input_tokens < 32  # Anthropic counts only the uncached part

    deadline = time.monotonic() + 10  # the usage log is written off the event loop
    recs: list[dict[str, Any]] = []
    while time.monotonic() < deadline and len(recs) < 6:
        recs = [r for r in gateways.records(log) if r["endpoint"] in ("responses", "messages")]
        time.sleep(0.1)
    by = {e: [r for r in recs if r["endpoint"] == e] for e in ("responses", "messages")}
    assert [r["stream"] for r in by["responses"]][-3:] == [False, False, True]
    assert by["responses"][-1]["cached_tokens"] == whole
    assert by["messages"][-1]["prompt_tokens"] == (
        m3.usage.input_tokens + (m3.usage.cache_read_input_tokens or 0))
    assert by["messages"][-1]["cached_tokens"] == m3.usage.cache_read_input_tokens
