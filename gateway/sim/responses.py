"""Response bodies and SSE chunks in vLLM's exact shapes (contract sections 2.4-2.6).

Non-streaming bodies are a full ``model_dump()``: every field present, ``null`` when unset.
Usage keys come in vLLM's order (prompt_tokens, total_tokens, completion_tokens,
prompt_tokens_details). ``UsagePolicy`` decides whether ``prompt_tokens_details`` is filled:
never without ``--enable-prompt-tokens-details``; with it, always for contract >= 0.24 and
only when cached > 0 for 0.23. Contract 0.32 (the default, the vLLM that runs here) adds
``created_cache_tokens`` (the full blocks this request added to the cache),
``multimodal_tokens`` and ``completion_tokens_details`` to usage, and the 0.32 body fields
(``routed_experts``, ``prompt_text``, ``ec_transfer_params``, ``metrics``, a
``system_fingerprint``); a message without tool calls carries no ``tool_calls`` key there.

Stream chunks are built from prefix bytes once per request so a token costs one small
``orjson.dumps`` of its text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

Endpoint = Literal["chat", "completions"]
Contract = Literal["0.23", "0.24", "0.32"]
CURRENT: Contract = "0.32"
_FINGERPRINT = "vllm-0.32.0-sim"


@dataclass(frozen=True, kw_only=True)
class UsagePolicy:
    details: bool = True
    contract: Contract = CURRENT
    block_size: int = 16

    def usage(
        self, prompt: int, completion: int, cached: int, created: bool = True
    ) -> dict[str, Any]:
        """`created`: report created_cache_tokens (0.32 does on chat, never on completions)."""
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }
        if self.details and (cached > 0 or self.contract != "0.23"):
            details: dict[str, Any] = {"cached_tokens": cached}
            if self.contract == "0.32":
                # Only full blocks enter the cache; the cached ones were there already.
                full = prompt // self.block_size * self.block_size
                # vLLM reports null when the prompt fills no block at all.
                details["created_cache_tokens"] = (
                    max(0, full - cached) if full and created else None
                )
                details["multimodal_tokens"] = None
            out["prompt_tokens_details"] = details
        if self.contract == "0.32":
            out["completion_tokens_details"] = None
        return out



def chat_body(
    rid: str, created: int, model: str, text: str, finish: str, usage: dict[str, Any],
    *, contract: Contract = CURRENT, tool_calls: list[dict[str, Any]] | None = None,
    tool_content: str | None = None, kv_transfer: dict[str, Any] | None = None,
    ids: tuple[list[int], list[int]] | None = None,
) -> bytes:
    """`kv_transfer`: the answer's kv_transfer_params (a P/D leg's; else null). `ids`:
    (prompt ids, generated ids) when the request asked `return_token_ids`.
    `tool_calls`: the parsed calls; then `content` is `tool_content`: null as vLLM's
    hermes parser leaves it when the reply is nothing but calls ("auto"), "" for a named
    or "required" choice."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": tool_content if tool_calls else text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": tool_calls or [],
        "reasoning": None,
    }
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": None if ids is None else ids[1],
    }
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": None if ids is None else ids[0],
        "kv_transfer_params": kv_transfer,
    }
    if contract == "0.32" and not tool_calls:
        del message["tool_calls"]  # 0.32 leaves an empty tool_calls list out
        choice["routed_experts"] = None
        body["system_fingerprint"] = _FINGERPRINT
        kv = body.pop("kv_transfer_params")
        body.update(prompt_text=None, kv_transfer_params=kv, ec_transfer_params=None, metrics=None)
    return orjson.dumps(body)


def completion_body(
    rid: str, created: int, model: str, text: str, finish: str, usage: dict[str, Any],
    *, contract: Contract = CURRENT, kv_transfer: dict[str, Any] | None = None,
    ids: tuple[list[int], list[int]] | None = None,
) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None if ids is None else ids[0],
        "token_ids": None if ids is None else ids[1],
    }
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "kv_transfer_params": kv_transfer,
    }
    if contract == "0.32":
        choice = {k: choice[k] for k in _COMPLETION_CHOICE_032}
        choice["routed_experts"] = None
        body["choices"] = [choice]
        body["system_fingerprint"] = _FINGERPRINT
        body.update(ec_transfer_params=None, metrics=None)
    return orjson.dumps(body)


_COMPLETION_CHOICE_032 = (
    "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
    "prompt_token_ids",
)  # fmt: skip


