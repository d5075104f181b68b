"""What a request shares with the previous request of its drift state entry, so that the
analyzer's per-request work follows what is new (pure helpers of `HygieneAnalyzer.scan`).

An agent conversation grows to hundreds of messages and every turn resends all of them.
Parsing still hashes every message (C speed: about 10 us for 256 KiB; holding the previous
request's text to compare it instead would cost the whole conversation's size per state
entry), but past the parse a turn pays for its new parts:

- `same_prefix`: the parts that keep their position, role and digest, from C comparisons
  of slices instead of a Python step per part;
- `scan_positions`: which parts to look up in the pattern-hit cache. A shared part the
  previous request scanned without hits has none now either: hits follow from the digest
  (the hit cache is keyed by it), so only the shared parts that had hits are looked up
  again (their values feed `values` and the snapshot) with the new parts;
- `earlier`: the digests that name the implicit conversation, derived latest first and
  lazily (`MessageOwners.find_latest` stops at the first one it knows, usually the first);
- `identifying(p, tenant)`: the conversation messages to record (all of them: recording
  renews their recency in the owners' LRU, which must keep a live conversation fresh);
- `Snapshot.of(..., prev=, same=)` (drift.py) reuses the signatures of the shared parts and
  `diverge(..., same=)` starts its walk past them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import itemgetter

import xxhash

from gateway.hygiene.drift import Snapshot
from gateway.hygiene.prompt import TEMPLATE_OVERHEAD, Prompt

SCANNED_ROLES = frozenset({"system", "developer", "user", "tools", "prompt"})
# Parts every conversation of a template shares: they do not tell conversations apart.
HEAD_PARTS = frozenset({"system", "developer", "tools", "prompt"})
# A message this short ("ok", "continue", a one-word tool result) is sent by many
# conversations: it names none of them, so it neither owns nor finds a conversation.
MIN_IDENTIFYING_CHARS = 24
# `size` is text + extra + the template overhead
_LEAST = MIN_IDENTIFYING_CHARS + TEMPLATE_OVERHEAD
_FEW = 8  # parts compared one by one (a one-shot request has two or three)
_SIG_ROLE, _SIG_DIGEST = itemgetter(0), itemgetter(1)  # drift.PartSig
_PART_ROLE, _PART_DIGEST = itemgetter(1), itemgetter(4)  # prompt.Part


def scan_end(p: Prompt) -> int:
    """Parts before this position are scanned for patterns when their role is scanned: the
    last user message and what follows have nothing cached behind them (a completions
    prompt is scanned whole)."""
    return len(p.parts) if p.endpoint == "completions" else p.last_user


def same_prefix(old: Snapshot, p: Prompt) -> int:
    """How many leading parts have the role and digest of the previous request's, position
    by position."""
    if len(p.parts) <= _FEW:  # a step per part costs less than the lists for a few
        n = 0
        for o, part in zip(old.parts, p.parts, strict=False):
            if o.digest != part.digest or o.role != part.role:
                break
            n += 1
        return n
    n = _common(list(map(_SIG_DIGEST, old.parts)), list(map(_PART_DIGEST, p.parts)))
    if n == 0:
        return 0
    return _common(list(map(_SIG_ROLE, old.parts[:n])), list(map(_PART_ROLE, p.parts[:n])))


def _common(a: Sequence[object], b: Sequence[object]) -> int:
    """Length of the common prefix of two lists: one slice compare when one extends the
    other (a conversation's next turn), else a binary search of slice compares."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def scan_positions(p: Prompt, old: Snapshot | None, same: int) -> list[int]:
    """The positions whose pattern hits the request needs, in order: every scanned part
    except the shared ones that the previous request scanned and found nothing in."""
    end = scan_end(p)
    lo = 0
    out: list[int] = []
    if old is not None and old.hit_parts is not None:
        # below `lo` a part is shared and was scanned by the previous request too
        lo = min(same, old.scan_end, end)
        out = [k for k in old.hit_parts if k < lo]
    parts = p.parts
    out.extend([k for k in range(lo, end) if parts[k].role in SCANNED_ROLES])
    return out


def has_talk(p: Prompt) -> bool:
    """Whether any part is a conversation message (the last one usually is)."""
    return any(part.role not in HEAD_PARTS for part in reversed(p.parts))


def earlier(p: Prompt, tenant: str | None) -> Iterator[int]:
    """The identifying conversation messages before the last conversation message (that
    one is new), latest first, as the tenant's digests."""
    last = True
    for part in reversed(p.parts):
        if part.role in HEAD_PARTS:
            continue
        if last:
            last = False
        elif part.size >= _LEAST:
            yield scoped(tenant, part.digest)


def identifying(p: Prompt, tenant: str | None) -> list[int]:
    """The identifying conversation messages, in order."""
    return [scoped(tenant, part.digest) for part in p.parts
            if part.role not in HEAD_PARTS and part.size >= _LEAST]


def scoped(tenant: str | None, digest: int) -> int:
    """A message digest as its tenant's: equal messages of two tenants never name one
    implicit conversation."""
    if tenant is None:
        return digest
    return xxhash.xxh3_64_intdigest(tenant.encode("utf-8", "surrogatepass"), seed=digest)
