"""Begun is not prefilled, on real vLLM (gateway/routing/ledger.py): a long prompt whose
scrape shows it running with nothing waiting still holds the engine's prefill, and a short
request sent then gets its first token only once the long one has had its own. So a
stream's queued prefill ends at its first token, not when a scrape shows it begun (the
gateway used to end it there, and sent short requests behind such prompts)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable

import httpx
import pytest

from gateway.usage.sse import RESPONSES_FIRST_TOKEN
from tests.realvllm.vllm import MODEL_NAME

pytestmark = pytest.mark.realvllm


def _long(seed: int) -> str:
    rng = random.Random(seed)  # ~20k tokens of the tiny model's byte-level vocabulary
    return " ".join(f"w{rng.randrange(10_000)}" for _ in range(3_500))


async def _first_token(client: httpx.AsyncClient, url: str, text: str) -> float:
    body = {"model": MODEL_NAME, "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choice = (json.loads(line[5:]).get("choices") or [{}])[0]
            if choice.get("delta", {}).get("content") or choice.get("finish_reason"):
                return time.monotonic()  # a token, not the role's empty opening chunk
    raise AssertionError("the stream ended without a token")


async def _begun(client: httpx.AsyncClient, url: str, deadline: float) -> dict[str, float]:
    """The engine's counts once a scrape shows a request running and none waiting."""
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        for line in (await client.get(url + "/metrics")).text.splitlines():
            for key in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                if line.startswith(key + "{"):
                    seen[key] = float(line.rsplit(" ", 1)[1])
        if seen.get("vllm:num_requests_running", 0) >= 1 and \
                seen.get("vllm:num_requests_waiting") == 0:
            return seen
        await asyncio.sleep(0.01)  # a scrape, bounded by the deadline
    raise AssertionError(f"no scrape showed the long prompt begun: {seen}")


def test_a_short_request_waits_for_a_begun_long_prefill(
        fresh_vllm: Callable[..., list[str]]) -> None:
    (url,) = fresh_vllm(1, max_model_len=32768)

    async def run() -> tuple[float, float, float]:
        async with httpx.AsyncClient(timeout=300) as client:
            t0 = time.monotonic()
            alone = await _first_token(client, url, _long(0)) - t0  # its prefill time
            t0 = time.monotonic()
            long = asyncio.create_task(_first_token(client, url, _long(1)))
            await _begun(client, url, t0 + alone)
            sent = time.monotonic()
            short = await _first_token(client, url, "a short question")
            return alone, (await long) - sent, short - sent

    alone, long_left, short_wait = asyncio.run(run())
    # begun, the long prompt still had most of its prefill to go; the short one waited it
    assert long_left > 0.3 * alone
    assert short_wait >= 0.8 * long_left, (alone, long_left, short_wait)


async def _arrivals(client: httpx.AsyncClient, url: str, path: str, body: dict[str, object],
                    token: Callable[[str], bool]) -> tuple[float, float, float]:
    """Seconds from sending to: the response headers, the stream's first line, and its
    first line that `token` says holds a token."""
    t0 = time.monotonic()
    async with client.stream("POST", url + path, json=body) as r:
        headers = time.monotonic() - t0
        assert r.status_code == 200, await r.aread()
        first = None
        async for line in r.aiter_lines():
            if not line.strip():
                continue
            now = time.monotonic() - t0
            first = now if first is None else first
            if token(line):
                return headers, first, now
    raise AssertionError("the stream ended without a token")


def _chat_token(line: str) -> bool:
    if not line.startswith("data:") or line.strip() == "data: [DONE]":
        return False
    choice = (json.loads(line[5:]).get("choices") or [{}])[0]
    return bool(choice.get("delta", {}).get("content") or choice.get("finish_reason"))


def test_a_streams_headers_come_before_its_prefill_and_its_first_chunk_with_it(
        fresh_vllm: Callable[..., list[str]]) -> None:
    """What the picker's first token rests on (gateway/epp/picker.py `stream_chunk`): vLLM
    sends a stream's response headers before it prefills the prompt, so the headers are
    no first token; a chat stream's first chunk (the role's opening one) comes with the
    first token; a Responses stream's first events (`response.created`) come before the
    prefill, and its first delta with the token (`RESPONSES_FIRST_TOKEN`)."""
    (url,) = fresh_vllm(1, max_model_len=32768)

    async def run() -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        async with httpx.AsyncClient(timeout=300) as client:
            chat = await _arrivals(
                client, url, "/v1/chat/completions",
                {"model": MODEL_NAME, "stream": True, "max_tokens": 2,
                 "messages": [{"role": "user", "content": _long(2)}]}, _chat_token)
            responses = await _arrivals(
                client, url, "/v1/responses",
                {"model": MODEL_NAME, "stream": True, "max_output_tokens": 4,
                 "input": _long(3)},
                lambda line: any(m.decode() in line for m in RESPONSES_FIRST_TOKEN))
            return chat, responses

    chat, responses = asyncio.run(run())
    headers, first, token = chat
    assert token > 0.5, chat  # a prefill of ~20k tokens: long beside a network's time
    assert headers < 0.3 * token, chat  # the headers: before the prefill
    assert first > 0.8 * token, chat  # the first chunk: with the first token
    headers, first, token = responses
    assert token > 0.5, responses
    assert headers < 0.3 * token and first < 0.3 * token, responses  # created: before it
