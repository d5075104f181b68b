"""Hostile request bodies against the gateway app in process (two fake replicas that answer
every inference call): arbitrary values in every field the gateway reads, on every routed
endpoint, and a table of bodies built to hurt a JSON path (deep nesting around the limits,
invalid UTF-8, lone surrogates, a BOM, NaN, 64-bit overflow, duplicate keys, empty and huge
bodies).

The rule for every case: a 2xx (the fake replica answered), or a 4xx in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`; never a 5xx made by the gateway, never
an exception out of the app. The raw-socket side of the surface (headers, methods,
targets, framing) is in tests/test_fuzz_loopback.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.proxy.app import GatewayApp, create_app
from gateway.proxy.inbound import MAX_DEPTH
from tests.props import chat_body, completion_body, json_value, text
from tests.proxy_fakes import MODEL, Fake, ok_stream
from tests.proxy_fakes import settings as fake_settings

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
# Every top-level field the gateway reads, on one endpoint or another.
READ = ["model", "messages", "prompt", "input", "instructions", "previous_response_id",
        "system", "stream", "stream_options", "tools", "user", "prompt_cache_key",
        "cache_salt", "tool_choice"]
MAX_BODY = 1 << 20


class AppOnLoop:
    """The app started on a private event loop, driven synchronously (hypothesis calls plain
    functions), through httpx's ASGI transport."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.fake = Fake(ok_stream)
        self.app: GatewayApp = create_app(fake_settings(max_body_bytes=MAX_BODY),
                                          upstream=self.fake.upstream)
        self.loop.run_until_complete(self.app.startup())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://gw")

    def post(self, path: str, body: bytes) -> httpx.Response:
        request = self.client.post(path, content=body,
                                   headers={"content-type": "application/json"})
        return self.loop.run_until_complete(asyncio.wait_for(request, 10))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.app.shutdown())
        self.loop.close()


@pytest.fixture(scope="module")
def gw() -> Iterator[AppOnLoop]:
    app = AppOnLoop()
    try:
        yield app
    finally:
        app.close()


def assert_clean(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, r.text[:500]
        assert isinstance(error["message"], str) and error["message"]


def encode(body: Any) -> bytes:
    # the stdlib encoder: it writes integers beyond 64 bits, which orjson refuses to
    return json.dumps(body).encode()


fields = st.dictionaries(st.sampled_from(READ), json_value, max_size=8)
known_model = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={k: json_value for k in READ if k != "model"},
)
messages_of = st.fixed_dictionaries({
    "model": st.just(MODEL),
    "messages": st.lists(st.dictionaries(
        st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name", "type"]),
        json_value, max_size=4), max_size=4),
})
responses_of = st.fixed_dictionaries({
    "model": st.just(MODEL),
    "input": st.one_of(text, st.lists(st.dictionaries(
        st.sampled_from(["type", "role", "content", "call_id", "name", "arguments",
                         "output"]), json_value, max_size=4), max_size=4)),
})


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(ROUTES),
       body=st.one_of(known_model, messages_of, responses_of, chat_body, completion_body,
                      fields, json_value))
def test_any_body_gets_an_answer_or_an_openai_4xx(gw: AppOnLoop, path: str, body: Any) -> None:
    assert_clean(gw.post(path, encode(body)))


def nested(depth: int, leaf: str = '"x"') -> str:
    """A JSON value `depth` arrays deep around leaf."""
    return "[" * depth + leaf + "]" * depth


def raw_body(**fields: str) -> bytes:
    """A body with the known model and each field's raw JSON text, as written."""
    parts = [f'"model":"{MODEL}"', *(f'"{k}":{v}' for k, v in fields.items())]
    return ("{" + ",".join(parts) + "}").encode()


def chat_with(content: str) -> bytes:
    return raw_body(messages='[{"role":"user","content":' + content + "}]")


def deep_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


USER = '{"role":"user","content":"x"}'
TOOL = '[{"type":"function","function":{"name":"f","parameters":' + deep_object(500) + "}}]"
CALL = ('{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function",'
        '"function":{"name":"f","arguments":' + deep_object(1000) + "}}]}")
# (name, body, the statuses allowed)
HOSTILE: list[tuple[str, bytes, set[int]]] = [
    # a body's depth is its content's plus 3 (the body, messages, the message)
    ("content at the depth limit", chat_with(nested(MAX_DEPTH - 3)), {200}),
    ("content one over the limit", chat_with(nested(MAX_DEPTH - 2)), {400}),
    ("content nested 300 (past orjson's dump limit)", chat_with(nested(300)), {400}),
    ("content nested 1000 (orjson's parse limit)", chat_with(nested(1000)), {400}),
    ("arrays nested 100,000", raw_body(messages=nested(100_000)), {400}),
    ("object content nested 500",
     chat_with('[{"type":"text","text":' + deep_object(500) + "}]"), {400}),
    ("tool schema nested 500", raw_body(messages=f"[{USER}]", tools=TOOL), {400}),
    ("tool arguments nested 1000", raw_body(messages=f"[{CALL},{USER}]"), {400}),
    ("tools nested 1000", raw_body(messages=f"[{USER}]", tools=nested(1000)), {400}),
    ("invalid UTF-8", chat_with('"\xff\xfe"').replace(b"\xc3\xbf\xc3\xbe", b"\xff\xfe"),
     {400}),
    ("overlong UTF-8", chat_with('"x"').replace(b'"x"', b'"\xc0\xaf"'), {400}),
    ("lone surrogate escape", chat_with('"\\ud800"'), {400}),
    ("NUL escape", chat_with('"a\\u0000b"'), {200}),
    ("byte order mark", b"\xef\xbb\xbf" + chat_with('"x"'), {400}),
    ("NaN", chat_with('"x"')[:-1] + b',"temperature":NaN}', {400}),
    # parsed as a float by orjson, forwarded as sent: the engine judges sampling fields
    ("integer beyond 64 bits", chat_with('"x"')[:-1] + b',"max_tokens":1' + b"0" * 30 + b"}",
     {200}),
    ("duplicate model key", b'{"model":"zz",' + raw_body(messages=f"[{USER}]")[1:], {200}),
    ("empty body", b"", {400}),
    ("whitespace body", b" \n\t ", {400}),
    ("truncated JSON", chat_with('"x"')[:-3], {400}),
    ("trailing garbage", chat_with('"x"') + b"}", {400}),
    ("a bare string", b'"hello"', {400}),
    ("null", b"null", {400}),
    ("huge body", chat_with('"' + "x" * (MAX_BODY + 1) + '"'), {413}),
    ("100,000 empty messages", raw_body(messages="[" + ",".join(["{}"] * 100_000) + "]"),
     {400}),
]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(("name", "body", "allowed"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies(gw: AppOnLoop, path: str, name: str, body: bytes,
                        allowed: set[int]) -> None:
    r = gw.post(path, body)
    assert_clean(r)
    if r.status_code >= 400:  # endpoints differ in what they require; errors do not
        assert r.status_code in allowed | {400, 404}, r.text[:300]
    if path == ROUTES[0]:  # the chat route reads every one of these bodies
        assert r.status_code in allowed, r.text[:300]
