"""Exact engine tokens of recorded requests, for the bound: vLLM's `/tokenize`.

`/tokenize` with `messages` (+ `tools`) applies the chat template exactly as the chat
endpoint does, so its ids are what the engine prefills and hashes. For what the engine
could also have cached from a request's decoding, the request's messages plus its reply
as a final assistant message are tokenized with `continue_final_message` (no end token):
prompt + generated text. Servers that do not support that form just give no extension.

Calls run after the measured run (they would disturb its timing otherwise), a few at a
time, against a replica directly (a gateway need not forward `/tokenize`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from gateway.bench.bound import BoundInput


class TokenizeError(RuntimeError):
    pass


async def _tokenize(
    http: aiohttp.ClientSession, url: str, payload: dict[str, Any]
) -> list[int] | None:
    async with http.post(
        url, data=orjson.dumps(payload), headers={"content-type": "application/json"}
    ) as resp:
        if resp.status != 200:
            return None
        tokens = orjson.loads(await resp.read()).get("tokens")
        return [int(t) for t in tokens] if isinstance(tokens, list) else None


def _chat_payload(body: dict[str, Any], reply: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": body.get("model"), "messages": body["messages"]}
    if body.get("tools"):
        payload["tools"] = body["tools"]
    if reply is not None:
        payload["messages"] = [*body["messages"], {"role": "assistant", "content": reply}]
        payload["add_generation_prompt"] = False
        payload["continue_final_message"] = True
    return payload


async def engine_tokens(
    base_url: str,
    bodies: Sequence[dict[str, Any]],
    replies: Sequence[str],
    concurrency: int = 4,
    timeout_s: float = 120.0,
) -> list[BoundInput]:
    """BoundInput per body (chat bodies with `messages`, or completions with `prompt`)."""
    url = base_url.rstrip("/") + "/tokenize"
    gate = asyncio.Semaphore(concurrency)

    async def one(http: aiohttp.ClientSession, body: dict[str, Any], reply: str) -> BoundInput:
        async with gate:
            if "messages" in body:
                prompt = await _tokenize(http, url, _chat_payload(body, None))
                full = await _tokenize(http, url, _chat_payload(body, reply)) if reply else None
            else:
                payload = {"model": body.get("model"), "prompt": body["prompt"]}
                prompt = await _tokenize(http, url, payload)
                full = None
                if reply and prompt is not None:
                    full = await _tokenize(http, url, {**payload, "prompt": body["prompt"] + reply})
        if prompt is None:
            raise TokenizeError(f"{url} did not tokenize a recorded request")
        return BoundInput(prompt=prompt, cacheable=full)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        return list(
            await asyncio.gather(*(one(http, b, r) for b, r in zip(bodies, replies, strict=True)))
        )
