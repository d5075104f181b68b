"""A raw asyncio "vLLM" on loopback that answers P/D legs as vLLM 0.32 with NixlConnector
does (real-vllm-pd.md), for the gateway's P/D tests, and records every inference request
it read whole (its body and X-Request-Id).

- a prefill leg (`kv_transfer_params.do_remote_decode` true): one token and P's params
  (`do_remote_prefill` true, `remote_block_ids`, `remote_engine_id`, `remote_host/port`,
  `remote_num_tokens`, `remote_prefill_cached_tokens`);
- a decode leg (`do_remote_prefill` true): the answer, streamed or not as asked, with
  `cached_tokens` = P's `remote_prefill_cached_tokens` (vLLM >= 0.32); it carries D's
  own `kv_transfer_params` (`bidirectional_kv_xfer`, `remote_engine_id` "<name>-d") in
  its body, or streamed on its final chunk;
- anything else: a whole request, answered as one replica does.

`mode` makes a leg fail: "500", "400" (answered), "read-close" (read, then the connection
closes without an answer), "hang" (read, never answered), "noparams" (a prefill answer
without params: an engine without a KV connector), "cut" (the answer's head and part of
its body, then the connection closes: a non-streamed body cut short, or a stream cut
after its first event). Each answer's text names the replica
and the leg, so a test sees who answered what.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson

from tests.recording_replica import MODELS, SSE_HEAD, chunk, response

PROMPT_TOKENS = 150
P_CACHED = 32


class PdReplica:
    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name = name
        self.mode = mode
        self.params_on_whole = False  # its own params on a whole request's answer too
        # what a prefill leg's answer reports cached (its hits and any pulled), in its usage
        # and as `remote_prefill_cached_tokens`
        self.prefill_cached = P_CACHED
        # False: a prefill answer's usage has no prompt_tokens_details (an engine without
        # --enable-prompt-tokens-details); its params still carry the count
        self.prefill_details = True
        # set: a prefill leg is held (`holding` set) until it is set
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()
        # a reasoning model's answer: the message's (or a stream's first delta's) reasoning
        # field (name, text), which the engine generated (its KV holds it) but a client's
        # next turn does not send back
        self.reasoning: tuple[str, str] | None = None
        self.closed = asyncio.Event()  # a "hang" leg's connection was closed by the gateway
        self.bodies: list[dict[str, Any]] = []
        self.request_ids: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def received(self) -> int:
        return len(self.bodies)

    def legs(self) -> list[str]:
        return [leg(b) for b in self.bodies]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length, rid = 0, b""
                for h in head.split(b"\r\n")[1:]:
                    key, _, value = h.partition(b":")
                    if key.lower() == b"content-length":
                        length = int(value)
                    elif key.lower() == b"x-request-id":
                        rid = value.strip()
                body = await reader.readexactly(length) if length else b""
                if head.startswith(b"GET /v1/models"):
                    writer.write(response("200 OK", MODELS))
                    continue
                if not head.startswith(b"POST"):
                    writer.write(response("200 OK", b"{}"))
                    continue
                doc = orjson.loads(body)
                self.bodies.append(doc)
                self.request_ids.append(rid)
                if not await self._answer(doc, reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, doc: dict[str, Any], reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        which = leg(doc)
        failing = self.mode if which != "whole" else "ok"
        if failing == "read-close":
            return False
        if failing == "hang":  # never answers; waits for the gateway to close
            await reader.read()
            self.closed.set()
            return False
        if failing == "500":
            writer.write(response("500 Internal Server Error",
                                  b'{"error":{"message":"KV load failed"}}'))
            return True
        if failing == "400":
            writer.write(response("400 Bad Request", b'{"error":{"message":"bad"}}'))
            return True
        params = doc.get("kv_transfer_params") or {}
        cached = params.get("remote_prefill_cached_tokens", 0) if which == "decode" else 0
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1,
                 "total_tokens": PROMPT_TOKENS + 1,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        text = f"{self.name}:{which}"
        if which == "prefill":
            if self.hold is not None:
                self.holding.set()
                await self.hold.wait()
            details = ({"prompt_tokens_details": {"cached_tokens": self.prefill_cached}}
                       if self.prefill_details else {})
            answer: dict[str, Any] = {"id": "c", "object": "chat.completion", "model": "m",
                                      "choices": [{"index": 0, "finish_reason": "length",
                                                   "message": {"role": "assistant",
                                                               "content": text}}],
                                      "usage": {**{k: v for k, v in usage.items()
                                                   if k != "prompt_tokens_details"},
                                                **details}}
            if failing != "noparams":
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_block_ids": [[1, 2, 3, 4]], "remote_engine_id": self.name,
                    "remote_request_id": "r", "remote_host": "127.0.0.1",
                    "remote_port": self.port, "tp_size": 1, "remote_num_tokens": 128,
                    "remote_prefill_cached_tokens": self.prefill_cached}
            writer.write(response("200 OK", orjson.dumps(answer)))
            return True
        own = {"do_remote_decode": True, "do_remote_prefill": False,
               "remote_block_ids": [[7, 8]], "remote_engine_id": f"{self.name}-d",
               "remote_host": "127.0.0.1", "remote_port": self.port,
               "remote_num_tokens": PROMPT_TOKENS + 1, "remote_blocks_expiry_time": 480.0}
        if doc.get("stream"):
            event: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                                     "choices": [{"index": 0, "delta": {"content": text},
                                                  "finish_reason": "stop"}]}
            if which == "decode":  # its own, on the final chunk (bidirectional_kv_xfer)
                event["kv_transfer_params"] = own
            out = SSE_HEAD
            if self.reasoning is not None:  # the thinking streams first, in its own events
                think = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                         "choices": [{"index": 0, "delta": {self.reasoning[0]:
                                                            self.reasoning[1]}}]}
                out += chunk(b"data: " + orjson.dumps(think) + b"\n\n")
            out += chunk(b"data: " + orjson.dumps(event) + b"\n\n")
            if failing == "cut":
                writer.write(out)
                await writer.drain()
                return False
            if (doc.get("stream_options") or {}).get("include_usage"):
                tail = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                        "choices": [], "usage": usage}
                out += chunk(b"data: " + orjson.dumps(tail) + b"\n\n")
            writer.write(out + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return True
        answer = {"id": "c", "object": "chat.completion", "model": "m",
                  "choices": [{"index": 0, "finish_reason": "stop",
                               "message": {"role": "assistant", "content": text}}],
                  "usage": usage}
        if self.reasoning is not None:
            answer["choices"][0]["message"][self.reasoning[0]] = self.reasoning[1]
        if which == "decode" or self.params_on_whole:  # bidirectional_kv_xfer: its own
            answer["kv_transfer_params"] = own
        whole = response("200 OK", orjson.dumps(answer))
        if failing == "cut":
            writer.write(whole[:len(whole) - 20])
            await writer.drain()
            return False
        writer.write(whole)
        return True


def leg(doc: dict[str, Any]) -> str:
    """Which leg a body is: "prefill", "decode" or "whole"."""
    params = doc.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_decode"):
        return "prefill"
    if isinstance(params, dict) and params.get("do_remote_prefill"):
        return "decode"
    return "whole"
