"""The simulator's handlers for `POST /v1/responses` and `POST /v1/messages` (I/O).

Both render their request as the chat request vLLM builds from it, tokenize it and run it
on the replica's engine like a chat completion (same prefix cache, same disconnect
handling: a client that goes away aborts the request in the engine); only the wire
shapes differ (gateway.sim.responses_api, gateway.sim.messages_api). The Responses store
belongs to this replica and lives as long as the simulator.

P/D (`--role prefill|decode`): a request's `kv_transfer_params` goes through the replica's
connector as a chat request's does (vLLM 0.32 accepts them on both endpoints): a prefill
leg leases its blocks, a decode leg pulls them first. A pull that fails is vLLM's policy
"fail": a 500 in the endpoint's error shape, or on a stream the 200 already sent and the
endpoint's error event. The answer's own params: the Responses object (whole, and the
stream's `response.completed`), the Messages body (its stream carries none, as vLLM's).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash
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
from gateway.sim.connector import PullFailed
from gateway.sim.errors import ApiError
from gateway.sim.hashing import salt_key
from gateway.sim.host import RouteHost, timing
from gateway.sim.replica import Pending
from gateway.sim.stream import ABORTED, SSE_HEADERS
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import IM_END_ID
from gateway.sim.toolcalls import PlannedCall, choose

# the chat route's draw stream (gateway.sim.app), so a prompt draws the same call on each API
_TOOL_SEED = 0x7001


class ApiRoutes:
    def __init__(self, app: RouteHost, *, store: bool) -> None:
        self.app = app
        self.store = rapi.ResponseStore() if store else None

    # -- shared -------------------------------------------------------------------------

    def _prompt(self, chat: protocol.ChatParams) -> tuple[list[int], int | None]:
        self.app._check_model(chat.gen.model)
        ids = self.app.tokenizer.encode(render_chat(chat.messages, chat.tools, True, False))
        return ids, self.app._check_length(len(ids), chat.gen.max_tokens)

    def _plan(self, chat: protocol.ChatParams, ids: list[int], *,
              guided: bool) -> PlannedCall | None:
        """The call this request answers with, drawn as the chat route draws it.
        `guided`: vLLM's Responses path, where named and "required" choices need no tool
        parser and "auto" without one answers text; else the chat checks (a 400)."""
        if not chat.tools:
            return None
        config = self.app.config
        if not guided:
            self.app._check_tools(chat.tool_choice)
        elif chat.tool_choice == "auto" and config.tool_call_parser is None:
            return None
        rng = random.Random(xxhash.xxh3_64_intdigest(
            array("Q", ids).tobytes(), seed=config.seed ^ _TOOL_SEED))
        fn = choose(chat.tool_choice, chat.tools, config.tool_call_probability, rng)
        return PlannedCall.draw(fn, rng, chat.tool_choice) if fn is not None else None

    @contextlib.asynccontextmanager
    async def _run(self, receive: Receive, rid: str, ids: list[int], max_tokens: int | None,
                   chat: protocol.ChatParams,
                   call: PlannedCall | None = None) -> AsyncIterator[Pending]:
        replica = self.app.replica
        script = None if call is None else tuple(self.app.tokenizer.encode(call.text))
        salt = salt_key(chat.gen.cache_salt)
        connector = self.app.connector
        admission = None
        if connector is not None and chat.gen.kv_transfer is not None:
            # raises PullFailed before anything is sent: the caller answers it
            admission = await connector.admit(chat.gen.kv_transfer, ids, salt)
        arrival = replica.arrive()
        req = replica.engine.new_request(
            rid, ids, max_tokens,
            arrival if admission is None else arrival - admission.transfer_s,
            IM_END_ID, salt, script=script)
        if admission is not None:
            admission.apply(req)
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

    def _kv(self, pending: Pending) -> dict[str, Any] | None:
        """The answer's own kv_transfer_params (None without a connector or a lease)."""
        connector = self.app.connector
        return None if connector is None else connector.answer(pending.request)

    async def _pull_failed(self, send: Send, headers: list[tuple[bytes, bytes]],
                           stream: bool, body: bytes, event: bytes) -> None:
        """vLLM's answer to a leg whose KV could not be loaded: a 500 with `body`, or on a
        stream the 200 it has already sent and `event`."""
        if not stream:
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"), *headers]})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, *headers]})
        await send({"type": "http.response.body", "body": event})

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
        call = self._plan(chat, ids, guided=True)
        rid = rapi.new_id("resp_")
        item_id = rapi.new_id("msg_")
        fc = _CallIds(rapi.new_id("fc_"), rapi.new_id("call_"))
        created = int(time.time())
        headers = [(b"x-request-id", request_id(scope).encode())]
        try:
            async with self._run(receive, rid, ids, max_tokens, chat, call) as pending:
                await self._respond(scope, receive, send, params, pending, call, rid,
                                    item_id, fc, created, headers)
        except PullFailed as exc:
            error = ApiError(500, str(exc))
            await self._pull_failed(send, headers, bool(chat.gen.stream), error.body(),
                                    rapi.ResponsesEvents().event("error", {
                                        "code": None, "message": error.message,
                                        "param": None}))

    async def _respond(self, scope: Scope, receive: Receive, send: Send,
                       params: rapi.ResponsesParams, pending: Pending,
                       call: PlannedCall | None, rid: str, item_id: str, fc: _CallIds,
                       created: int, headers: list[tuple[bytes, bytes]]) -> None:
        chat = params.chat
        model = self.app.config.model
        req = pending.request
        streamed: dict[str, Any] | None = None  # the call's item as streamed
        if not chat.gen.stream:
            await pending.queue.get()
            if req.status != "finished":
                await whole(ABORTED.body(), 503)(scope, receive, send)
                return
            text = self._text(pending)
        else:
            events = rapi.ResponsesEvents()
            start = rapi.response_object(rid, created, model, params, [], "in_progress",
                                         None)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*SSE_HEADERS, *headers]})
            more = {"type": "http.response.body", "more_body": True,
                    "body": events.started(start) if call is not None
                    else events.opening(start, item_id)}
            await send(more)
            pieces: list[str] = []
            offset = 0
            async for piece in self._tokens(pending):
                pieces.append(piece)
                if call is None:
                    more["body"] = events.delta(item_id, piece)
                    await send(more)
                    continue
                d = call.plan.delta(piece, offset)
                offset += len(piece)
                chunk = b""
                if d is not None and d.head:
                    streamed = rapi.function_call_item(fc.item, fc.call, call.name, "",
                                                       "in_progress")
                    chunk += events.call_added(streamed)
                if d is not None and d.arguments and streamed is not None:
                    streamed["arguments"] += d.arguments
                    chunk += events.call_delta(fc.item, d.arguments)
                if chunk:
                    more["body"] = chunk
                    await send(more)
            if req.status != "finished":
                await send({"type": "http.response.body", "more_body": False,
                            "body": events.event("error", {
                                "code": None, "message": ABORTED.message, "param": None})})
                return
            text = "".join(pieces)
        incomplete = "max_output_tokens" if req.finish_reason == "length" else None
        if call is not None and req.finish_reason == "stop":
            # the whole call came out: vLLM returns it parsed, no text beside it
            output = [rapi.function_call_item(fc.item, fc.call, call.name, call.arguments,
                                              "completed")]
            said: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": fc.call, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]}
        else:  # text; a call cut by max_output_tokens does not parse: text too
            output = [rapi.message_item(item_id, text, "completed")]  # as vLLM, even cut
            said = {"role": "assistant", "content": text}
        response = rapi.response_object(
            rid, created, model, params, output,
            "incomplete" if incomplete else "completed",
            rapi.usage(req.num_prompt_tokens, req.num_output_tokens, req.usage_cached),
            incomplete, self._kv(pending))
        if self.store is not None and params.store:
            self.store.put(rid, [*params.history, said], response)
        if chat.gen.stream:
            if call is None:
                tail = events.closing(response, item_id, text)
            else:
                done = None if streamed is None else streamed | {"status": "completed"}
                tail = events.call_closing(response, done)
            await send({"type": "http.response.body", "more_body": False,
                        "body": self._timing_comment(pending) + tail})
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
        call = self._plan(chat, ids, guided=False)  # vLLM runs it as a chat completion
        # vLLM answers with the id of the chat completion it ran
        mid = "chatcmpl-" + request_id(scope)
        headers = [(b"x-request-id", mid.split("-", 1)[1].encode())]
        try:
            async with self._run(receive, mid, ids, max_tokens, chat, call) as pending:
                await self._message(scope, receive, send, chat, pending, call, mid, headers)
        except PullFailed as exc:
            error = ApiError(500, str(exc))
            await self._pull_failed(send, headers, bool(chat.gen.stream),
                                    messages_api.error_body(error),
                                    messages_api.stream_error(error))

    async def _message(self, scope: Scope, receive: Receive, send: Send,
                       chat: protocol.ChatParams, pending: Pending, call: PlannedCall | None,
                       mid: str, headers: list[tuple[bytes, bytes]]) -> None:
        model = self.app.config.model
        details = self.app.config.prompt_tokens_details
        req = pending.request
        if not chat.gen.stream:
            await pending.queue.get()
            if req.status != "finished":
                await whole(messages_api.error_body(ABORTED), 503)(scope, receive, send)
                return
            use = messages_api.usage(req.num_prompt_tokens, req.num_output_tokens,
                                     req.usage_cached if details else None)
            kv = self._kv(pending)
            if call is not None and req.finish_reason == "stop":
                body = messages_api.message_body(mid, model, "", call.finish, use, call,
                                                 kv_transfer=kv)
            else:  # text; a call cut by max_tokens does not parse: text too
                body = messages_api.message_body(mid, model, self._text(pending),
                                                 req.finish_reason, use, kv_transfer=kv)
            await whole(body, 200,
                        [*headers, *self._timing_header(pending)])(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, *headers]})
        more = {"type": "http.response.body", "more_body": True, "body": b""}
        opened = False
        block = call is None  # a text block opens with the message; a call's later
        offset = 0
        async for piece in self._tokens(pending):
            chunk = b""
            if not opened:
                # vLLM writes message_start with its first chat chunk (after the
                # prefill), with the prompt as known then and nothing generated.
                first = messages_api.usage(req.num_prompt_tokens, 0, None)
                chunk = (messages_api.opening(mid, model, first) if call is None
                         else messages_api.start(mid, model, first))
                opened = True
            if call is None:
                chunk += messages_api.delta(piece)
            else:
                d = call.plan.delta(piece, offset)
                offset += len(piece)
                if d is not None and d.head:
                    chunk += messages_api.tool_start(call)
                    block = True
                if d is not None and d.arguments:
                    chunk += messages_api.input_delta(d.arguments)
            if chunk:
                more["body"] = chunk
                await send(more)
        if req.status != "finished":
            await send({"type": "http.response.body", "more_body": False,
                        "body": messages_api.stream_error(ABORTED)})
            return
        use = messages_api.usage(req.num_prompt_tokens, req.num_output_tokens,
                                 req.usage_cached if details else None)
        finish: str | None = req.finish_reason
        if call is not None and block and not call.named:
            finish = "tool_calls"  # the chat stream's finish once a call was sent
        tail = self._timing_comment(pending) + messages_api.closing(finish, use, block)
        if not opened:
            tail = (messages_api.opening if block else messages_api.start)(
                mid, model, use) + tail
        await send({"type": "http.response.body", "more_body": False, "body": tail})


@dataclass(frozen=True, slots=True)
class _CallIds:
    """A Responses call's ids: the output item's and the call's (vLLM draws both)."""

    item: str
    call: str
