"""Volatile-looking content in prompt text: timestamps, ids, nonces, counters.

Algorithm: everything we look for contains a digit. A prefilter regex (`_CAND`, each match
the digit that starts a run; one pass finds them all, `_candidates`) keeps only the digit
runs that can be a finding: the head of an ISO, slashed or written date, a clock time, a
run of 8+ digits, a token of 6+ characters (the letters in front counted by fixed-width
look-behinds), or a number whose preceding word ends like a counter word ("turn 5",
"request #12", "No. 3"). Plain numbers ("version 3", "19.99", "table 4") fail inside the
engine and cost no Python at all. Each candidate is
then matched by the full regex (`_NUM`: ISO dates/times, slashed dates, day-first and
month-first written dates (RFC 2822 included), clock times, epoch seconds/milliseconds,
and otherwise the rest of the token) and judged in Python, which looks at the few
characters in front of the match only where the kind needs them: the letters of the
token's head (`req_`, the first hex group of a UUID), a month name, or a label
("request id:", "nonce=", "turn"). The prefilter accepts a superset of what the judge can
report, so it changes the cost, not the result.

Each hit has a `strength`:
- STRONG: volatile by itself (a clock time to the second, a timestamp within
  `recent_window_s` of `now`, an epoch near `now`, a per-request labelled id or nonce,
  "turn 5 of 20");
- WEAK: suspicious only (a bare date that is today, an unlabelled UUID, a session-scoped
  id, an unlabelled random-looking token, "step 2 of 5");
- DRIFT: nothing on its own (an old timestamp, a hex hash) but names the kind when drift
  sees that very span change (`permissive=True`).

Pure: `now` is a parameter; nothing is read from the clock.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from gateway.hygiene import timestamps

STRONG = 2
WEAK = 1
DRIFT = 0

_MON = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_WDAY = r"(?:(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day|Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_TIME12 = (
    r"[0-2]?\d:[0-5]\d(?::[0-5]\d)?(?:\s?[AaPp]\.?[Mm]\.?)?"
    r"(?:\s?(?:UTC|GMT|[+-]\d{4}|[A-Z]{1,3}T))?"
)
# every alternative continues the digit that `\d` matched first
_NUM = re.compile(
    r"\d(?:"
    r"(?P<iso>\d{3}-[01]\d-[0-3]\d(?:[T ][0-2]\d:[0-5]\d(?::[0-5]\d(?:[.,]\d{1,9})?)?"
    r"(?:Z|[+-][0-2]\d:?[0-5]\d|\s?UTC)?)?(?![\d-]))"
    rf"|(?P<sd>\d?/\d{{1,2}}/\d{{4}}(?![\d/])(?:,?\s+{_TIME12})?)"
    rf"|(?P<dm>\d?(?:st|nd|rd|th)?\s+(?:of\s+)?{_MON}\.?,?\s+\d{{4}}(?:,?\s+(?:at\s+)?{_TIME12})?)"
    rf"|(?P<md>\d?(?:st|nd|rd|th)?,?\s+\d{{4}}(?![\d.])(?:,?\s+(?:at\s+)?{_TIME12})?)"
    r"|(?P<clk>\d?:[0-5]\d(?P<sec>:[0-5]\d(?:[.,]\d{1,6})?)?(?:\s?[AaPp][Mm])?(?![\d:]))"
    r"|(?P<ep>\d{9}(?:\d{3})?(?:\.\d{1,6})?(?!\d|\.\d))"
    r"|(?P<tok>[0-9A-Za-z_\-]*)"
    r")"
)
# The prefilter: a digit that starts a digit run, followed or preceded by what some
# alternative of `_NUM` or a branch of `_judge`/`_token`/`_counter` needs to report it (a
# superset: the judge decides). Every look-behind is fixed-width and sits after the first
# digit, so the charset scan for the digit stays the regex's prefix; possessive quantifiers
# keep a plain "17 " from backtracking. Branches, cheapest rejection first:
# - "2024-", "1/", "14:": ISO and slashed dates, clock times;
# - "1 June", "1st of", "1, 2024": written dates (the month-first kind needs the year);
# - a token of 6+ characters: t token characters from the digit (6+ digits included) and
#   h head letters in front of it (`_token` walks back over them), h + t >= 6;
# - "#3", "\t3", "turn  3": a counter's separators other than one space;
# - "turn 3", "No. 3", "number 3": a counter word (or the "no"/"number" hop of
#   `_counter`) at a word boundary, any case, one look-behind per word length; "No.3".
_TC = r"[0-9A-Za-z_\-=]"
_HC = r"[A-Za-z_\-]"


def _any_case(word: str) -> str:
    """`turn` -> `[tT][uU][rR][nN]`: case-insensitive without IGNORECASE, which would cost
    the regex engine its quick first-character rejection inside alternations."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in word)


