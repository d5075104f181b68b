"""Review of merge f1aaa3c (hygiene's scan follows what a request does not share with the
previous request of its state entry; scan_text's candidates in one pass over a digit-zeroed
copy).

The xfail(strict=True) tests are findings: they fail on the change as merged. The other
tests pass on it; each kills a mutation of a decision the change made (or moved) that the
change's own tests (tests/test_property_hygiene_incremental.py, tests/test_hygiene_fastpath.py,
the hygiene suite) let survive, because tests/hygiene_whole.py, the reference, shares the
code mutated (`_template_key`, `Snapshot.of`'s budget loop, `MessageOwners`, `parse`) or its
inputs never reach the boundary.
"""

from __future__ import annotations

import tracemalloc

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.conversations import MessageOwners
from gateway.hygiene.drift import Snapshot
from gateway.hygiene.patterns import scan_text
from gateway.hygiene.prompt import _part, parse

NOW = 1717250602.0


# -- findings --------------------------------------------------------------------------


def test_scan_text_transient_memory_stays_near_the_text_size() -> None:
    """A text dense in candidates the judge refuses ('v 1abcde ' repeated): scan_text's
    candidates are yielded one by one, so it holds about the zeroed copy, not a list of
    every candidate (5.5x the text: a 32 MB system prompt grew the gateway by 167 MB)."""
    text = "v 1abcde " * (400_000 // 9)
    tracemalloc.start()
    try:
        hits = scan_text(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert hits == []
    assert peak < 2 * len(text)


# -- mutation killers (pass on the change) ---------------------------------------------


def _key(a: HygieneAnalyzer, body: dict) -> int:
    return a._template_key(body, parse(body, "chat"))


def test_template_key_does_not_mask_the_last_user_message_or_an_unscanned_role() -> None:
    """`_template_key`'s `scanned` replaced `k in hits` (hits of the scanned parts): the
    first part masks its volatile spans only when it is scanned (a scanned role, before the
    last user message). Dropping either condition survives the change's tests (the
    reference analyzer inherits `_template_key`), yet regroups requests into templates."""
    a = HygieneAnalyzer(HygieneConfig())

    def one(first_role: str, ts: str, follow: bool) -> dict:
        msgs = [{"role": first_role, "content": f"At {ts} summarise the deploy log for me."}]
        if follow:
            msgs.append({"role": "user", "content": "go on"})
        return {"model": "m", "messages": msgs}

    t1, t2 = "2024-06-01T14:03:22Z", "2024-06-01T14:05:41Z"
    # scanned head: masked, one template
    assert _key(a, one("system", t1, True)) == _key(a, one("system", t2, True))
    # the last user message is not scanned: not masked
    assert _key(a, one("user", t1, False)) != _key(a, one("user", t2, False))
    # an assistant message is never scanned: not masked
    assert _key(a, one("assistant", t1, True)) != _key(a, one("assistant", t2, True))


def test_a_message_of_exactly_the_identifying_size_names_its_conversation() -> None:
    """`earlier`/`identifying` keep a message of MIN_IDENTIFYING_CHARS (24) chars: a history
    rewrite of a conversation made of such messages is found against the conversation, not
    lost to the head-only template comparison. `>=` -> `>` in either survives."""
    a = HygieneAnalyzer(HygieneConfig(redact=False, warn_min_tokens=0))
    m = [f"message number {c} of ours" for c in "abcdef"]
    assert all(len(x) == 24 for x in m)
    sys = {"role": "system", "content": "You are a careful assistant."}
    first = [sys, {"role": "user", "content": m[0]}, {"role": "assistant", "content": m[1]},
             {"role": "user", "content": m[2]}]
    a.scan({"model": "m", "messages": first}, "chat", None, NOW)
    edited = [sys, {"role": "user", "content": m[5]}, {"role": "assistant", "content": m[1]},
              {"role": "user", "content": m[2]}, {"role": "assistant", "content": m[3]},
              {"role": "user", "content": m[4]}]
    found = a.scan({"model": "m", "messages": edited}, "chat", None, NOW)
    assert [f.kind for f in found if f.evidence == "drift"] == ["history_rewrite"]


def test_a_shared_latest_message_falls_back_to_an_earlier_owner() -> None:
    """`find_latest` skips a SHARED digest and goes on to earlier ones (moved out of `find`
    by the change); returning None at the first SHARED survives the hygiene suite."""
    o = MessageOwners(64)
    c1, c2 = o.open(), o.open()
    o.record(c1, [1, 2])
    o.record(c2, [2])  # 2 is now SHARED
    assert o.find([1, 2]) == c1
    assert o.find_latest(iter([2, 1])) == c1


def test_inline_parse_digests_lone_surrogates_as_the_part_builder_does() -> None:
    """The inline part of a plain message must hash as `_part` does (surrogatepass): two
    messages differing only in a lone surrogate are different parts. The parse property
    test draws st.text(), which has no surrogates, so 'replace' survives it."""
    texts = ["lone \ud800 here", "lone \udfff here"]
    parts = [parse({"messages": [{"role": "user", "content": t}]}, "chat").parts[0]
             for t in texts]
    assert [p.digest for p in parts] == [_part(0, "user", t, "").digest for t in texts]
    assert parts[0].digest != parts[1].digest


def test_a_zero_text_budget_keeps_no_text() -> None:
    """`Snapshot.of`'s budget loop stops at `left <= 0` (rewritten by the change); `< 0`
    keeps an empty, not-whole text for every part, which the reference shares and so the
    property test cannot see."""
    p = parse({"messages": [{"role": "system", "content": "abc"},
                            {"role": "user", "content": "def"}]}, "chat")
    assert all(s.text is None and not s.whole for s in Snapshot.of(p, frozenset(), 0).parts)


def test_a_value_starting_where_the_previous_one_ends_is_reported() -> None:
    """A candidate exactly at the end of the previous match is still judged (`cs < pos`,
    not `<=`): here a written date ending in 'P.M.' is glued to a slashed date, whose
    token has no later candidate through which `_run_start` would find it again."""
    text = "1 June 2024 at 14:03 P.M.1/2/2024 tail"
    assert [(h.kind, h.start, h.end) for h in scan_text(text)] == [
        ("timestamp", 0, 25), ("timestamp", 25, 33)]
