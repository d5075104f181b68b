"""Response bodies and SSE chunks in vLLM's exact shapes (contract sections 2.4-2.6).

Non-streaming bodies are a full ``model_dump()``: every field present, ``null`` when unset.
Usage keys come in vLLM's order (prompt_tokens, total_tokens, completion_tokens,
prompt_tokens_details). ``UsagePolicy`` decides whether ``prompt_tokens_details`` is filled:
never without ``--enable-prompt-tokens-details``; with it, always for contract >= 0.24 and
only when cached > 0 for 0.23.

Stream chunks are built from prefix bytes once per request so a token costs one small
``orjson.dumps`` of its text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True, kw_only=True)
class UsagePolicy:
    details: bool = True
    contract: Literal["0.23", "0.24"] = "0.24"

    def usage(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }
        if self.details and (cached > 0 or self.contract != "0.23"):
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out


def chat_body(
    rid: str, created: int, model: str, text: str, finish: str, usage: dict[str, Any]
) -> bytes:
    return orjson.dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "kv_transfer_params": None,
        }
    )


def completion_body(
    rid: str, created: int, model: str, text: str, finish: str, usage: dict[str, Any]
) -> bytes:
    return orjson.dumps(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "token_ids": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "kv_transfer_params": None,
        }
    )


class ChunkWriter:
    """The SSE events of one streamed response."""

    def __init__(self, endpoint: Endpoint, rid: str, created: int, model: str) -> None:
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        self.endpoint = endpoint
        self._head = (
            b'data: {"id":'
            + orjson.dumps(rid)
            + b',"object":"'
            + obj.encode()
            + b'","created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(model)
            + b',"choices":'
        )

    def role(self, usage: dict[str, Any] | None) -> bytes:
        tail = b',"prompt_token_ids":null' + _usage_tail(usage) + b"}\n\n"
        return (
            self._head + b'[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]' + tail
        )

    def content(self, text: str, finish: str | None, usage: dict[str, Any] | None) -> bytes:
        t = orjson.dumps(text)
        if self.endpoint == "chat":
            choice = b'[{"index":0,"delta":{"content":' + t + b'},"logprobs":null,'
            if finish is None:
                choice += b'"finish_reason":null,"token_ids":null}]'
            else:
                choice += (
                    b'"finish_reason":"'
                    + finish.encode()
                    + b'","stop_reason":null,"token_ids":null}]'
                )
        else:
            fin = b"null" if finish is None else b'"' + finish.encode() + b'"'
            choice = (
                b'[{"index":0,"text":'
                + t
                + b',"logprobs":null,"finish_reason":'
                + fin
                + b',"stop_reason":null}]'
            )
        return self._head + choice + _usage_tail(usage) + b"}\n\n"

    def usage(self, usage: dict[str, Any]) -> bytes:
        # exclude_none: the final usage chunk carries no nulls.
        clean = {k: v for k, v in usage.items() if v is not None}
        return self._head + b'[],"usage":' + orjson.dumps(clean) + b"}\n\n"

    @staticmethod
    def error(body: bytes) -> bytes:
        return b"data: " + body + b"\n\n"

    @staticmethod
    def comment(name: str, payload: dict[str, Any]) -> bytes:
        return b": " + name.encode() + b" " + orjson.dumps(payload) + b"\n\n"

    DONE = b"data: [DONE]\n\n"


def _usage_tail(usage: dict[str, Any] | None) -> bytes:
    if usage is None:
        return b""
    return b',"usage":' + orjson.dumps(usage)


def running_usage(prompt: int, completion: int) -> dict[str, Any]:
    """Continuous per-chunk usage: no details (vLLM never attaches them there)."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