def _words_before(words: list[str]) -> str:
    """One fixed-width look-behind per word length: `\bturn 3`, `\bstep 3`, ..., behind
    one look-behind for the words' last two characters (`rn 3`, `ep 3`, ...): a number after
    any other word ("line 42", "size 3", common in prose and code) is refused by that one
    test instead of by every word length's."""
    by_len: dict[int, list[str]] = {}
    for w in words:
        by_len.setdefault(len(w), []).append(_any_case(w))
    endings = "|".join(sorted({_any_case(w[-2:]) for w in words}))
    each = "|".join(rf"(?<=\b(?:{'|'.join(alts)}) [0-9])" for _, alts in sorted(by_len.items()))
    return rf"(?<=(?:{endings}) [0-9])(?:{each})"


# the counter words and the "No." / "number" hop of `_counter`
_COUNTER_WORDS_ALL = [
    "turn", "round", "iteration", "attempt", "retry", "request", "message", "interaction",
    "exchange", "loop", "cycle", "try", "call", "step", "query", "run", "no", "number",
    "no.", "number.",
]  # fmt: skip
_COUNTER_BEFORE = _words_before(_COUNTER_WORDS_ALL)
_CAND = re.compile(
    r"[0-9](?<![0-9][0-9])(?:"
    r"(?=[0-9]?+(?:[-/:]|[0-9]{2}-[01][0-9]-))"
    r"|(?=[0-9]?+(?:st|nd|rd|th)?+,?+\s++(?:[0-9]{4}|of\s+[JFMASOND]|[JFMASOND][a-z]))"
    rf"|(?={_TC}{{5}})"
    rf"|(?<={_HC}[0-9])(?:(?<={_HC}{{5}}[0-9])|(?<={_HC}{{4}}[0-9])(?={_TC})"
    rf"|(?<={_HC}{{3}}[0-9])(?={_TC}{{2}})|(?<={_HC}{{2}}[0-9])(?={_TC}{{3}})|(?={_TC}{{4}}))"
    r"|(?<=[#\t][0-9])"
    # the last letter of a counter word or a separator, then the words themselves
    r"|(?<=[nNdDtTyYeEpPlLrRoO. \t#] [0-9])"
    rf"(?:(?<=[ \t#] [0-9])|(?<=\.\. [0-9])|{_COUNTER_BEFORE})"
    r"|(?<=\.[0-9])(?<=[nN][oO]\.[0-9]|[eE][rR]\.[0-9]|.\.\.[0-9])"
    r")"
)
# The prefilter for text whose digits are all "0" (each of its digit classes matches "0"),
# led by that literal: the regex engine's search skips to the next "0" fast.
_CAND0 = re.compile("0" + _CAND.pattern.removeprefix("[0-9]"))
_ZERO_DIGITS = {i: "0" for i in range(48, 58)}
# Longer than any look-behind of `_CAND` (the longest: a counter word, a space, a digit)
_BEHIND = max(len(w) for w in _COUNTER_WORDS_ALL) + 16
_HEAD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-")
_TOKEN_EDGE = frozenset("=")
_DIGITS = frozenset("0123456789")
_TOKEN_CHARS = _HEAD_CHARS | _DIGITS
_PATH_CHARS = frozenset("+/")
_MON_BEFORE = re.compile(rf"(?:{_WDAY},?\s+)?{_MON}\.?\s+\Z")
_WDAY_BEFORE = re.compile(rf"{_WDAY},?\s+\Z")
_UUID = re.compile(r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}")
_HEX = re.compile(r"[0-9A-Fa-f]+")
_PREFIXED = re.compile(
    r"(?i:(req|request|trace|span|msg|chatcmpl|evt|event|txn|corr|call|sess|session|conv|"
    r"thread|run|job|task|cmpl|resp))[_-][A-Za-z0-9\-]{6,}"
)
_ID_LABEL = re.compile(
    r"\b(?i:(request|req|trace|span|correlation|session|sess|conversation|conv|thread|run|"
    r"idempotency|message|msg|event)[ _-]?(?:id|key))\b[\"'*]{0,2}\s*[:=]?\s*[\"'*]{0,2}\Z"
)
_NONCE_LABEL = re.compile(
    r"\b(?i:nonce|salt|csrf(?:[_ ]?token)?|cache[_-]?buster|state|challenge|"
    r"random(?:[_ ]?(?:token|string|value|seed))?)[\"'*]{0,2}\s*[:=]\s*[\"'*]{0,2}\Z"
)
_CLOCK_LABEL = re.compile(r"\b(?i:time|now|clock)(?:\s+is)?\s*[:=]?\s*\Z")
_OF_AFTER = re.compile(r"\s*(?:(?i:of)|/)\s*\d{1,7}(?!\d|[.:]\d)")
_PER_REQUEST_LABEL = re.compile(
    r"(?i:request|\breq\b|trace|span|correlation|nonce|idempotency|message|\bmsg\b|event|"
    r"call|transaction|txn)"
)
_PER_REQUEST_ID = {
    "request", "req", "trace", "span", "correlation", "idempotency", "message", "msg", "event"
}  # fmt: skip
_PER_REQUEST_PREFIX = {
    "req", "request", "trace", "span", "msg", "chatcmpl", "evt", "event", "txn", "corr",
    "call", "cmpl", "resp",
}  # fmt: skip
_COUNTER_STRONG = {
    "turn", "round", "iteration", "attempt", "retry", "request", "message", "interaction",
    "exchange", "loop", "cycle",
}  # fmt: skip
_COUNTER_WORDS = _COUNTER_STRONG | {"try", "call", "step", "query", "run"}
_SEPARATORS = str.maketrans("", "", "_-+/=.")
_LABEL_REACH = 40


