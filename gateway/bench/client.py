"""One OpenAI-compatible call over aiohttp, streamed or not, measured.

`post()` sends a chat or completions body and returns an `Exchange`: the answer text, the
usage the engine reported (streams: the final chunk, with `stream_options.include_usage`),
the gateway's routing headers, the simulator's timing (`x-sim-timing` header or the
`: sim-timing {json}` SSE comment, SIMULATED milliseconds) and the wall-clock TTFT and
latency measured here. Reports prefer the simulator's figures and fall back to wall clock.

SSE parsing is line based: `data:` lines carry JSON chunks, `:` lines are comments.
Responses and Messages answers (`/v1/responses`, `/v1/messages`) are read too: their text
from the output items / content blocks (`response.output_text.delta`,
`content_block_delta` in streams) and their usage normalized as the gateway records it
(`gateway.usage.extract`: prompt = uncached + cached for Messages).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.usage.extract import parse_answer, usage_from_mapping


@dataclass(kw_only=True)
class Exchange:
    status: int = 0
    error: str | None = None
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    wall_ttft_ms: float | None = None
    wall_e2e_ms: float = 0.0
    sim_timing: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    api_usage: dict[str, Any] = field(default_factory=dict)  # Messages: start + delta
    # chat: the answer's tool calls (streamed deltas merged), as a message carries them
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def merge_tool_calls(calls: list[dict[str, Any]], deltas: Any) -> None:
    """Fold streamed tool-call deltas into whole calls: the first delta of an index brings
    its id, type and name, the later ones fragments of its arguments."""
    if not isinstance(deltas, list):
        return
    for d in deltas:
        if not isinstance(d, dict):
            continue
        index = d.get("index", len(calls))
        if not isinstance(index, int) or not 0 <= index <= len(calls):
            continue  # out of order: not a stream this client understands
        if index == len(calls):
            calls.append({"id": "", "type": "function",
                          "function": {"name": "", "arguments": ""}})
        call = calls[index]
        if d.get("id"):
            call["id"] = str(d["id"])
        fn = d.get("function")
        if isinstance(fn, dict):
            if fn.get("name"):
                call["function"]["name"] = str(fn["name"])
            call["function"]["arguments"] += str(fn.get("arguments") or "")


def _api_usage(ex: Exchange, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    ex.api_usage.update(usage)
    u = usage_from_mapping(ex.api_usage)
    if u is not None:
        ex.prompt_tokens, ex.completion_tokens, ex.cached_tokens = (
            u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def _api_event(ex: Exchange, chunk: dict[str, Any], parts: list[str]) -> None:
    kind = chunk.get("type")
    if kind == "response.output_text.delta":
        parts.append(str(chunk.get("delta") or ""))
    elif kind == "content_block_delta":
        delta = chunk.get("delta")
        if isinstance(delta, dict):
            parts.append(str(delta.get("text") or ""))
    elif kind == "response.completed":
        response = chunk.get("response")
        if isinstance(response, dict):
            _api_usage(ex, response.get("usage"))
    elif kind == "message_start":
        message = chunk.get("message")
        if isinstance(message, dict):
            _api_usage(ex, message.get("usage"))
    elif kind == "message_delta":
        _api_usage(ex, chunk.get("usage"))


def _usage(ex: Exchange, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    ex.prompt_tokens = usage.get("prompt_tokens")
    ex.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        ex.cached_tokens = details.get("cached_tokens")


def _choice_text(choice: Any, chat: bool, stream: bool) -> str:
    if not isinstance(choice, dict):
        return ""
    if not chat:
        return str(choice.get("text") or "")
    part = choice.get("delta" if stream else "message") or {}
    return str(part.get("content") or "") if isinstance(part, dict) else ""


def _sse_line(ex: Exchange, line: bytes, chat: bool, parts: list[str]) -> None:
    if line.startswith(b":"):
        comment = line[1:].strip()
        if comment.startswith(b"sim-timing"):
            ex.sim_timing = orjson.loads(comment[len(b"sim-timing") :])
        return
    if not line.startswith(b"data:"):
        return
    data = line[5:].strip()
    if not data or data == b"[DONE]":
        return
    chunk = orjson.loads(data)
    if "type" in chunk and "choices" not in chunk:
        _api_event(ex, chunk, parts)
        return
    if chunk.get("usage"):
        _usage(ex, chunk["usage"])
    for choice in chunk.get("choices") or ():
        parts.append(_choice_text(choice, chat, stream=True))
        delta = choice.get("delta") if chat and isinstance(choice, dict) else None
        if isinstance(delta, dict) and delta.get("tool_calls"):
            merge_tool_calls(ex.tool_calls, delta["tool_calls"])


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Exchange:
    """POST body to url ('.../v1/chat/completions', '.../v1/completions',
    '.../v1/responses' or '.../v1/messages')."""
    chat = url.endswith("/chat/completions")
    api = url.endswith(("/v1/responses", "/v1/messages"))
    stream = bool(body.get("stream"))
    ex = Exchange()
    start = time.perf_counter()
    try:
        async with http.post(
            url,
            data=orjson.dumps(body),
            headers={"content-type": "application/json", **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            ex.status = resp.status
            ex.headers = {k.lower(): v for k, v in resp.headers.items()}
            if resp.status != 200:
                ex.error = (await resp.text())[:300]
                return ex
            if not stream:
                ex.wall_ttft_ms = (time.perf_counter() - start) * 1000
                raw = await resp.read()
                timing = ex.headers.get("x-sim-timing")
                ex.sim_timing = orjson.loads(timing) if timing else None
                if api:
                    answer = parse_answer(raw)
                    if answer.usage is not None:
                        ex.prompt_tokens = answer.usage.prompt_tokens
                        ex.cached_tokens = answer.usage.cached_tokens
                        ex.completion_tokens = answer.usage.completion_tokens
                    ex.text = answer.text or ""
                    return ex
                payload = orjson.loads(raw)
                _usage(ex, payload.get("usage"))
                choices = payload.get("choices") or ()
                ex.text = "".join(_choice_text(c, chat, stream=False) for c in choices)
                message = choices[0].get("message") if chat and choices else None
                if isinstance(message, dict) and message.get("tool_calls"):
                    merge_tool_calls(ex.tool_calls, [
                        {**c, "index": i} for i, c in enumerate(message["tool_calls"])])
                return ex
            parts: list[str] = []
            buffer = b""
            async for chunk in resp.content.iter_any():
                if ex.wall_ttft_ms is None:
                    ex.wall_ttft_ms = (time.perf_counter() - start) * 1000
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    _sse_line(ex, line.rstrip(b"\r"), chat, parts)
            if buffer:
                _sse_line(ex, buffer.rstrip(b"\r"), chat, parts)
            ex.text = "".join(parts)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as e:
        ex.error = f"{type(e).__name__}: {e}"
    finally:
        ex.wall_e2e_ms = (time.perf_counter() - start) * 1000
    return ex
