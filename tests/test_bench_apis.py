"""gateway-bench --api: the chat body in the other APIs (table), and the bench client
reading each API's answers from a real simulator on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from gateway.bench.apis import APIS, PATHS, Api, to_api
from gateway.bench.client import Exchange, post
from tests.servers import sim

MODEL = "Qwen/Qwen2.5-7B-Instruct"
TOOL = {"type": "function", "function": {"name": "ls", "description": "list",
                                         "parameters": {"type": "object"}}}
CHAT = {"model": MODEL, "temperature": 0, "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}, "tools": [TOOL],
        "messages": [{"role": "system", "content": "S " * 300},
                     {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                     {"role": "user", "content": "q2"}]}


@pytest.mark.parametrize(("api", "expected"), [
    ("chat", CHAT),
    ("responses", {
        "model": MODEL, "stream": True, "temperature": 0, "instructions": "S " * 300,
        "input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "q2"}],
        "tools": [{"type": "function", "name": "ls", "description": "list",
                   "parameters": {"type": "object"}}],
        "max_output_tokens": 5}),
    ("messages", {
        "model": MODEL, "stream": True, "temperature": 0, "system": "S " * 300,
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                     {"role": "user", "content": "q2"}],
        "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
        "max_tokens": 5}),
])
def test_to_api(api: Api, expected: dict[str, Any]) -> None:
    assert to_api(CHAT, api) == expected


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with sim(1, ["--speed", "100", "--timing-comments", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes"]) as (url,):
        yield url


async def _send(url: str, api: Api, stream: bool) -> Exchange:
    body = {**CHAT, "stream": stream}
    if not stream:
        del body["stream_options"]  # vLLM refuses stream_options without stream
    async with aiohttp.ClientSession() as http:
        return await post(http, url + PATHS[api], to_api(body, api))


@pytest.mark.parametrize("stream", [False, True])
def test_client_reads_every_api(replica: str, stream: bool) -> None:
    exchanges = {api: asyncio.run(_send(replica, api, stream)) for api in APIS}
    prompts = {ex.prompt_tokens for ex in exchanges.values()}
    assert len(prompts) == 1 and prompts.pop() is not None  # one rendered prompt
    for api, ex in exchanges.items():
        assert ex.status == 200 and ex.error is None, (api, ex.error)
        assert ex.text, api
        assert ex.completion_tokens is not None and ex.completion_tokens > 0, api
        assert ex.sim_timing is not None, api  # simulated latencies on every route
    # the first request warmed the cache for the other two
    assert exchanges["responses"].cached_tokens == exchanges["messages"].cached_tokens
    cached = exchanges["responses"].cached_tokens
    assert cached is not None and cached >= 300
