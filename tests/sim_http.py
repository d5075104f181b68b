"""Shared pieces of the `gateway sim` loopback tests: start options, request helpers, and
the checks every HTTP test makes (SSE framing, OpenAI error shape, Prometheus scrape)."""

from __future__ import annotations

from typing import Any

import httpx

MODEL = "Qwen/Qwen2.5-7B-Instruct"
FAST = [
    "--speed", "1000", "--kv-blocks", "512", "--max-model-len", "4096", "--timing-comments",
    "--dev-mode",
]  # fmt: skip
# contract 0.23, force-include-usage, legacy metric names, real-time speed
OLD = [
    "--contract",
    "0.23",
    "--enable-force-include-usage",
    "--deprecated-metrics",
    "--max-model-len",
    "8192",
]


def chat(base: str, content: str, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30)


def sse(base: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> list[str]:
    """Raw SSE lines (without the blank separators)."""
    with httpx.stream("POST", base + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all("\n" not in e for e in events)
    return events



def expect_error(r: httpx.Response, status: int, typ: str, fragment: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == typ and fragment in err["message"]



def scrape(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