@dataclass(frozen=True, slots=True)
class Hit:
    """One volatile-looking span: `kind` is a finding kind (`timestamp`, `uuid`,
    `request_id`, `nonce`, `counter`); `epoch` the instant a timestamp names (None when it
    names none, e.g. a bare clock time); `dated` False for a date without a time of day."""

    kind: str
    start: int
    end: int
    base: int  # strength before `now` is consulted
    epoch: float | None = None
    dated: bool = True

    def strength(self, now: float, recent_window_s: float) -> int:
        if self.epoch is None:
            return self.base
        slack = recent_window_s if self.dated else recent_window_s + 86400.0
        if abs(self.epoch - now) > slack:
            return DRIFT
        return STRONG if self.dated else WEAK


def scan_text(text: str, lo: int = 0, hi: int | None = None, permissive: bool = False) -> list[Hit]:
    """Volatile-looking spans of text[lo:hi], in order (see module docstring)."""
    return _scan(text, lo, len(text) if hi is None else hi, permissive, text.isascii())


def _scan(text: str, lo: int, end: int, permissive: bool, ascii_text: bool) -> list[Hit]:
    """`scan_text`; `ascii_text` finds the prefilter's candidates in the text with its
    digits zeroed (`_candidates`) instead of in the text itself (the same candidates)."""
    hits: list[Hit] = []
    match = _NUM.match
    pos = lo
    for cs in _candidates(text, lo, end, ascii_text):
        if cs < pos:
            continue  # inside the previous match
        s = cs
        if s > pos and text[s - 1] in _HEAD_CHARS:
            s = _run_start(text, s, pos)
        m = match(text, s, end)
        if m is None:  # unreachable: `_NUM` matches at every digit
            break
        hit = _judge(m, text, permissive)
        if hit is not None:
            hits.append(hit)
        pos = max(m.end(), cs + 1)
    return hits


