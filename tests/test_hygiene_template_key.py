"""The template key (the drift state of requests with neither a session nor a known
conversation) is cached by what it is a function of: a warm analyzer gives the key a
fresh one computes, for any sequence of bodies."""

from __future__ import annotations

import datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.prompt import parse

# Timestamps near now (derived from the clock: "the current time" is judged against it).
_NOW = datetime.datetime.now(datetime.UTC)
_T1 = _NOW.strftime("%Y-%m-%dT%H:%M:%SZ")
_T2 = (_NOW + datetime.timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
systems = st.sampled_from([
    "You are helpful.", "You are  helpful.\n", f"Now: {_T1}. Be brief.",
    f"Now: {_T2}. Be brief.", "Request id 3f2a9c1e-77b1-4c55-9a51-1f0e2d3c4b5a.",
    "Be brief.",
])
tool_names = st.lists(st.sampled_from(["search", "fetch", "calc"]), max_size=2, unique=True)


def key(analyzer: HygieneAnalyzer, body: dict[str, Any]) -> int:
    return analyzer._template_key(body, parse(body, "chat"))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["m1", "m2"]), systems, tool_names,
                          st.booleans(), st.booleans()), min_size=1, max_size=12))
def test_cached_template_keys_equal_fresh_ones(
        requests: list[tuple[str, str, list[str], bool, bool]]) -> None:
    warm = HygieneAnalyzer(HygieneConfig(max_templates=4))  # small: evictions too
    for model, system, tools, system_role, follow_up in requests:
        messages: list[dict[str, Any]] = [
            {"role": "system" if system_role else "user", "content": system}]
        if follow_up:
            messages.append({"role": "user", "content": "and then?"})
        body: dict[str, Any] = {"model": model, "messages": messages}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": n, "parameters": {}}}
                             for n in tools]
        assert key(warm, body) == key(HygieneAnalyzer(HygieneConfig()), body)
