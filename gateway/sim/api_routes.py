"""The simulator's handlers for `POST /v1/responses` and `POST /v1/messages` (I/O).

Both render their request as the chat request vLLM builds from it, tokenize it and run it
on the replica's engine like a chat completion (same prefix cache, same disconnect
handling: a client that goes away aborts the request in the engine); only the wire
shapes differ (gateway.sim.responses_api, gateway.sim.messages_api). The Responses store
belongs to this replica and lives as long as the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response

from gateway.sim import messages_api, protocol
from gateway.sim import responses_api as rapi
from gateway.sim.asgi import (
    Receive,
    Scope,
    Send,
    read_body,
    request_id,
    watch_disconnect,
    whole,
)
from gateway.sim.errors import ApiError
from gateway.sim.hashing import salt_key
from gateway.sim.host import RouteHost, timing
from gateway.sim.replica import Pending
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import IM_END_ID

_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_ABORTED = ApiError(503, "The request was aborted (simulator shutting down).")


class ApiRoutes:
    def __init__(self, app: RouteHost, *, store: bool) -> None:
        self.app = app
        self.store = rapi.ResponseStore() if store else None

    # -- shared -------------------------------------------------------------------------

    def _prompt(self, chat: protocol.ChatParams) -> tuple[list[int], int | None]:
        self.app._check_model(chat.gen.model)
        ids = self.app.tokenizer.encode(render_chat(chat.messages, chat.tools, True, False))
        return ids, self.app._check_length(len(ids), chat.gen.max_tokens)

    @contextlib.asynccontextmanager
    async def _run(self, receive: Receive, rid: str, ids: list[int], max_tokens: int | None,
                   chat: protocol.ChatParams) -> AsyncIterator[Pending]:
        replica = self.app.replica
        req = replica.engine.new_request(rid, ids, max_tokens, replica.arrive(), IM_END_ID,
                                         salt_key(chat.gen.cache_salt))
        replica.in_flight += 1
        try:
            pending = replica.submit(req, streaming=chat.gen.stream)
            watcher = asyncio.ensure_future(watch_disconnect(receive, replica, pending))
            try:
                yield pending
            finally:
                watcher.cancel()
                replica.abort(pending)  # no-op once finished
        finally:
            replica.in_flight -= 1

    def _timing(self, pending: Pending) -> dict[str, Any] | None:
        """`--timing-comments`: the simulated latencies, as the chat routes report them."""
        if not self.app.config.timing_comments:
            return None
        return timing(pending.request)

    def _timing_header(self, pending: Pending) -> list[tuple[bytes, bytes]]:
        timing = self._timing(pending)
        return [] if timing is None else [(b"x-sim-timing", orjson.dumps(timing))]

    def _timing_comment(self, pending: Pending) -> bytes:
        timing = self._timing(pending)
        return b"" if timing is None else b": sim-timing " + orjson.dumps(timing) + b"\n\n"

    def _text(self, pending: Pending) -> str:
        req = pending.request
        out = req.output_ids[:-1] if req.finish_reason == "stop" else req.output_ids
        return self.app.tokenizer.decode(out)

    async def _tokens(self, pending: Pending) -> AsyncIterator[str]:
        req = pending.request
        piece = self.app.tokenizer.piece
        while True:
            token = await pending.queue.get()
            if token is None:
                return
            if token == req.stop_token and req.finish_reason == "stop":
                continue
            yield piece(token)

    # -- Responses ----------------------------------------------------------------------

    async def responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = protocol.parse_json(await read_body(receive))
        params = rapi.parse_responses(body, self.store)
        chat = params.chat
        ids, max_tokens = self._prompt(chat)
        rid = rapi.new_id("resp_")
        item_id = rapi.new_id("msg_")
        created = int(time.time())
        model = self.app.config.model
        headers = [(b"x-request-id", request_id(scope).encode())]
        async with self._run(receive, rid, ids, max_tokens, chat) as pending:
            req = pending.request
            if not chat.gen.stream:
                await pending.queue.get()
                if req.status != "finished":
                    await whole(_ABORTED.body(), 503)(scope, receive, send)
                    return
                text = self._text(pending)
            else:
                events = rapi.ResponsesEvents()
                start = rapi.response_object(rid, created, model, params, [], "in_progress",
                                             None)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [*_SSE, *headers]})
                more = {"type": "http.response.body", "more_body": True,
                        "body": events.opening(start, item_id)}
                await send(more)
                pieces: list[str] = []
                async for piece in self._tokens(pending):
                    pieces.append(piece)
                    more["body"] = events.delta(item_id, piece)
                    await send(more)
                if req.status != "finished":
                    await send({"type": "http.response.body", "more_body": False,
                                "body": events.event("error", {
                                    "code": None, "message": _ABORTED.message, "param": None})})
                    return
                text = "".join(pieces)
            incomplete = "max_output_tokens" if req.finish_reason == "length" else None
            response = rapi.response_object(
                rid, created, model, params,
                [rapi.message_item(item_id, text, "completed")],  # as vLLM, even when cut
                "incomplete" if incomplete else "completed",
                rapi.usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens),
                incomplete)
            if self.store is not None and params.store:
                self.store.put(rid, [*params.history, {"role": "assistant", "content": text}],
                               response)
            if chat.gen.stream:
                await send({"type": "http.response.body", "more_body": False,
                            "body": self._timing_comment(pending)
                            + events.closing(response, item_id, text)})
            else:
                await whole(orjson.dumps(response), 200,
                            [*headers, *self._timing_header(pending)])(scope, receive, send)

    def stored(self, response_id: str, action: str) -> Response:
        """`GET /v1/responses/{id}` (the stored response object) and `POST .../cancel`
        (vLLM cancels background responses only: a stored one is a 400), 404 for an id this
        replica does not hold or while the store is off."""
        found = self.store.response(response_id) if self.store is not None else None
        if found is None:
            raise rapi.not_found(response_id)
        if action == "cancel":
            raise rapi.cannot_cancel()
        return whole(orjson.dumps(found))

    # -- Messages -----------------------------------------------------------------------

    async def messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._messages(scope, receive, send)
        except ApiError as e:
            await whole(messages_api.error_body(e), e.status)(scope, receive, send)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = messages_api.parse_messages(protocol.parse_json(await read_body(receive)))
        ids, max_tokens = self._prompt(chat)
        # vLLM answers with the id of the chat completion it ran
        mid = "chatcmpl-" + request_id(scope)
        model = self.app.config.model
        details = self.app.config.prompt_tokens_details
        headers = [(b"x-request-id", mid.split("-", 1)[1].encode())]
        async with self._run(receive, mid, ids, max_tokens, chat) as pending:
            req = pending.request
            if not chat.gen.stream:
                await pending.queue.get()
                if req.status != "finished":
                    await whole(messages_api.error_body(_ABORTED), 503)(scope, receive, send)
                    return
                use = messages_api.usage(req.num_prompt_tokens, req.num_output_tokens,
                                         req.num_cached_tokens if details else None)
                body = messages_api.message_body(mid, model, self._text(pending),
                                                 req.finish_reason, use)
                await whole(body, 200,
                            [*headers, *self._timing_header(pending)])(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*_SSE, *headers]})
            more = {"type": "http.response.body", "more_body": True, "body": b""}
            opened = False
            async for piece in self._tokens(pending):
                chunk = messages_api.delta(piece)
                if not opened:
                    # vLLM writes message_start with its first chat chunk (after the
                    # prefill), with the prompt as known then and nothing generated.
                    first = messages_api.usage(req.num_prompt_tokens, 0, None)
                    chunk = messages_api.opening(mid, model, first) + chunk
                    opened = True
                more["body"] = chunk
                await send(more)
            if req.status != "finished":
                await send({"type": "http.response.body", "more_body": False,
                            "body": messages_api.stream_error(_ABORTED)})
                return
            use = messages_api.usage(req.num_prompt_tokens, req.num_output_tokens,
                                     req.num_cached_tokens if details else None)
            tail = self._timing_comment(pending) + messages_api.closing(req.finish_reason, use)
            if not opened:
                tail = messages_api.opening(mid, model, use) + tail
            await send({"type": "http.response.body", "more_body": False, "body": tail})
