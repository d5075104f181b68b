"""The simulator's streamed answer to a chat or completions request (I/O): the SSE chunks
vLLM writes as the engine's tokens come (responses.ChunkWriter shapes each), a tool call's
pieces as the parser streams them (toolcalls.ToolStream), the usage chunk and the
`--timing-comments` comment before `data: [DONE]`.

`include_usage` (or the server's `--enable-force-include-usage`) adds the usage chunk;
`continuous_usage_stats` a running usage on every chunk. A request the engine did not
finish (the simulator shutting down) ends in vLLM's mid-stream error event. P/D: the last
token leases the decode replica's KV through the connector, whose params ride on the last
chunk when the connector streams them.
"""

from __future__ import annotations

import time
from typing import Literal

from gateway.sim import protocol
from gateway.sim.asgi import Send
from gateway.sim.connector import KvConnector
from gateway.sim.errors import ApiError
from gateway.sim.host import timing
from gateway.sim.replica import Pending
from gateway.sim.responses import ChunkWriter, Contract, UsagePolicy, running_usage
from gateway.sim.tokenizer import Tokenizer
from gateway.sim.toolcalls import PlannedCall, ToolStream

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
]
ABORTED = ApiError(503, "The request was aborted (simulator shutting down).")


class ChatStream:
    def __init__(self, *, model: str, contract: Contract, policy: UsagePolicy,
                 tokenizer: Tokenizer, connector: KvConnector | None,
                 force_include_usage: bool, timing_comments: bool) -> None:
        self.model = model
        self.contract = contract
        self.policy = policy
        self.tokenizer = tokenizer
        self.connector = connector
        self.force_include_usage = force_include_usage
        self.timing_comments = timing_comments

    async def __call__(
        self,
        send: Send,
        endpoint: Literal["chat", "completions"],
        gen: protocol.GenerationParams,
        pending: Pending,
        rid: str,
        call: PlannedCall | None = None,
    ) -> None:
        force = self.force_include_usage
        include_usage = gen.include_usage or force
        continuous = (gen.continuous_usage and gen.include_usage) or force
        req = pending.request
        writer = ChunkWriter(endpoint, rid, int(time.time()), self.model, self.contract)
        prompt = req.num_prompt_tokens
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*SSE_HEADERS, (b"x-request-id", rid.split("-", 1)[1].encode())],
            }
        )
        more = {"type": "http.response.body", "body": b"", "more_body": True}
        first = True
        produced = 0
        piece = self.tokenizer.piece
        queue = pending.queue
        tools = None if call is None else ToolStream(call, writer)
        while True:
            token = await queue.get()
            if token is None:
                break
            prompt_ids = req.token_ids[:prompt] if gen.return_token_ids and first else None
            if first and endpoint == "chat":
                more["body"] = writer.role(running_usage(prompt, 0) if continuous else None,
                                           prompt_ids)
                await send(more)
                prompt_ids = None
            first = False
            produced += 1
            finished = req.status == "finished" and produced == req.num_output_tokens
            if finished and self.connector is not None:
                params = self.connector.answer(req)  # leases D's KV, sent or not
                if self.connector.config.stream_params:
                    writer.set_kv_transfer(params)
            text = "" if token == req.stop_token and req.finish_reason == "stop" else piece(token)
            usage = running_usage(prompt, produced) if continuous else None
            if tools is not None:
                body = tools.token(text, req.finish_reason if finished else None, usage,
                                   finished and not include_usage)
                if body:
                    more["body"] = body
                    await send(more)
                continue
            more["body"] = writer.content(
                text, req.finish_reason if finished else None, usage,
                last=finished and not include_usage,
                token_ids=[token] if gen.return_token_ids else None, prompt_ids=prompt_ids,
            )
            await send(more)
        if req.status != "finished":
            # Same as above; vLLM reports a mid-stream failure as an error event.
            await send(
                {
                    "type": "http.response.body",
                    "more_body": False,
                    "body": ChunkWriter.error(ABORTED.body()) + ChunkWriter.DONE,
                }
            )
            return
        tail = b""
        if include_usage:
            tail += writer.usage(
                self.policy.usage(
                    prompt, req.num_output_tokens, req.usage_cached,
                    created=endpoint == "chat",
                )
            )
        if self.timing_comments:
            tail += ChunkWriter.comment("sim-timing", timing(req))
        await send(
            {"type": "http.response.body", "body": tail + ChunkWriter.DONE, "more_body": False}
        )
