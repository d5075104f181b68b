"""Parity probe for one replica (I/O): send a probe's messages to the replica's
`/tokenize` and compare with the gateway's rendering (events/parity.py decides). Run at
start-up and on demand for `/stats`; the first `BlockStored` the probe causes, when the
caller has it, is compared too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from gateway.events.decode import BlockStored
from gateway.events.parity import Parity, check
from gateway.tokens.render import TokenRenderer, chat_messages

MAX_BODY = 4 * 1024 * 1024

# A probe long enough to fill several blocks at any usual block size, with a tool so the
# template's tools branch is exercised too.
PROBE: dict[str, Any] = {
    "messages": [
        {"role": "user", "content": " ".join(f"probe word {i} of the gateway parity check."
                                             for i in range(60))},
    ],
    "tools": [{"type": "function", "function": {
        "name": "lookup", "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}],
}


async def tokenize(session: aiohttp.ClientSession, base_url: str, model: str,
                   body: dict[str, Any], timeout_s: float = 10.0,
                   headers: Mapping[str, str] | None = None) -> list[int] | None:
    """The replica's token ids for the chat body; None when it has no /tokenize."""
    payload = {"model": model, "messages": body["messages"], "add_generation_prompt": True}
    if body.get("tools"):
        payload["tools"] = body["tools"]
    async with session.post(base_url.rstrip("/") + "/tokenize", json=payload,
                            timeout=aiohttp.ClientTimeout(total=timeout_s),
                            headers=headers) as resp:
        if resp.status in (404, 405):
            return None
        raw = await resp.content.read(MAX_BODY + 1)
        if resp.status != 200 or len(raw) > MAX_BODY:
            return None
    import json

    try:
        tokens = json.loads(raw).get("tokens")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return None
    return tokens


async def probe(session: aiohttp.ClientSession, base_url: str, renderer: TokenRenderer,
                first_event: BlockStored | None = None,
                decode: Callable[[Sequence[int]], str] | None = None,
                body: dict[str, Any] | None = None,
                headers: Mapping[str, str] | None = None) -> Parity:
    body = body or PROBE
    theirs = await tokenize(session, base_url, renderer.model, body, headers=headers)
    ours = renderer.token_ids(body, "chat")
    rendered = ""
    if renderer.template is not None:
        tools = body.get("tools")
        rendered = renderer.template.render(chat_messages(body),
                                            tools if isinstance(tools, list) else None)
    return check(rendered, ours, renderer.block_size, theirs, first_event, decode)