def _candidates(text: str, lo: int, end: int, ascii_text: bool) -> Iterator[int]:
    """Where the prefilter matches in text[lo:end], in order, one by one (a list of them
    all would be several times a candidate-dense text's size). ASCII text is searched in a
    copy with every digit "0" (`_CAND0`, that literal first), from `_BEHIND` characters
    before `lo` (look-behinds): the engine skips prose by its literal loop, not a charset
    test per character, and a run the prefilter refuses ("line 42") costs no Python."""
    if not ascii_text:
        yield from (c.start() for c in _CAND.finditer(text, lo, end))
        return
    a = max(0, lo - _BEHIND)
    zeroed = text[a:end].translate(_ZERO_DIGITS)
    first = zeroed.find("0", lo - a)  # a C find skips the prose before it faster still
    if first >= 0:
        yield from (c.start() + a for c in _CAND0.finditer(zeroed, first))


def _run_start(text: str, s: int, pos: int) -> int:
    """Where a full left-to-right pass would have started the match that covers the digit
    at `s`: the first digit of its token when an earlier digit of the same token exists
    (that match runs over `s`), else `s`."""
    ts = s
    while ts > pos and text[ts - 1] in _TOKEN_CHARS:
        ts -= 1
    for i in range(ts, s):
        if text[i] in _DIGITS:
            return i
    return s


def classify_span(text: str, start: int) -> Hit | None:
    """The narrowest hit of any strength covering position `start` of `text` (drift uses it
    to name what changed at the first differing character); None when no pattern does."""
    lo = max(0, start - 64)
    cut = max(text.rfind(" ", 0, lo), text.rfind("\n", 0, lo))
    lo = cut + 1 if lo > 0 else 0
    best: Hit | None = None
    # no volatile value is longer than a few hundred chars; matches stop at the window end
    for hit in scan_text(text, lo, min(len(text), start + 160), permissive=True):
        if hit.start > start:
            break
        if start < hit.end and (best is None or hit.end - hit.start < best.end - best.start):
            best = hit
    return best


def _judge(m: re.Match[str], text: str, permissive: bool) -> Hit | None:
    g = m.lastgroup
    s, e = m.span()
    if g == "iso":
        v = m.group()
        return Hit("timestamp", s, e, STRONG, timestamps.iso(v), len(v) > 10)
    if g == "sd":
        ep, has_time = timestamps.slashed(m.group())
        return Hit("timestamp", s, e, STRONG, ep, has_time)
    if g == "dm":
        w = _WDAY_BEFORE.search(text, max(0, s - 12), s)
        s0 = w.start() if w else s
        v = text[s0:e]
        ep = timestamps.rfc2822(v) if w and ":" in v else None
        if ep is None:
            ep, has_time = timestamps.written(v)
        else:
            has_time = True
        return Hit("timestamp", s0, e, STRONG, ep, has_time)
    if g == "md":
        mon = _MON_BEFORE.search(text, max(0, s - 24), s)
        if mon is None:
            return _token(
                text,
                s,
                s + 1 + len(m.group("md")) - len(m.group("md").lstrip("0123456789")),
                permissive,
            )
        ep, has_time = timestamps.written(text[mon.start() : e])
        return Hit("timestamp", mon.start(), e, STRONG, ep, has_time)
    if g == "clk":
        if m.group("sec") or _CLOCK_LABEL.search(text, max(0, s - 16), s):
            if s > 0 and (text[s - 1].isdigit() or text[s - 1] in ":."):
                return None  # the tail of something longer (a version, a MAC address)
            return Hit("timestamp", s, e, STRONG)
        return None
    if g == "ep":
        if text[s] != "1" or (s > 0 and text[s - 1] in "._-"):
            return _token(text, s, e, permissive)
        x = float(m.group())
        digits = len(m.group().split(".")[0])
        return Hit("timestamp", s, e, STRONG, x / 1000.0 if digits == 13 else x)
    return _token(text, s, e, permissive)


