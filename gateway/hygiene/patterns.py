"""Volatile-looking content in prompt text: timestamps, ids, nonces, counters.

Algorithm: every pattern we look for contains a digit, so a trigger regex finds the next
digit and only a window around it (48 chars back to catch labels such as "Current time:"
or a month name, 64 forward, both widened to token boundaries) is run through one combined
alternation of compiled patterns. Prose pays one `\\d` search; digit-dense text pays the
combined regex over about its whole length. Each match is then judged in Python:

- `strength` STRONG: volatile by itself (a clock time to the second, a timestamp within
  `recent_window_s` of `now`, an epoch near `now`, a per-request labelled id or nonce, a
  "turn 5 of" counter); WEAK: suspicious only (a bare date that is today, an unlabelled UUID,
  a session-scoped id, an unlabelled high-entropy token); DRIFT: not worth a word on its own
  (an old timestamp, a hex hash) but names the kind when drift sees that very span change.

Pure: `now` is a parameter; nothing is read from the clock.
"""

from __future__ import annotations

import email.utils
import itertools
import math
import re
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

STRONG = 2
WEAK = 1
DRIFT = 0

_MON = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_WDAY = r"(?:(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day|Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_TIME12 = r"[0-2]?\d:[0-5]\d(?::[0-5]\d)?(?:\s?[AaPp]\.?[Mm]\.?)?(?:\s?(?:UTC|GMT|[A-Z]{1,3}T))?"
_TOKEN = r"A-Za-z0-9+/_\-"

_COMBINED = re.compile(
    "|".join(
        [
            r"(?P<iso>(?<![\d-])\d{4}-[01]\d-[0-3]\d(?:[T ][0-2]\d:[0-5]\d(?::[0-5]\d"
            r"(?:[.,]\d{1,9})?)?(?:Z|[+-][0-2]\d:?[0-5]\d|\s?UTC)?)?(?![\d-]))",
            rf"(?P<rfc>{_WDAY},\s\d{{1,2}}\s{_MON}\s\d{{4}}\s\d\d:\d\d(?::\d\d)?"
            r"(?:\s(?:[+-]\d{4}|GMT|UTC|[A-Z]{3}))?)",
            rf"(?P<wr>(?:{_WDAY},?\s+)?{_MON}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}"
            rf"(?:,?\s+(?:at\s+)?{_TIME12})?)",
            rf"(?P<wr2>(?:{_WDAY},?\s+)?(?<!\d)\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?{_MON}\.?,?"
            rf"\s+\d{{4}}(?:,?\s+(?:at\s+)?{_TIME12})?)",
            rf"(?P<sd>(?<![\d/.])\d{{1,2}}/\d{{1,2}}/\d{{4}}(?![\d/])(?:,?\s+{_TIME12})?)",
            r"(?P<lclk>\b(?i:time|now|clock)(?:\s+is)?\s*[:=]?\s*[0-2]?\d:[0-5]\d(?![\d:]))",
            r"(?P<clk>(?<![\d:.])[0-2]?\d:[0-5]\d:[0-5]\d(?:[.,]\d{1,6})?(?:\s?[AaPp][Mm])?"
            r"(?![\d:]))",
            r"(?P<ep>(?<![\d.])1\d{9}(?:\d{3})?(?:\.\d{1,6})?(?!\d|\.\d))",
            r"(?P<uuid>(?<![0-9A-Fa-f-])[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-"
            r"[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}(?![0-9A-Fa-f-]))",
            r"(?P<lid>\b(?P<lidl>(?i:request|req|trace|span|correlation|session|sess|"
            r"conversation|conv|thread|run|idempotency|message|msg|event))[ _-]?(?i:id|key)\b"
            r"[\"'*]{0,2}\s*[:=]?\s*[\"'*]{0,2}(?P<lidv>[A-Za-z0-9][A-Za-z0-9_.:\-]{4,}[A-Za-z0-9]))",
            r"(?P<pid>(?<![A-Za-z0-9])(?P<pidp>(?i:req|request|trace|span|msg|chatcmpl|evt|"
            r"event|txn|corr|call|sess|session|conv|thread|run|job|task|cmpl|resp))[_-]"
            r"[A-Za-z0-9\-]{6,}(?![A-Za-z0-9]))",
            r"(?P<nl>\b(?i:nonce|salt|csrf(?:[_ ]?token)?|cache[_-]?buster|state|challenge|"
            r"random(?:[_ ]?(?:token|string|value|seed))?)[\"'*]{0,2}\s*[:=]\s*[\"'*]{0,2}"
            rf"(?P<nlv>[{_TOKEN}]{{8,}}=*))",
            r"(?P<cnt>\b(?P<cntw>(?i:turn|round|iteration|attempt|retry|try|request|message|"
            r"call|interaction|exchange|step|query|run|loop|cycle))\s*(?P<cnth>#\s*|(?i:no)\.\s*"
            r"|(?i:number)\s+)?\d{1,7}(?P<cnto>\s*(?:(?i:of)|/)\s*\d{1,7})?(?!\d|[.:]\d))",
            rf"(?P<ent>(?<![{_TOKEN}])[{_TOKEN}]{{16,}}={{0,2}}(?![{_TOKEN}]))",
        ]
    )
)
_TRIGGER = re.compile(r"\d")
_BACK = 48
_FWD = 64

