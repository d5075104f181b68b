"""The analyzer's scan follows what is new in a request (gateway/hygiene/incremental.py):
an analyzer that has seen a conversation's earlier turns must answer every request as the
whole computation does (tests/hygiene_whole.py: every part walked, looked up, compared,
signed and recorded). Random conversations under random edits: appends, answers with tool
calls, history rewrites (an edited, dropped or summarised earlier message, a rewind),
tool changes, system prompt changes, system reminders inside the conversation,
resends; with and without a session, two tenants,
shared texts between conversations, the chat and the completions endpoint. Findings and
the drift state (snapshots, message owners in their LRU order, template keys) must be
equal after every request, under small caps too."""

from __future__ import annotations

import copy
from typing import Any, Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.drift import Snapshot
from gateway.hygiene.incremental import _common, same_prefix
from gateway.hygiene.prompt import parse
from tests.hygiene_whole import WholeAnalyzer, _same_prefix, whole_parse
from tests.props import chat_body

NOW = 1717250602.0
# A small pool, so conversations share messages (owners' SHARED digests, template heads)
# and equal texts recur within one conversation; volatile values give pattern hits.
PHRASES = [
    "please summarise the design document for the cache layer",
    "the build failed on line 42 of router.py, see the log below",
    "request id: 3f2a9c1e-77b1-4c55-9a51-1f0e2d3c4b5a",
    "it is now 2024-06-01T14:03:22Z and the deploy is running",
    "turn 5 of 20", "ok", "continue", "Current time: 14:03:22.",
    "nonce=Zx8Kq2Lm9Pw4Rt7YvB3n", "req_8f3a9c2b7d1e was retried",
    "the answer is 17 and the price is 19.99 eur",
    "Sat, 01 Jun 2024 14:03:22 GMT", "epoch 1717250602 was logged",
    "we agreed to keep the system prompt stable across turns",
]
text = st.lists(st.sampled_from(PHRASES), min_size=1, max_size=4).map(" ".join)
TOOLS = ["search", "fetch", "calc", "shell"]


def tool(name: str, flip: bool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "parameters": {"type": "object", "properties": {}}}
    if flip:  # the same tool with its keys in another order
        fn = {"parameters": fn["parameters"], "name": name}
    return {"type": "function", "function": fn}


class Conv:
    def __init__(self, system: str | None, session: str | None, tenant: str | None) -> None:
        self.system = system
        self.session = session
        self.tenant = tenant
        self.tools: list[str] = []
        self.flip = False
        self.talk: list[dict[str, Any]] = []

    def body(self, endpoint: Literal["chat", "completions"]) -> dict[str, Any]:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.talk
        if endpoint == "completions":
            return {"model": "m", "prompt": "\n".join(str(m.get("content")) for m in msgs)}
        body: dict[str, Any] = {"model": "m", "messages": copy.deepcopy(msgs)}
        if self.tools:
            body["tools"] = [tool(n, self.flip) for n in self.tools]
        return body


def edit(data: st.DataObject, c: Conv) -> None:
    op = data.draw(st.sampled_from([
        "append", "append", "append", "append", "append", "tool_turn", "edit", "drop",
        "summarise", "rewind", "tools", "tool_order", "system", "resend", "session",
        "list_content", "note"]))
    n = len(c.talk)
    if op == "append" or (n == 0 and op not in ("tools", "tool_order", "system", "session")):
        if c.talk and c.talk[-1]["role"] == "user":
            c.talk.append({"role": "assistant", "content": data.draw(text)})
        c.talk.append({"role": "user", "content": data.draw(text)})
    elif op == "tool_turn":
        call = {"id": f"call_{n}", "type": "function",
                "function": {"name": "search", "arguments": data.draw(text)}}
        c.talk.append({"role": "assistant", "content": None, "tool_calls": [call]})
        c.talk.append({"role": "tool", "tool_call_id": f"call_{n}", "content": data.draw(text)})
        c.talk.append({"role": "user", "content": data.draw(text)})
    elif op == "edit":
        i = data.draw(st.integers(0, n - 1))
        c.talk[i] = dict(c.talk[i], content=data.draw(text))
    elif op == "drop":
        del c.talk[data.draw(st.integers(0, n - 1))]
    elif op == "summarise":
        k = data.draw(st.integers(1, n))
        c.talk[:k] = [{"role": "user", "content": "summary: " + data.draw(text)}]
    elif op == "rewind":
        del c.talk[data.draw(st.integers(1, n)):]
    elif op == "tools":
        c.tools = data.draw(st.lists(st.sampled_from(TOOLS), max_size=3, unique=True))
        c.flip = data.draw(st.booleans())
    elif op == "tool_order":
        c.tools = list(data.draw(st.permutations(c.tools)))
    elif op == "system":
        c.system = data.draw(st.one_of(st.none(), text))
    elif op == "session":
        c.session = data.draw(st.sampled_from([None, "s1", "s2"]))
    elif op == "note":  # a system reminder inside the conversation
        role = data.draw(st.sampled_from(["system", "developer"]))
        c.talk.insert(data.draw(st.integers(0, n)), {"role": role, "content": data.draw(text)})
    elif op == "list_content":
        i = data.draw(st.integers(0, n - 1))
        c.talk[i] = dict(c.talk[i], content=[{"type": "text", "text": data.draw(text)}])
    # "resend": the same body again


