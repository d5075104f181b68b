"""The HTTP face of one simulated vLLM replica: a raw ASGI app (no framework on the hot path).

Routes (contract section 6): POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel, POST
/v1/messages (gateway.sim.api_routes),
POST /tokenize, POST /detokenize, GET /health, GET|POST /ping, GET /version, GET /load,
GET /metrics, POST /reset_prefix_cache. Unknown paths answer FastAPI's ``{"detail": ...}``.

Generation: the body is validated (protocol), rendered (chat template) and tokenized, then
submitted to the replica's engine; the handler waits for tokens while a watcher task reads
``receive()`` so a client disconnect aborts the request in the engine at once (its blocks
are freed, as vLLM does). ``X-Request-Id`` becomes the response id (``chatcmpl-<id>``).

``--timing-comments``: non-streaming responses carry header ``x-sim-timing`` and streams
carry one SSE comment ``: sim-timing {json}`` (plus a blank line) right before
``data: [DONE]``. The json is ``{"arrival_s", "queue_ms", "ttft_ms", "e2e_ms",
"prompt_tokens", "cached_tokens"}`` in SIMULATED time of the replica's virtual clock, so
benchmarks can read engine latencies without wall-clock noise.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.sim import protocol
from gateway.sim import responses_api as rapi
from gateway.sim.api_routes import ApiRoutes
from gateway.sim.asgi import (
    Receive,
    Scope,
    Send,
    lifespan,
    read_body,
    request_id,
    respond,
    watch_disconnect,
)
from gateway.sim.errors import ApiError, bad_request
from gateway.sim.hashing import salt_key
from gateway.sim.host import timing as _timing
from gateway.sim.replica import Pending, Replica
from gateway.sim.responses import (
    CURRENT,
    ChunkWriter,
    Contract,
    UsagePolicy,
    chat_body,
    completion_body,
    running_usage,
)
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import ENDOFTEXT_ID, IM_END_ID, Tokenizer

_ABORTED = ApiError(503, "The request was aborted (simulator shutting down).")
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    model: str
    max_model_len: int
    contract: Contract = CURRENT
    prompt_tokens_details: bool = True
    # vLLM's --enable-auto-tool-choice --tool-call-parser NAME: the parser's name, else None
    # (then tool_choice "auto", and tools without a tool_choice, are a 400 as in vLLM).
    tool_call_parser: str | None = None
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache exists
    force_include_usage: bool = False
    timing_comments: bool = False
    deprecated_metrics: bool = False
    responses_store: bool = False  # VLLM_ENABLE_RESPONSES_API_STORE
    # GET /kv_event_sources when the replica publishes KV events (gateway/sim/kvpublish.py)
    kv_event_sources: Mapping[str, Any] | None = None


class SimApp:
    def __init__(self, replica: Replica, tokenizer: Tokenizer, config: ServeConfig) -> None:
        self.replica = replica
        self.tokenizer = tokenizer
        self.config = config
        self.policy = UsagePolicy(
            details=config.prompt_tokens_details,
            contract=config.contract,
            block_size=replica.engine.config.block_size,
        )
        self.created = int(time.time())
        self.started = time.time()  # process_start_time_seconds, as vLLM's /metrics has it
        apis = self._apis = ApiRoutes(self, store=config.responses_store)
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/responses"): apis.responses,
            ("POST", "/v1/messages"): apis.messages,
            ("GET", "/v1/models"): self._models,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("GET", "/health"): self._empty,
            ("GET", "/ping"): self._empty,
            ("POST", "/ping"): self._empty,
            ("GET", "/version"): self._version,
            ("GET", "/load"): self._load,
            ("GET", "/metrics"): self._metrics,
        }
        if config.dev_mode:
            self._routes[("POST", "/reset_prefix_cache")] = self._reset
        if config.kv_event_sources is not None:
            sources = orjson.dumps(config.kv_event_sources)

            async def kv_event_sources(scope: Scope, receive: Receive, send: Send) -> None:
                await respond(send, 200, sources)

            self._routes[("GET", "/kv_event_sources")] = kv_event_sources
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await lifespan(receive, send)
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        stored = rapi.stored_call(scope["path"]) if handler is None else None
        if stored is not None and (scope["method"], stored[1]) in (("GET", "get"),
                                                                   ("POST", "cancel")):
            try:
                await self._apis.stored(scope, receive, send, *stored)
            except ApiError as e:
                await respond(send, e.status, e.body())
            return
        if handler is None:
            if scope["path"] in self._paths:
                await respond(send, 405, b'{"detail":"Method Not Allowed"}')
            else:
                await respond(send, 404, b'{"detail":"Not Found"}')
            return
        try:
            await handler(scope, receive, send)
        except ApiError as e:
            await respond(send, e.status, e.body())

    # -- generation -------------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = protocol.parse_chat(protocol.parse_json(await read_body(receive)))
        self._check_model(params.gen.model)
        self._check_tools(params.tool_choice)
        text = render_chat(
            params.messages,
            params.tools,
            params.add_generation_prompt,
            params.continue_final_message,
        )
        ids = self.tokenizer.encode(text)
        await self._generate(scope, receive, send, "chat", params.gen, ids, IM_END_ID)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = protocol.parse_completion(protocol.parse_json(await read_body(receive)))
        self._check_model(params.gen.model)
        prompt = params.prompt
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        await self._generate(scope, receive, send, "completions", params.gen, ids, ENDOFTEXT_ID)

    async def _generate(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        endpoint: Literal["chat", "completions"],
        gen: protocol.GenerationParams,
        ids: list[int],
        stop: int,
    ) -> None:
        max_tokens = self._check_length(len(ids), gen.max_tokens)
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id(scope)
        replica = self.replica
        try:
            req = replica.engine.new_request(
                rid, ids, max_tokens, replica.arrive(), stop, salt_key(gen.cache_salt),
                gen.priority)
        except ValueError as exc:
            raise bad_request(str(exc), "priority") from None
        replica.in_flight += 1
        try:
            pending = replica.submit(req, streaming=gen.stream)
            watcher = asyncio.ensure_future(watch_disconnect(receive, replica, pending))
            try:
                if gen.stream:
                    await self._stream(send, endpoint, gen, pending, rid)
                else:
                    await self._unary(send, endpoint, pending, rid)
            finally:
                watcher.cancel()
                replica.abort(pending)  # no-op once finished
        finally:
            replica.in_flight -= 1

    async def _unary(self, send: Send, endpoint: str, pending: Pending, rid: str) -> None:
        await pending.queue.get()
        req = pending.request
        if req.status != "finished":
            # Aborted: either the client is gone (then this send is a no-op) or the
            # simulator is shutting down.
            await respond(send, 503, _ABORTED.body())
            return
        out = req.output_ids
        if req.finish_reason == "stop":
            out = out[:-1]  # the stop token is counted but not shown
        text = self.tokenizer.decode(out)
        usage = self.policy.usage(
            req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens,
            created=endpoint == "chat",
        )
        render = chat_body if endpoint == "chat" else completion_body
        body = render(
            rid, int(time.time()), self.config.model, text, req.finish_reason or "stop", usage,
            contract=self.config.contract,
        )
        headers = [(b"x-request-id", rid.split("-", 1)[1].encode())]
        if self.config.timing_comments:
            headers.append((b"x-sim-timing", orjson.dumps(_timing(req))))
        await respond(send, 200, body, headers)

    async def _stream(
        self,
        send: Send,
        endpoint: Literal["chat", "completions"],
        gen: protocol.GenerationParams,
        pending: Pending,
        rid: str,
    ) -> None:
        force = self.config.force_include_usage
        include_usage = gen.include_usage or force
        continuous = (gen.continuous_usage and gen.include_usage) or force
        req = pending.request
        writer = ChunkWriter(
            endpoint, rid, int(time.time()), self.config.model, self.config.contract
        )
        prompt = req.num_prompt_tokens
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_SSE, (b"x-request-id", rid.split("-", 1)[1].encode())],
            }
        )
        more = {"type": "http.response.body", "body": b"", "more_body": True}
        first = True
        produced = 0
        piece = self.tokenizer.piece
        queue = pending.queue
        while True:
            token = await queue.get()
            if token is None:
                break
            if first and endpoint == "chat":
                more["body"] = writer.role(running_usage(prompt, 0) if continuous else None)
                await send(more)
            first = False
            produced += 1
            finished = req.status == "finished" and produced == req.num_output_tokens
            text = "" if token == req.stop_token and req.finish_reason == "stop" else piece(token)
            usage = running_usage(prompt, produced) if continuous else None
            more["body"] = writer.content(
                text, req.finish_reason if finished else None, usage,
                last=finished and not include_usage,
            )
            await send(more)
        if req.status != "finished":
            # Same as above; vLLM reports a mid-stream failure as an error event.
            await send(
                {
                    "type": "http.response.body",
                    "more_body": False,
                    "body": ChunkWriter.error(_ABORTED.body()) + ChunkWriter.DONE,
                }
            )
            return
        tail = b""
        if include_usage:
            tail += writer.usage(
                self.policy.usage(
                    prompt, req.num_output_tokens, req.num_cached_tokens,
                    created=endpoint == "chat",
                )
            )
        if self.config.timing_comments:
            tail += ChunkWriter.comment("sim-timing", _timing(req))
        await send(
            {"type": "http.response.body", "body": tail + ChunkWriter.DONE, "more_body": False}
        )

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    def _check_tools(self, choice: str | dict[str, Any] | None) -> None:
        if self.config.tool_call_parser is not None or choice in (None, "none"):
            return
        if choice == "auto":
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        if self.config.contract != "0.32":
            return  # older versions guided "required" and named choices without a parser
        if isinstance(choice, dict):
            fn = choice.get("function")
            desc = f'function "{fn.get("name") if isinstance(fn, dict) else None}"'
        else:
            desc = f'"{choice}"'
        raise bad_request(f"tool_choice={desc} requires --tool-call-parser to be set")

    def _check_length(self, n: int, max_tokens: int | None) -> int | None:
        limit = self.config.max_model_len
        if n >= limit:
            if self.config.contract == "0.23":
                msg = (
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {n} input tokens. Please reduce the length of the input "
                    "messages."
                )
            else:
                msg = (
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt contains {n} input tokens, which exceeds this limit even "
                    "without any output tokens. Please reduce the length of the input "
                    "prompt."
                )
            raise bad_request(msg, "input_tokens" if self.config.contract == "0.32" else None)
        pool = self.replica.engine.config
        if -(-n // pool.block_size) > pool.num_gpu_blocks - 1:
            raise bad_request(
                f"The prompt ({n} tokens) does not fit in the simulated KV cache "
                f"({pool.num_gpu_blocks - 1} blocks of {pool.block_size})."
            )
        if max_tokens is not None and n + max_tokens > limit:
            if self.config.contract == "0.23" or max_tokens > limit:
                raise bad_request(
                    f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                    f"model's maximum context length is {limit} tokens and your request has "
                    f"{n} input tokens ({max_tokens} > {limit} - {n}).",
                    "max_tokens",
                )
            return limit - n  # clamped to the remaining room (>= 0.24)
        return max_tokens

    # -- the rest -----------------------------------------------------------------------

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.config.model
        card = {
            "id": m,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": m,
            "parent": None,
            "max_model_len": self.config.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        await respond(send, 200, orjson.dumps({"object": "list", "data": [card]}))

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = protocol.parse_json(await read_body(receive))
        self._check_model(protocol.parse_generation({"model": body.get("model")}, "").model)
        if "messages" in body:
            params = protocol.parse_chat(body)
            ids = self.tokenizer.encode(
                render_chat(
                    params.messages,
                    params.tools,
                    params.add_generation_prompt,
                    params.continue_final_message,
                )
            )
        elif isinstance(body.get("prompt"), str):
            ids = self.tokenizer.encode(body["prompt"])
        else:
            raise bad_request("tokenize needs `prompt` (a string) or `messages`", "prompt")
        strs = self.tokenizer.pieces(ids) if body.get("return_token_strs") else None
        await respond(
            send,
            200,
            orjson.dumps(
                {
                    "count": len(ids),
                    "max_model_len": self.config.max_model_len,
                    "tokens": ids,
                    "token_strs": strs,
                }
            ),
        )

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = protocol.parse_json(await read_body(receive))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("`tokens` must be a list of integers", "tokens")
        try:
            text = self.tokenizer.decode(tokens)
        except (ValueError, OverflowError) as e:
            raise bad_request(str(e), "tokens") from None
        await respond(send, 200, orjson.dumps({"prompt": text}))

    async def _empty(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"", content_type=None)

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, orjson.dumps({"version": f"{self.config.contract}.0"}))

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, orjson.dumps({"server_load": self.replica.in_flight}))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.replica.engine
        text = engine.metrics.render(
            self.config.model, engine.gauges(), self.config.deprecated_metrics, self.started)
        await respond(
            send,
            200,
            text.encode(),
            content_type=b"text/plain; version=0.0.4; charset=utf-8",
        )

    async def _reset(self, scope: Scope, receive: Receive, send: Send) -> None:
        # vLLM 0.32 answers {"success": ...}: false while blocks are still in use.
        ok = self.replica.engine.reset_prefix_cache()
        if self.config.contract != "0.32":
            await respond(send, 200, b"", content_type=None)
        else:
            await respond(send, 200, orjson.dumps({"success": ok}))
