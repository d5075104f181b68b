"""Structural families: tool_order, json_key_order, history_rewrite, whitespace, with
their negatives (same tools rebuilt, conversation growth, an edited last message, a new
conversation in the same session, whitespace changed only in the last message)."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

from tests.hygiene_corpus.common import (
    FORMATS,
    NOW,
    QUESTIONS,
    Case,
    Req,
    _tools,
    _turns,
    chat,
    embed,
)


def _shuffle_keys(v: Any, rng: random.Random) -> Any:
    if isinstance(v, dict):
        keys = list(v)
        rng.shuffle(keys)
        return {k: _shuffle_keys(v[k], rng) for k in keys}
    if isinstance(v, list):
        return [_shuffle_keys(x, rng) for x in v]
    return v


def structural_cases(rng: random.Random, per: int) -> list[Case]:
    cases: list[Case] = []
    for i in range(per):
        sysp = embed(FORMATS[i % 5], "Region", "eu-west", rng)
        tools = _tools(rng, 3 + i % 5)
        turns = _turns(rng, 6)
        sess = None if i % 3 == 0 else f"tools-{i}"

        def reqs(
            tool_lists: list[list[Any]],
            sess: str | None = sess,
            sysp: str = sysp,
            turns: list[str] = turns,
        ) -> tuple[Req, ...]:
            return tuple(
                Req(chat(sysp, turns[: 2 * k + 1], t), sess, NOW + 3 * k)
                for k, t in enumerate(tool_lists)
            )

        shuffled = list(tools)
        while [t["function"]["name"] for t in shuffled] == [t["function"]["name"] for t in tools]:
            rng.shuffle(shuffled)
        cases.append(
            Case(
                f"tool-order-{i}",
                "tool_order",
                reqs([tools, shuffled]),
                "tool_order",
                (None, "tools"),
            )
        )
        krng = random.Random(i)
        rekeyed = copy.deepcopy(tools)
        while list(map(str, rekeyed)) == list(map(str, tools)):
            rekeyed = [_shuffle_keys(t, krng) for t in tools]
        cases.append(
            Case(
                f"key-order-{i}",
                "json_key_order",
                reqs([tools, tools, rekeyed]),
                "json_key_order",
                (None, "tools"),
            )
        )
        # negatives: same tools every time; same tools rebuilt as new objects
        cases.append(
            Case(
                f"neg-tools-same-{i}",
                "negative",
                reqs([tools, copy.deepcopy(tools), copy.deepcopy(tools)]),
                None,
            )
        )
        cases.extend(_history_cases(rng, i, sysp))
        cases.extend(_whitespace_cases(rng, i, sysp))
    return cases


def _history_cases(rng: random.Random, i: int, sysp: str) -> list[Case]:
    turns = _turns(rng, 7)
    sess = f"hist-{i}"
    first = Req(chat(sysp, turns[:5]), sess, NOW)
    kind = i % 4
    if kind == 0:  # compaction: old turns replaced by a summary
        new = [
            f"Summary of the conversation so far: the user asked {i + 2} questions about billing.",
            *turns[3:7],
        ]
        where = 1
    elif kind == 1:  # an old tool result / answer truncated by the client
        new = list(turns[:7])
        new[1] = new[1][:40] + " [truncated]"
        where = 2
    elif kind == 2:  # the oldest exchange dropped (sliding window)
        new = turns[2:7]
        where = 1
    else:  # an earlier user message edited
        new = list(turns[:7])
        new[2] = new[2] + " Also, please answer in French."
        where = 3
    second = Req(chat(sysp, new), sess, NOW + 9)
    out = [
        Case(
            f"history-{i}",
            "history_rewrite",
            (first, second),
            "history_rewrite",
            (where, "user" if where % 2 else "assistant"),
        )
    ]
    # negatives: growth, a regenerated last answer, a new conversation in the same session
    grow = Req(chat(sysp, turns[:7]), sess, NOW + 9)
    out.append(Case(f"neg-grow-{i}", "negative", (first, grow), None))
    edit_last = list(turns[:5])
    edit_last[4] = "Actually, never mind that: " + edit_last[4]
    out.append(
        Case(
            f"neg-edit-last-{i}",
            "negative",
            (first, Req(chat(sysp, edit_last), sess, NOW + 9)),
            None,
        )
    )
    out.append(
        Case(
            f"neg-new-chat-{i}",
            "negative",
            (first, Req(chat(sysp, [QUESTIONS[(i + 1) % 5]]), sess, NOW + 9)),
            None,
        )
    )
    return out


def _whitespace_cases(rng: random.Random, i: int, sysp: str) -> list[Case]:
    turns = _turns(rng, 5)
    edits: list[Callable[[str], str]] = [
        lambda s: s + "\n",
        lambda s: s.replace(". ", ".  ", 1),
        lambda s: s.replace("\n", "\r\n", 1) if "\n" in s else s.replace(" ", "\t", 1),
        lambda s: " " + s,
        lambda s: s.replace(" ", "\u00a0", 1),
    ]
    edit = edits[i % len(edits)]
    sess = None if i % 4 == 0 else f"ws-{i}"
    reqs = (Req(chat(sysp, turns[:1]), sess, NOW), Req(chat(edit(sysp), turns[:3]), sess, NOW + 4))
    out = [Case(f"whitespace-sys-{i}", "whitespace", reqs, "whitespace", (0, "system"))]
    hist = list(turns[:5])
    hist[1] = hist[1].rstrip() + "\n\n"
    out.append(
        Case(
            f"whitespace-history-{i}",
            "whitespace",
            (
                Req(chat(sysp, turns[:3]), f"wsh-{i}", NOW),
                Req(chat(sysp, hist), f"wsh-{i}", NOW + 4),
            ),
            "whitespace",
            (2, "assistant"),
        )
    )
    last = list(turns[:3])
    last[2] = "  " + last[2] + "  \n"
    out.append(
        Case(
            f"neg-ws-last-{i}",
            "negative",
            (
                Req(chat(sysp, turns[:3]), f"wsl-{i}", NOW),
                Req(chat(sysp, last), f"wsl-{i}", NOW + 4),
            ),
            None,
        )
    )
    return out