def state(a: HygieneAnalyzer) -> tuple[Any, ...]:
    def sig(s: Snapshot) -> tuple[Any, ...]:  # what the whole path's snapshots hold
        return (s.parts, s.tool_names, s.tool_canon, s.tool_digest, s.values)

    return (
        [(k, sig(s)) for k, s in a._sessions.items()],
        [(k, sig(s)) for k, s in a._templates.items()],
        [(k, sig(s)) for k, s in a._conversations.items()],
        list(a._owners._owner.items()), a._owners._next,
        list(a._template_keys.items()),
    )


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(0, 600), st.sampled_from([1, 3, 1024]),
       st.sampled_from([1, 2, 64]))
def test_incremental_scan_equals_the_whole_one(
    data: st.DataObject, text_chars: int, cache: int, sessions: int
) -> None:
    # small caps: every LRU evicts (the message owners hold 16 x max_sessions digests)
    config = HygieneConfig(redact=False, drift_text_chars=text_chars, max_sessions=sessions,
                           max_templates=2, scan_cache_entries=cache)
    inc, whole = HygieneAnalyzer(config), WholeAnalyzer(config)
    convs = [Conv(data.draw(st.one_of(st.none(), text)),
                  data.draw(st.sampled_from([None, "s1"])), tenant)
             for tenant in (None, None, "a", "b")]
    for step in range(data.draw(st.integers(1, 24))):
        c = data.draw(st.sampled_from(convs))
        edit(data, c)
        endpoint: Literal["chat", "completions"] = (
            "completions" if data.draw(st.integers(0, 9)) == 0 else "chat")
        body = c.body(endpoint)
        now = NOW + step
        got = inc.scan(copy.deepcopy(body), endpoint, c.session, now, tenant=c.tenant)
        want = whole.scan(body, endpoint, c.session, now, tenant=c.tenant)
        assert got == want
        assert state(inc) == state(whole)


@settings(max_examples=500, deadline=None)
@given(st.one_of(chat_body, st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant"]), st.integers()),
     "content": st.one_of(st.text(), st.integers(), st.none())}), max_size=5)})))
def test_parse_builds_the_parts_it_built_one_call_a_message(body: dict[str, Any]) -> None:
    if not isinstance(body.get("messages"), list):
        return
    assert parse(body, "chat") == whole_parse(body)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_common_prefix_by_slices(a: list[int], b: list[int]) -> None:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert _common(a, b) == n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]),
                          st.sampled_from(PHRASES)), max_size=8),
       st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]),
                          st.sampled_from(PHRASES)), max_size=8))
def test_same_prefix_equals_the_walk(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> None:
    def prompt(ms: list[tuple[str, str]]) -> Any:
        return parse({"messages": [{"role": r, "content": t} for r, t in ms]}, "chat")

    old = Snapshot.of(prompt(a), frozenset(), 64)
    assert same_prefix(old, prompt(b)) == _same_prefix(old, prompt(b))


def test_a_head_only_comparison_stops_at_the_first_conversation_message() -> None:
    """Without a session or a known conversation only the head is compared, even when the
    request shares more with the template's snapshot: a system reminder after a short
    first message ("ok" names no conversation) is the conversation's, not the head's."""
    config = HygieneConfig(redact=False)
    inc, whole = HygieneAnalyzer(config), WholeAnalyzer(config)
    for reminder in ("Current time: 14:03:22.", "Current time: 14:03:23."):
        body = {"model": "m", "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "ok"},
            {"role": "system", "content": reminder},
            {"role": "user", "content": "continue"}]}
        got = inc.scan(copy.deepcopy(body), "chat", None, NOW)
        assert got == whole.scan(body, "chat", None, NOW)
        assert not any(f.evidence == "drift" for f in got)
