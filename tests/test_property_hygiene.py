"""Properties of the hygiene scanner on arbitrary input: any body (valid or not, any text)
is scanned without an exception, and every finding points inside the request it names."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.proxy.inbound import parse_inbound
from gateway.routing.normalize import content_text
from tests.props import chat_body, completion_body, plain_message, text

NOW = 1717250602.0
VOLATILE = st.sampled_from([
    "2024-06-01T14:03:22Z", "14:03:22", "Sat Jun  1 14:03:22 2024", "1717250602",
    "123e4567-e89b-12d3-a456-426614174000", "req_8f3a9c2b7d1e", "nonce=Zx8Kq2Lm9Pw4Rt7Y",
])


@settings(max_examples=300, deadline=None)
@given(st.one_of(chat_body, completion_body), st.one_of(st.none(), text))
def test_any_body_is_scanned_without_error(body: dict[str, Any], session: str | None) -> None:
    analyzer = HygieneAnalyzer(HygieneConfig(redact=False))
    endpoint = "chat" if "messages" in body else "completions"
    for f in analyzer.scan(body, endpoint, session, NOW):  # unvalidated: may be any shape
        assert f.tokens_at_risk >= 0 and f.char_offset >= 0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(text, VOLATILE), min_size=1, max_size=6).map(" ".join),
    st.lists(plain_message, min_size=1, max_size=4),
    st.lists(st.one_of(text, VOLATILE), min_size=1, max_size=6).map(" ".join),
    st.one_of(st.none(), st.just("s")),
)
def test_findings_point_inside_the_message_they_name(
    system: str, turns: list[dict[str, Any]], changed: str, session: str | None
) -> None:
    analyzer = HygieneAnalyzer(HygieneConfig(redact=False))
    for sys_text in (system, changed):  # the second request drifts from the first
        body = {"model": "m", "messages": [{"role": "system", "content": sys_text}, *turns,
                                           {"role": "user", "content": "next"}]}
        raw = parse_inbound(orjson.dumps(body), "chat").body
        findings = analyzer.scan(raw, "chat", session, NOW, validated=True)
        messages = raw["messages"]
        for f in findings:
            assert f.tokens_at_risk >= 0
            if f.message_index is None:
                continue
            assert 0 <= f.message_index < len(messages)
            assert f.role == messages[f.message_index]["role"]
            content = content_text(messages[f.message_index]["content"])
            assert 0 <= f.char_offset <= len(content)
            if f.evidence == "pattern":
                assert content[f.char_offset:f.char_offset + len(f.span)] == f.span
