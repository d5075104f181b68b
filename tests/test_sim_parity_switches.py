"""The simulator's vLLM 0.32 switches over loopback: tool_choice "auto" needs
`--enable-auto-tool-choice --tool-call-parser`, `/reset_prefix_cache` needs dev mode, and
usage carries `created_cache_tokens` (checked against real vLLM by tests/realvllm)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import sim

TOOL = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
TOOLS_ON = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--dev-mode"]


@pytest.fixture(scope="module")
def plain() -> Iterator[str]:
    with sim(1, ["--speed", "1000", "--max-model-len", "4096"]) as urls:
        yield urls[0]


@pytest.fixture(scope="module")
def flagged() -> Iterator[str]:
    with sim(1, ["--speed", "1000", "--max-model-len", "4096", *TOOLS_ON]) as urls:
        yield urls[0]


def _chat(base: str, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "tools please"}], "max_tokens": 2, **extra}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30)


AUTO = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
CASES = [
    # (extra body, status without the flags, message fragment without the flags)
    ({"tools": [TOOL]}, 400, AUTO),  # tools alone mean tool_choice "auto"
    ({"tools": [TOOL], "tool_choice": "auto"}, 400, AUTO),
    ({"tools": [TOOL], "tool_choice": "required"}, 400, 'tool_choice="required" requires'),
    ({"tools": [TOOL], "tool_choice": "none"}, 200, None),
    ({}, 200, None),
]


@pytest.mark.parametrize(("extra", "status", "message"), CASES)
def test_tool_choice_needs_the_server_flags(
    plain: str, flagged: str, extra: dict[str, Any], status: int, message: str | None
) -> None:
    r = _chat(plain, **extra)
    assert r.status_code == status, r.text
    if message is not None:
        err = r.json()["error"]
        assert message in err["message"] and err["type"] == "BadRequestError"
    assert _chat(flagged, **extra).status_code == 200


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"tools": []}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
     ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice")],
)  # fmt: skip
def test_tool_validation_errors(flagged: str, extra: dict[str, Any], param: str) -> None:
    r = _chat(flagged, **extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_reset_prefix_cache_only_in_dev_mode(plain: str, flagged: str) -> None:
    assert httpx.post(plain + "/reset_prefix_cache").status_code == 404
    assert httpx.post(flagged + "/reset_prefix_cache").json() == {"success": True}


def test_created_cache_tokens_counts_new_full_blocks(flagged: str) -> None:
    content = "created cache tokens " * 30
    first = _chat(flagged, messages=[{"role": "user", "content": content}]).json()["usage"]
    again = _chat(flagged, messages=[{"role": "user", "content": content}]).json()["usage"]
    full = first["prompt_tokens"] // 16 * 16
    assert first["prompt_tokens_details"]["created_cache_tokens"] == full
    assert again["prompt_tokens_details"]["cached_tokens"] == full
    assert again["prompt_tokens_details"]["created_cache_tokens"] == 0