class ChunkWriter:
    """The SSE events of one streamed response."""

    def __init__(
        self, endpoint: Endpoint, rid: str, created: int, model: str,
        contract: Contract = CURRENT,
    ) -> None:
        self.current = contract == "0.32"
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        self.endpoint = endpoint
        # The stream's last chunk carries this (a P/D leg's kv_transfer_params), set by the
        # caller once the request has finished.
        self.final_extra = b""
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

    def role(self, usage: dict[str, Any] | None, prompt_ids: list[int] | None = None) -> bytes:
        tail = b',"prompt_token_ids":' + _ids(prompt_ids)
        tail += b',"prompt_text":null' if self.current else b""
        tail += _usage_tail(usage) + b"}\n\n"
        return (
            self._head + b'[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]' + tail
        )

    def content(
        self, text: str, finish: str | None, usage: dict[str, Any] | None, last: bool = False,
        token_ids: list[int] | None = None, prompt_ids: list[int] | None = None,
    ) -> bytes:
        """`last`: no usage chunk follows, so 0.32 puts system_fingerprint on this one.
        `token_ids` (this chunk's) and `prompt_ids` (completions' first chunk): asked by
        `return_token_ids`, else null."""
        t = orjson.dumps(text)
        ids = _ids(token_ids)
        if self.endpoint == "chat":
            choice = b'[{"index":0,"delta":{"content":' + t + b'},"logprobs":null,'
            if finish is None:
                choice += b'"finish_reason":null,"token_ids":' + ids + b'}]'
            else:
                choice += (
                    b'"finish_reason":"'
                    + finish.encode()
                    + b'","stop_reason":null,"token_ids":' + ids + b'}]'
                )
        else:
            fin = b"null" if finish is None else b'"' + finish.encode() + b'"'
            choice = (
                b'[{"index":0,"text":'
                + t
                + b',"logprobs":null,"finish_reason":'
                + fin
                + (b',"stop_reason":null,"prompt_token_ids":' + _ids(prompt_ids)
                   + b',"token_ids":' + ids + b'}]'
                   if self.current else b',"stop_reason":null}]')
            )
        tail = _usage_tail(usage)
        if last and self.current:
            tail += b',"system_fingerprint":"' + _FINGERPRINT.encode() + b'"'
        if last:
            tail += self.final_extra
        return self._head + choice + tail + b"}\n\n"

    def delta(
        self, delta: dict[str, Any], finish: str | None, usage: dict[str, Any] | None,
        last: bool = False,
    ) -> bytes:
        """A chat chunk with any delta (tool-call deltas, the empty finish delta)."""
        choice = b'[{"index":0,"delta":' + orjson.dumps(delta) + b',"logprobs":null,'
        if finish is None:
            choice += b'"finish_reason":null,"token_ids":null}]'
        else:
            choice += b'"finish_reason":"' + finish.encode() + b'","stop_reason":null,' \
                b'"token_ids":null}]'
        tail = _usage_tail(usage)
        if last and self.current:
            tail += b',"system_fingerprint":"' + _FINGERPRINT.encode() + b'"'
        if last:
            tail += self.final_extra
        return self._head + choice + tail + b"}\n\n"

    def usage(self, usage: dict[str, Any]) -> bytes:
        # exclude_none: the final usage chunk carries no nulls (0.32: nested ones neither).
        clean = {k: v for k, v in usage.items() if v is not None}
        tail = b""
        if self.current:
            details = clean.get("prompt_tokens_details")
            if isinstance(details, dict):
                clean["prompt_tokens_details"] = {
                    k: v for k, v in details.items() if v is not None
                }
            tail = b',"system_fingerprint":"' + _FINGERPRINT.encode() + b'"'
        tail += self.final_extra
        return self._head + b'[],"usage":' + orjson.dumps(clean) + tail + b"}\n\n"

    @staticmethod
    def error(body: bytes) -> bytes:
        return b"data: " + body + b"\n\n"

    @staticmethod
    def comment(name: str, payload: dict[str, Any]) -> bytes:
        return b": " + name.encode() + b" " + orjson.dumps(payload) + b"\n\n"

    def set_kv_transfer(self, params: dict[str, Any] | None) -> None:
        self.final_extra = b"" if params is None else (
            b',"kv_transfer_params":' + orjson.dumps(params))

    DONE = b"data: [DONE]\n\n"


def _ids(ids: list[int] | None) -> bytes:
    return b"null" if ids is None else orjson.dumps(ids)


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