_PER_REQUEST_LABEL = re.compile(
    r"(?i:request|\breq\b|trace|span|correlation|nonce|idempotency|message|\bmsg\b|event|"
    r"call|transaction|txn)"
)
_PER_REQUEST_ID = {
    "request",
    "req",
    "trace",
    "span",
    "correlation",
    "idempotency",
    "message",
    "msg",
    "event",
}
_PER_REQUEST_PREFIX = {
    "req",
    "request",
    "trace",
    "span",
    "msg",
    "chatcmpl",
    "evt",
    "event",
    "txn",
    "corr",
    "call",
    "cmpl",
    "resp",
}
_COUNTER_STRONG = {
    "turn",
    "round",
    "iteration",
    "attempt",
    "retry",
    "request",
    "message",
    "interaction",
    "exchange",
    "loop",
    "cycle",
}
_MONTHS = {
    m: i + 1
    for i, m in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
    )
}
_WR_PARTS = re.compile(
    r"(?:(?P<m1>[A-Za-z]{3})[a-z]*\.?\s+(?P<d1>\d{1,2})|(?P<d2>\d{1,2})(?:st|nd|rd|th)?\s+"
    r"(?:of\s+)?(?P<m2>[A-Za-z]{3})[a-z]*\.?)\D*?(?P<y>\d{4})(?:\D+(?P<h>\d{1,2}):(?P<mi>\d\d)"
    r"(?::(?P<s>\d\d))?(?:\s?(?P<ap>[AaPp]))?)?"
)
_SEPARATORS = str.maketrans("", "", "_-+/=.")
_HEX = re.compile(r"[0-9A-Fa-f]+")
_SEP_TIME = re.compile(r"(?P<h>\d{1,2}):(?P<mi>\d\d)(?::(?P<s>\d\d))?(?:\s?(?P<ap>[AaPp]))?")


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


def scan_text(text: str) -> list[Hit]:
    """All volatile-looking spans of `text`, in order (see module docstring)."""
    hits: list[Hit] = []
    n = len(text)
    pos = 0
    search = _TRIGGER.search
    while pos < n:
        m = search(text, pos)
        if m is None:
            break
        d = m.start()
        ws = max(pos, d - _BACK)
        if ws > pos:
            # start on a token boundary so a half-seen id is not judged by its tail
            cut = max(text.rfind(" ", pos, ws), text.rfind("\n", pos, ws))
            ws = cut + 1 if cut >= 0 else pos
        we = min(n, d + _FWD)
        while we < n and not text[we].isspace() and we - d < 4096:
            we += 1
        for mm in _COMBINED.finditer(text, ws, we):
            hit = _judge(mm, text)
            if hit is not None:
                hits.append(hit)
        pos = we if we > d else d + 1
    return hits


def classify_span(text: str, start: int) -> Hit | None:
    """The narrowest hit of any strength covering position `start` of `text` (drift uses it
    to name what changed at the first differing character); None when no pattern does."""
    lo = max(0, start - _BACK)
    cut = max(text.rfind(" ", 0, lo), text.rfind("\n", 0, lo))
    lo = cut + 1 if lo > 0 else 0
    hi = min(len(text), start + _FWD)
    while hi < len(text) and not text[hi].isspace() and hi - start < 4096:
        hi += 1
    best: Hit | None = None
    for mm in _COMBINED.finditer(text, lo, hi):
        hit = _judge(mm, text, permissive=True)
        if (
            hit is not None
            and hit.start <= start < hit.end
            and (best is None or hit.end - hit.start < best.end - best.start)
        ):
            best = hit
    return best


