"""Drift: where a request stops extending the previous one of its session or template.

A `Snapshot` keeps, per part of the previous request, its role, hash and (while the
entry's `text_budget` of characters lasts, earliest parts first) its text, plus the tool
names and key-order-free tool hashes. The part where the budget runs out keeps a prefix of
its text (`whole=False`): volatile values sit near the top of a long system prompt far
more often than deep inside it, so a break there is still located to the character and
named; a break past the kept prefix is located to the part only.
`diverge(old, new, head_only)` walks both in rendered order and stops at the first part
that differs:

- tools: same tools in another order -> `tool_order`; same tools in the same order whose
  JSON differs only in key order -> `json_key_order`; else the changed span is classified.
- a message or the prompt: the first differing character (common prefix by binary search
  on slices, so C speed) and the end of the differing run (common suffix); whitespace-only
  change -> `whitespace`; a span a volatile pattern covers -> that kind (`timestamp`,
  `uuid`, `request_id`, `nonce`, `counter`; a bare integer that went up -> `counter`);
  otherwise, past the head (system/developer messages) -> `history_rewrite` (earlier
  conversation edited, removed or summarised), in the head -> `volatile_span`.
- a break in the new request's last part costs nothing (nothing cached follows it) and
  is not reported; neither is a request that extends or is a prefix of the previous one.

`head_only` (requests without a session, compared with another conversation of the same
template) looks only at tools and leading system/developer messages: the conversations
themselves are expected to differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from gateway.hygiene.patterns import Hit, classify_span
from gateway.hygiene.prompt import Prompt

HEAD_ROLES = frozenset({"system", "developer"})


class PartSig(NamedTuple):
    role: str
    digest: int
    text: str | None  # None past the entry's text budget; a prefix when not `whole`
    whole: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    parts: tuple[PartSig, ...]
    tool_names: tuple[str, ...]
    tool_canon: tuple[int, ...]
    tool_digest: tuple[int, ...]  # hash of each tool's text as sent
    values: frozenset[str]  # volatile-looking values seen in scanned parts
    # What the next request's scan skips by (gateway.hygiene.incremental): the positions
    # of the parts scanned for patterns (those before `scan_end` with a scanned role) that
    # had hits, in order; None when not known (every shared part is then looked up).
    hit_parts: tuple[int, ...] | None = None
    scan_end: int = 0

    @staticmethod
    def of(
        p: Prompt,
        values: frozenset[str],
        text_budget: int,
        *,
        hit_parts: tuple[int, ...] | None = None,
        scan_end: int = 0,
        prev: Snapshot | None = None,
        same: int = 0,
    ) -> Snapshot:
        """The snapshot of `p`. `prev` and `same`: the previous snapshot of the entry, whose
        first `same` parts have the roles and digests of `p`'s first `same` parts; its
        signatures past the text budget are reused for them (a conversation's next turn
        builds signatures for its new parts and the budgeted head only)."""
        sigs: list[PartSig] = []
        left = text_budget
        new = tuple.__new__  # a named tuple's own constructor is a Python function
        parts = p.parts
        k = 0
        for part in parts:
            if left <= 0:
                break
            text = part.text
            if len(text) <= left:
                left -= part.size
                sigs.append(new(PartSig, (part.role, part.digest, text, True)))
            else:
                sigs.append(new(PartSig, (part.role, part.digest, text[:left], False)))
                left = 0
            k += 1
        # Past the budget a signature is (role, digest, None, False): the previous
        # snapshot's is the same for a shared part when its budget had run out there too
        # (its text is None; budgets run out earliest parts first, so all later are None).
        if prev is not None and k < same and prev.parts[k].text is None:
            sigs.extend(prev.parts[k:same])
            k = same
        if k < len(parts):
            sigs.extend([new(PartSig, (part.role, part.digest, None, False))
                         for part in parts[k:]])
        return Snapshot(
            parts=tuple(sigs),
            tool_names=tuple(t.name for t in p.tools),
            tool_canon=tuple(t.canon for t in p.tools),
            tool_digest=tuple(hash(t.text) for t in p.tools),
            values=values,
            hit_parts=hit_parts,
            scan_end=scan_end,
        )


@dataclass(frozen=True, slots=True)
class Divergence:
    kind: str
    part: int  # position in the new prompt's parts
    offset: int  # char offset within that part's text
    end: int  # end of the differing span in the new text
    classified: bool  # a named cause (False: `volatile_span` / `history_rewrite` fallback)


def diverge(
    old: Snapshot,
    new: Prompt,
    head_only: bool,
    known: Mapping[int, Sequence[Hit]] | None = None,
    same: int = 0,
) -> Divergence | None:
    """The first break of `new` against `old`, or None. `known`: pattern hits already found
    in some parts of `new` (by position); a hit covering the break names it without
    rescanning the text around it. `same`: how many leading parts of both have equal roles
    and digests, position by position (the caller knows it): the walk starts past them."""
    k_new = 0
    old_parts = old.parts
    k_old = 0
    if old_parts and old_parts[0].role == "tools":
        k_old = 1
    if new.parts and new.parts[0].role == "tools":
        k_new = 1
        d = _tools(old, new, known)
        if d is not None:
            return d
    elif old.tool_names:
        # tools were dropped: the first message now sits where the tools were
        return _at(0, 0, len(new.parts[0].text) if new.parts else 0, "volatile_span", False)
    last = len(new.parts) - 1
    if not head_only and k_old == k_new:
        # the walk would step over these (equal); head_only stops at the first
        # conversation part, equal or not, so it walks from the start (the head is short)
        k_old = k_new = max(k_new, same)
    while k_old < len(old_parts) and k_new < len(new.parts):
        o, n = old_parts[k_old], new.parts[k_new]
        if head_only and (o.role not in HEAD_ROLES or n.role not in HEAD_ROLES):
            return None
        if o.digest != n.digest or o.role != n.role:
            if k_new >= last:
                return None  # the break is in the last part: nothing cached behind it
            return _in_part(o, new, k_new, known)
        k_old += 1
        k_new += 1
    return None


def _at(k: int, offset: int, end: int, kind: str, classified: bool) -> Divergence:
    return Divergence(kind, k, offset, end, classified)


def _tools(
    old: Snapshot, new: Prompt, known: Mapping[int, Sequence[Hit]] | None
) -> Divergence | None:
    tools = new.tools
    digests = tuple(hash(t.text) for t in tools)
    if digests == old.tool_digest:
        return None
    names = tuple(t.name for t in tools)
    canon = tuple(t.canon for t in tools)
    first = next(
        (i for i, (a, b) in enumerate(zip(digests, old.tool_digest, strict=False)) if a != b),
        min(len(digests), len(old.tool_digest)),
    )
    at = tools[first].offset if first < len(tools) else len(new.parts[0].text) - 1
    if len(tools) == len(old.tool_canon) and sorted(canon) == sorted(old.tool_canon):
        if canon != old.tool_canon:
            return _at(0, at, at + len(tools[first].text), "tool_order", True)
        return _at(0, at, at + len(tools[first].text), "json_key_order", True)
    if names == old.tool_names and canon == old.tool_canon:
        return _at(0, at, at + len(tools[first].text), "json_key_order", True)
    if old.parts and old.parts[0].role == "tools" and old.parts[0].text is not None:
        return _in_part(old.parts[0], new, 0, known)
    return _at(0, at, at, "volatile_span", False)


def _in_part(
    o: PartSig, new: Prompt, k: int, known: Mapping[int, Sequence[Hit]] | None
) -> Divergence:
    hits = known.get(k) if known else None
    n = new.parts[k]
    head = n.role in HEAD_ROLES or n.role == "prompt"
    fallback = "volatile_span" if head else "history_rewrite"
    if o.role != n.role or o.text is None:
        return _at(k, 0, 0, fallback, False)
    if not o.whole:
        if n.text.startswith(o.text):
            return _at(k, 0, 0, fallback, False)  # the break is past the kept prefix
        return _prefix_diff(o.text, new, k, head, hits)
    if o.text == n.text:
        # content equal: tool calls, names or non-text parts changed
        return _at(k, len(n.text), len(n.text), fallback, False)
    return _text_diff(o.text, new, k, head, hits)


def _text_diff(old: str, new: Prompt, k: int, head: bool, hits: Sequence[Hit] | None) -> Divergence:
    text = new.parts[k].text
    start = common_prefix(old, text)
    tail = common_suffix(old[start:], text[start:])
    end_new = len(text) - tail
    end_old = len(old) - tail
    # only the run between the common prefix and suffix differs: whitespace-only when its
    # non-blank characters are the same on both sides
    if "".join(old[start:end_old].split()) == "".join(text[start:end_new].split()):
        return _at(k, start, max(end_new, start), "whitespace", True)
    return _classify(old, text, new, k, head, start, end_old, end_new, hits)


def _prefix_diff(
    old: str, new: Prompt, k: int, head: bool, hits: Sequence[Hit] | None
) -> Divergence:
    """As `_text_diff` with only a prefix of the old text: the break lies inside it; its end
    is unknown, so whitespace-only means the new text's non-blank characters continue the
    kept ones, and the classifier names the span from its start."""
    text = new.parts[k].text
    start = common_prefix(old, text)
    kept = "".join(old[start:].split())
    if kept and "".join(text[start : start + 2 * (len(old) - start) + 64].split()).startswith(kept):
        return _at(k, start, start + 1, "whitespace", True)
    return _classify(old, text, new, k, head, start, start, start, hits)


def _classify(
    old: str,
    text: str,
    new: Prompt,
    k: int,
    head: bool,
    start: int,
    end_old: int,
    end_new: int,
    hits: Sequence[Hit] | None,
) -> Divergence:
    # widen to whole tokens so "…:22" vs "…:23" is judged as the timestamp it belongs to
    hit = next((h for h in hits if h.start <= start < h.end), None) if hits else None
    if hit is None:
        hit = classify_span(text, start)
    if hit is not None:
        return _at(k, hit.start, hit.end, hit.kind, True)
    if _counter_step(old, text, start, end_old, end_new):
        return _at(k, start, end_new, "counter", True)
    return _at(
        k, start, max(end_new, start), "volatile_span" if head else "history_rewrite", False
    )


def _counter_step(old: str, new: str, start: int, end_old: int, end_new: int) -> bool:
    """A bare integer that went up between requests ("3 unread" -> "4 unread")."""
    a0 = start
    while a0 > 0 and new[a0 - 1].isdigit():
        a0 -= 1
    a1, b1 = end_old, end_new
    while a1 < len(old) and old[a1].isdigit():
        a1 += 1
    while b1 < len(new) and new[b1].isdigit():
        b1 += 1
    a, b = old[a0:a1], new[a0:b1]
    return a.isdigit() and b.isdigit() and len(b) <= 9 and int(b) > int(a)


def common_prefix(a: str, b: str) -> int:
    """Length of the common prefix: equal windows of growing size (16, 64, 256, ... chars:
    a break near the start, the common case, costs a few short slices), then a binary
    search inside the first window that differs; every comparison is a C slice compare."""
    n = min(len(a), len(b))
    lo, w = 0, 16
    while lo < n:
        hi = min(n, lo + w)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, w = hi, w * 4
    else:
        return n
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: the first difference is in between
        mid = (lo + hi) // 2
        if a[lo : mid + 1] == b[lo : mid + 1]:
            lo = mid + 1
        else:
            hi = mid
    return lo


def common_suffix(a: str, b: str) -> int:
    """Length of the common suffix, as `common_prefix` from the end."""
    n = min(len(a), len(b))
    la, lb = len(a), len(b)
    lo, w = 0, 16
    while lo < n:
        hi = min(n, lo + w)
        if a[la - hi : la - lo] != b[lb - hi : lb - lo]:
            break
        lo, w = hi, w * 4
    else:
        return n
    while lo < hi:
        mid = (lo + hi) // 2
        if a[la - mid - 1 : la - lo] == b[lb - mid - 1 : lb - lo]:
            lo = mid + 1
        else:
            hi = mid
    return lo
