"""The HTTP face of one simulated vLLM replica: a Starlette app (routing, lifespan, errors)
with the generation routes in front of it as raw ASGI (no framework objects on the hot path).

Routes (contract section 6): POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel, POST
/v1/messages (gateway.sim.api_routes),
POST /tokenize, POST /detokenize, GET /health, GET|POST /ping, GET /version, GET /load,
GET /metrics, POST /reset_prefix_cache. Unknown paths and methods answer FastAPI's
``{"detail": ...}``.

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
import random
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xxhash
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.sim import protocol
from gateway.sim.api_routes import ApiRoutes
from gateway.sim.asgi import (
    Receive,
    Scope,
    Send,
    read_body,
    request_id,
    watch_disconnect,
    whole,
)
from gateway.sim.connector import KvConnector, PullFailed
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
)
from gateway.sim.stream import ABORTED, SSE_HEADERS, ChatStream
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import ENDOFTEXT_ID, IM_END_ID, Tokenizer
from gateway.sim.toolcalls import PlannedCall, choose

_TOOL_SEED = 0x7001  # the tool-call draw's own stream, apart from the reply's words


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    model: str
    max_model_len: int
    contract: Contract = CURRENT
    prompt_tokens_details: bool = True
    # vLLM's --enable-auto-tool-choice --tool-call-parser NAME: the parser's name, else None
    # (then tool_choice "auto", and tools without a tool_choice, are a 400 as in vLLM).
    tool_call_parser: str | None = None
    # tool_choice "auto": the share of answers that are a tool call (drawn per prompt from
    # the seed, so a prompt repeats its answer); named and "required" always call.
    tool_call_probability: float = 0.0
    seed: int = 0
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache exists
    force_include_usage: bool = False
    timing_comments: bool = False
    deprecated_metrics: bool = False
    responses_store: bool = False  # VLLM_ENABLE_RESPONSES_API_STORE
    # GET /kv_event_sources when the replica publishes KV events (gateway/sim/kvpublish.py)
    kv_event_sources: Mapping[str, Any] | None = None


class SimApp:
    def __init__(self, replica: Replica, tokenizer: Tokenizer, config: ServeConfig,
                 connector: KvConnector | None = None) -> None:
        self.replica = replica
        self.connector = connector  # --role prefill|decode: the P/D legs
        self.tokenizer = tokenizer
        self.config = config
        self.policy = UsagePolicy(
            details=config.prompt_tokens_details,
            contract=config.contract,
            block_size=replica.engine.config.block_size,
        )
        self.created = int(time.time())
        self.started = time.time()  # process_start_time_seconds, as vLLM's /metrics has it
        # The streamed chat and completions answers (stream.py).
        self._stream = ChatStream(
            model=config.model, contract=config.contract, policy=self.policy,
            tokenizer=tokenizer, connector=connector,
            force_include_usage=config.force_include_usage,
            timing_comments=config.timing_comments)
        apis = self._apis = ApiRoutes(self, store=config.responses_store)
        # The generation routes: raw ASGI, called before Starlette sees the request.
        self._raw: dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            "/v1/chat/completions": self._chat,
            "/v1/completions": self._completions,
            "/v1/responses": apis.responses,
            "/v1/messages": apis.messages,
        }
        get, post = ["GET"], ["POST"]
        routes = [
            # the same raw handlers __call__ sends POSTs to: here for the 405s
            *(Route(path, _Raw(handler), methods=post) for path, handler in self._raw.items()),
            Route("/v1/responses/{response_id}", self._stored_get, methods=get),
            Route("/v1/responses/{response_id}/cancel", self._stored_cancel, methods=post),
            Route("/v1/models", self._models, methods=get),
            Route("/tokenize", self._tokenize, methods=post),
            Route("/detokenize", self._detokenize, methods=post),
            Route("/health", self._empty, methods=get),
            Route("/ping", self._empty, methods=["GET", "POST"]),
            Route("/version", self._version, methods=get),
            Route("/load", self._load, methods=get),
            Route("/metrics", self._metrics, methods=get),
        ]
        if config.dev_mode:
            routes.append(Route("/reset_prefix_cache", self._reset, methods=post))
        if config.kv_event_sources is not None:
            sources = orjson.dumps(config.kv_event_sources)

            async def kv_event_sources(request: Request) -> Response:
                return whole(sources)

            routes.append(Route("/kv_event_sources", kv_event_sources, methods=get))
        self._app = Starlette(routes=routes, exception_handlers={
            ApiError: _api_error, HTTPException: _http_error})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._raw.get(scope["path"])
            if handler is not None:
                try:
                    await handler(scope, receive, send)
                except ApiError as e:
                    await whole(e.body(), e.status)(scope, receive, send)
                return
        await self._app(scope, receive, send)

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
        call = None
        if params.tools:
            rng = random.Random(xxhash.xxh3_64_intdigest(
                array("Q", ids).tobytes(), seed=self.config.seed ^ _TOOL_SEED))
            fn = choose(params.tool_choice, params.tools, self.config.tool_call_probability, rng)
            call = PlannedCall.draw(fn, rng, params.tool_choice) if fn is not None else None
        await self._generate(scope, receive, send, "chat", params.gen, ids, IM_END_ID, call)

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
        call: PlannedCall | None = None,
    ) -> None:
        max_tokens = self._check_length(len(ids), gen.max_tokens)
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id(scope)
        replica = self.replica
        script = None if call is None else tuple(self.tokenizer.encode(call.text))
        salt = salt_key(gen.cache_salt)
        admission = None
        if self.connector is not None and gen.kv_transfer is not None:
            try:
                admission = await self.connector.admit(gen.kv_transfer, ids, salt)
            except PullFailed as exc:
                await self._pull_failed(scope, receive, send, gen.stream, str(exc))
                return
        arrival = replica.arrive()
        try:
            req = replica.engine.new_request(
                rid, ids, max_tokens, arrival if admission is None
                else arrival - admission.transfer_s, stop, salt, gen.priority, script)
        except ValueError as exc:
            raise bad_request(str(exc), "priority") from None
        if admission is not None:
            admission.apply(req)
        replica.in_flight += 1
        try:
            pending = replica.submit(req, streaming=gen.stream)
            watcher = asyncio.ensure_future(watch_disconnect(receive, replica, pending))
            try:
                if gen.stream:
                    await self._stream(send, endpoint, gen, pending, rid, call)
                else:
                    await self._unary(scope, receive, send, endpoint, pending, rid, call,
                                      gen.return_token_ids)
            finally:
                watcher.cancel()
                replica.abort(pending)  # no-op once finished
        finally:
            replica.in_flight -= 1

    async def _unary(self, scope: Scope, receive: Receive, send: Send, endpoint: str,
                     pending: Pending, rid: str, call: PlannedCall | None,
                     return_ids: bool = False) -> None:
        await pending.queue.get()
        req = pending.request
        if req.status != "finished":
            # Aborted: either the client is gone (then this send is a no-op) or the
            # simulator is shutting down.
            await whole(ABORTED.body(), 503)(scope, receive, send)
            return
        out = req.output_ids
        if req.finish_reason == "stop":
            out = out[:-1]  # the stop token is counted but not shown
        text = self.tokenizer.decode(out)
        usage = self.policy.usage(
            req.num_prompt_tokens, req.num_output_tokens, req.usage_cached,
            created=endpoint == "chat",
        )
        finish = req.finish_reason or "stop"
        kv = None if self.connector is None else self.connector.answer(req)
        # vLLM's token_ids: every generated id, the stop token included
        ids = (list(req.token_ids[:req.num_prompt_tokens]), list(req.output_ids)) \
            if return_ids else None
        if endpoint != "chat":
            body = completion_body(rid, int(time.time()), self.config.model, text, finish,
                                   usage, contract=self.config.contract, kv_transfer=kv,
                                   ids=ids)
        elif call is not None and finish == "stop":
            # The whole call came out: vLLM returns it parsed ("stop" for a named one).
            body = chat_body(rid, int(time.time()), self.config.model, text, call.finish,
                             usage, contract=self.config.contract, tool_calls=[call.message()],
                             tool_content=call.content, kv_transfer=kv)
        else:
            # A call cut by max_tokens does not parse: vLLM returns the text as content.
            body = chat_body(rid, int(time.time()), self.config.model, text, finish, usage,
                             contract=self.config.contract, kv_transfer=kv, ids=ids)
        headers = [(b"x-request-id", rid.split("-", 1)[1].encode())]
        if self.config.timing_comments:
            headers.append((b"x-sim-timing", orjson.dumps(_timing(req))))
        await whole(body, 200, headers)(scope, receive, send)

    async def _pull_failed(self, scope: Scope, receive: Receive, send: Send, stream: bool,
                           message: str) -> None:
        """vLLM fails a request whose KV cannot be loaded (policy "fail"): a 500, or on a
        stream the error event after the 200 it has already sent."""
        error = ApiError(500, message)
        if not stream:
            await whole(error.body(), 500)(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, (b"x-request-id", request_id(scope).encode())]})
        await send({"type": "http.response.body", "more_body": False,
                    "body": ChunkWriter.error(error.body()) + ChunkWriter.DONE})

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

    def _stored_get(self, request: Request) -> Response:
        return self._apis.stored(request.path_params["response_id"], "get")

    def _stored_cancel(self, request: Request) -> Response:
        return self._apis.stored(request.path_params["response_id"], "cancel")

    async def _models(self, request: Request) -> Response:
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
        return whole(orjson.dumps({"object": "list", "data": [card]}))

    async def _tokenize(self, request: Request) -> Response:
        body = protocol.parse_json(await read_body(request.receive))
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
        return whole(orjson.dumps({"count": len(ids), "max_model_len": self.config.max_model_len,
                                   "tokens": ids, "token_strs": strs}))

    async def _detokenize(self, request: Request) -> Response:
        body = protocol.parse_json(await read_body(request.receive))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("`tokens` must be a list of integers", "tokens")
        try:
            text = self.tokenizer.decode(tokens)
        except (ValueError, OverflowError) as e:
            raise bad_request(str(e), "tokens") from None
        return whole(orjson.dumps({"prompt": text}))

    def _empty(self, request: Request) -> Response:
        return whole(b"", media_type=None)

    def _version(self, request: Request) -> Response:
        return whole(orjson.dumps({"version": f"{self.config.contract}.0"}))

    def _load(self, request: Request) -> Response:
        return whole(orjson.dumps({"server_load": self.replica.in_flight}))

    def _metrics(self, request: Request) -> Response:
        engine = self.replica.engine
        text = engine.metrics.render(
            self.config.model, engine.gauges(), self.config.deprecated_metrics, self.started)
        return whole(text.encode(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _reset(self, request: Request) -> Response:
        # vLLM 0.32 answers {"success": ...}: false while blocks are still in use.
        ok = self.replica.engine.reset_prefix_cache()
        if self.config.contract != "0.32":
            return whole(b"", media_type=None)
        return whole(orjson.dumps({"success": ok}))


class _Raw:
    """A generation route as the raw ASGI it is (Starlette calls an object that is neither a
    function nor a method as ASGI; its ApiError reaches the app's handler)."""

    def __init__(self, handler: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return whole(exc.body(), exc.status)


def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, as FastAPI (vLLM's server) words them."""
    assert isinstance(exc, HTTPException)
    return whole(orjson.dumps({"detail": exc.detail}), exc.status_code,
                 [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()])