def _judge(mm: re.Match[str], text: str, permissive: bool = False) -> Hit | None:
    g = mm.lastgroup
    s, e = mm.span()
    v = mm.group()
    if g == "iso":
        return Hit("timestamp", s, e, STRONG, _iso_epoch(v), len(v) > 10)
    if g == "rfc":
        try:
            return Hit("timestamp", s, e, STRONG, email.utils.parsedate_to_datetime(v).timestamp())
        except (TypeError, ValueError):
            return Hit("timestamp", s, e, DRIFT)
    if g in ("wr", "wr2"):
        epoch, has_time = _written_epoch(v)
        return Hit("timestamp", s, e, STRONG, epoch, has_time)
    if g == "sd":
        epoch, has_time = _slash_epoch(v)
        return Hit("timestamp", s, e, STRONG, epoch, has_time)
    if g in ("clk", "lclk"):
        return Hit("timestamp", s, e, STRONG)
    if g == "ep":
        x = float(v)
        return Hit("timestamp", s, e, STRONG, x / 1000.0 if len(v.split(".")[0]) == 13 else x)
    if g == "uuid":
        labelled = _PER_REQUEST_LABEL.search(text, max(0, s - 40), s) is not None
        return Hit("uuid", s, e, STRONG if labelled else WEAK)
    if g == "lid":
        vs, ve = mm.span("lidv")
        val = mm.group("lidv")
        if not any(c.isdigit() for c in val):
            return None
        label = mm.group("lidl").lower()
        kind = "uuid" if _is_uuid(val) else "request_id"
        return Hit(kind, vs, ve, STRONG if label in _PER_REQUEST_ID else WEAK)
    if g == "pid":
        if not any(c.isdigit() for c in v):
            return None
        prefix = mm.group("pidp").lower()
        return Hit("request_id", s, e, STRONG if prefix in _PER_REQUEST_PREFIX else WEAK)
    if g == "nl":
        vs, ve = mm.span("nlv")
        val = mm.group("nlv")
        if not (any(c.isdigit() for c in val) or _random_looking(val)):
            return None
        return Hit("nonce", vs, ve, STRONG)
    if g == "cnt":
        word = mm.group("cntw").lower()
        marked = mm.group("cnth") is not None or mm.group("cnto") is not None
        if word in _COUNTER_STRONG:
            return Hit("counter", s, e, STRONG)
        if marked or permissive:
            return Hit("counter", s, e, WEAK)
        return None
    if g == "ent":
        return _judge_token(v, s, e, text, permissive)
    return None


def _judge_token(v: str, s: int, e: int, text: str, permissive: bool) -> Hit | None:
    if len(v) > 128 or text.endswith("base64,", max(0, s - 7), s):
        return None  # inline data (images, files), not an id
    if _HEX.fullmatch(v):
        return Hit("request_id", s, e, DRIFT) if permissive else None
    if _random_looking(v):
        return Hit("nonce", s, e, WEAK)
    return None


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


def _is_uuid(v: str) -> bool:
    return len(v) == 36 and v.count("-") == 4


def _iso_epoch(v: str) -> float | None:
    t = v.replace(" UTC", "").replace("UTC", "").replace(",", ".")
    if t.endswith("Z"):
        t = t[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _written_epoch(v: str) -> tuple[float | None, bool]:
    m = _WR_PARTS.search(v)
    if m is None:
        return None, False
    mon = _MONTHS.get((m.group("m1") or m.group("m2") or "").lower())
    day = int(m.group("d1") or m.group("d2") or 0)
    if mon is None:
        return None, False
    return _epoch(int(m.group("y")), mon, day, m), m.group("h") is not None


def _slash_epoch(v: str) -> tuple[float | None, bool]:
    a, b, rest = v.split("/", 2)
    year = int(rest[:4])
    t = _SEP_TIME.search(rest[4:])
    # month/day and day/month are both in use; the reading closer to a valid date wins
    for mon, day in ((int(a), int(b)), (int(b), int(a))):
        ep = _epoch(year, mon, day, t)
        if ep is not None:
            return ep, t is not None
    return None, t is not None


def _epoch(year: int, mon: int, day: int, t: re.Match[str] | None) -> float | None:
    h = mi = sec = 0
    if t is not None and t.group("h") is not None:
        h, mi, sec = int(t.group("h")), int(t.group("mi")), int(t.group("s") or 0)
        ap = (t.group("ap") or "").lower()
        if ap == "p" and h < 12:
            h += 12
        elif ap == "a" and h == 12:
            h = 0
    try:
        return datetime(year, mon, day, h, mi, sec, tzinfo=UTC).timestamp()
    except ValueError:
        return None