def _token(text: str, s: int, e: int, permissive: bool) -> Hit | None:
    """A token holding a digit: an id, a UUID, a nonce, a counter's number, or nothing."""
    ts = s
    while ts > 0 and text[ts - 1] in _HEAD_CHARS:
        ts -= 1
    while e < len(text) and text[e] in _TOKEN_EDGE:  # base64 tails
        e += 1
    tok = text[ts:e].rstrip("-_")
    e = ts + len(tok)
    if ts > 0 and text[ts - 1] in _PATH_CHARS:
        return None  # inside a path or base64 run
    if tok.isdigit() and len(tok) <= 7:
        return _counter(text, ts, e, permissive)
    if len(tok) < 6:
        return None
    ctx_lo = max(0, ts - _LABEL_REACH)
    if len(tok) == 36 and _UUID.fullmatch(tok):
        labelled = _PER_REQUEST_LABEL.search(text, ctx_lo, ts) is not None
        return Hit("uuid", ts, e, STRONG if labelled else WEAK)
    p = _PREFIXED.fullmatch(tok)
    if p is not None:
        return Hit(
            "request_id", ts, e, STRONG if p.group(1).lower() in _PER_REQUEST_PREFIX else WEAK
        )
    label = _ID_LABEL.search(text, ctx_lo, ts)
    if label is not None:
        return Hit(
            "request_id", ts, e, STRONG if label.group(1).lower() in _PER_REQUEST_ID else WEAK
        )
    if len(tok) >= 8 and _NONCE_LABEL.search(text, ctx_lo, ts) is not None:
        return Hit("nonce", ts, e, STRONG)
    if len(tok) > 128 or text.endswith("base64,", max(0, ts - 7), ts):
        return None  # inline data (images, files), not an id
    if _HEX.fullmatch(tok):
        return Hit("request_id", ts, e, DRIFT) if permissive and len(tok) >= 8 else None
    if len(tok) >= 16 and _random_looking(tok):
        return Hit("nonce", ts, e, WEAK)
    return None


def _counter(text: str, s: int, e: int, permissive: bool) -> Hit | None:
    """ "turn 5", "request #12", "Attempt No. 3 of 5": the word in front of the number
    names a counter (plain string operations: this runs for every small number)."""
    j = s - 1
    if j < 0 or text[j] not in " #.\t":
        return None
    while j >= 0 and text[j] in " #\t":
        j -= 1
    marked = "#" in text[j + 1 : s]
    k = _word_start(text, j)
    word = text[k : j + 1].lower()
    if word.rstrip(".") in ("no", "number") and k > 1:
        marked = True
        j = k - 2
        k = _word_start(text, j)
        word = text[k : j + 1].lower()
    word = word.lstrip("([{\"'*")
    if word not in _COUNTER_WORDS:
        return None
    start = j + 1 - len(word)
    of = _OF_AFTER.match(text, e)
    end = of.end() if of else e
    if word in _COUNTER_STRONG:
        return Hit("counter", start, end, STRONG)
    if marked or of is not None or permissive:
        return Hit("counter", start, end, WEAK)
    return None


def _word_start(text: str, j: int) -> int:
    lo = max(0, j - 16)
    return max(text.rfind(" ", lo, j + 1), text.rfind("\n", lo, j + 1)) + 1 if j >= 0 else 0


def _random_looking(v: str) -> bool:
    """Random tokens switch between letter case and digits often and spread over many
    symbols; identifiers made of words do neither."""
    v = v.translate(_SEPARATORS)
    if len(v) < 12 or not any(c.isdigit() for c in v) or not any(c.isalpha() for c in v):
        return False
    switches = sum(1 for a, b in itertools.pairwise(v) if _cls(a) != _cls(b))
    if switches < 0.3 * len(v):
        return False
    counts = Counter(v)
    entropy = -sum(c / len(v) * math.log2(c / len(v)) for c in counts.values())
    return entropy >= 3.3


def _cls(c: str) -> int:
    return 0 if c.isdigit() else 1 if c.isupper() else 2 if c.islower() else 3
