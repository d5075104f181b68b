"""The first hour of a new user, each point on real processes: `gateway serve` with no flag
answers tool calls from the openai client; a port in use is one line and exit status 2;
the agent harnesses' own session headers keep a conversation on its replica."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.filler import words
from tests.servers import free_port, running, script

MODEL = "Qwen/Qwen2.5-7B-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def demo() -> Iterator[str]:
    """`gateway serve` as a new user starts it: no flag (the port comes from the
    environment only so parallel runs do not collide)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running([*script("gateway"), "serve"], [url + "/ready"],
                 env={"GATEWAY_SERVER__PORT": str(port)}):
        yield url


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["auto", "required", None])
def test_tool_calls_through_the_demo(demo: str, stream: bool, tool_choice: str | None) -> None:
    client = openai.OpenAI(base_url=demo + "/v1", api_key="none", max_retries=0)
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8,  # type: ignore[list-item]
            stream=True, **extra))  # type: ignore[call-overload]
        assert chunks and chunks[-1].choices[-1].finish_reason is not None
    else:
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8,  # type: ignore[list-item]
            **extra)  # type: ignore[call-overload]
        assert answer.choices[0].finish_reason is not None and answer.usage is not None


def test_a_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        done = subprocess.run([*script("gateway"), "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=60, check=False,
                              env={**os.environ, "GATEWAY_SERVER__LOG_FORMAT": "text"})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"gateway serve: cannot listen on 127.0.0.1:{port}: Address already in "
                     "use (server.port, --port)"], done.stderr
    assert done.stdout == ""
    assert time.monotonic() - t0 < 30  # refused before the embedded simulator starts


HARNESSES = [  # (who sends it, the header)
    ("gateway", "x-session-id"), ("Claude Code", "x-claude-code-session-id"),
    ("OpenCode", "x-session-affinity"), ("Codex", "session-id"), ("Codex", "session_id"),
]


@pytest.mark.parametrize(("who", "header"), [*HARNESSES, ("nobody", "x-not-a-session")])
def test_harness_session_headers_keep_a_conversation_on_its_replica(
    demo: str, who: str, header: str,
) -> None:
    """Turns whose prompts share nothing, so nothing but the session keeps them together:
    with the session read from the harness's header every turn goes to one replica; with a
    header that names no session, the fleet spreads them (the control)."""
    replicas, routes = set(), []
    rng = random.Random(header)
    with httpx.Client(timeout=30) as client:
        for turn in range(6):
            text = words(rng, 40) + f" ({who}, turn {turn})"
            r = client.post(demo + "/v1/chat/completions", headers={header: f"{header}-conv"},
                            json={"model": MODEL, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": text}]})
            assert r.status_code == 200, r.text
            replicas.add(r.headers["x-gateway-replica"])
            routes.append(r.headers["x-gateway-route"])
    if who == "nobody":
        assert len(replicas) > 1, routes
    else:
        assert len(replicas) == 1, (replicas, routes)
