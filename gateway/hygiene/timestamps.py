"""The instant a matched timestamp names (UTC when it carries no zone), so the scanner can
tell "the current time" (within `recent_window_s` of `now`) from a date in history.
Every function returns None for text that does not name a valid instant."""

from __future__ import annotations

import email.utils
import re
from datetime import UTC, datetime

MONTHS = {
    m: i + 1
    for i, m in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
    )
}
_TIME = re.compile(r"(?P<h>\d{1,2}):(?P<mi>\d\d)(?::(?P<s>\d\d))?(?:\s?(?P<ap>[AaPp]))?")
_WORDS = re.compile(r"[A-Za-z]{3}")
_NUMS = re.compile(r"\d+")


def iso(v: str) -> float | None:
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


def rfc2822(v: str) -> float | None:
    try:
        return email.utils.parsedate_to_datetime(v).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


def written(v: str) -> tuple[float | None, bool]:
    """'June 1, 2024 at 2:03 PM', 'Saturday, 1 June 2024, 14:03' -> (epoch, has time)."""
    clock = _TIME.search(v)
    date_part = v[: clock.start()] if clock else v
    mon = next((MONTHS[w.lower()] for w in _WORDS.findall(date_part) if w.lower() in MONTHS), None)
    nums = [int(x) for x in _NUMS.findall(date_part)]
    years = [x for x in nums if x >= 1000]
    days = [x for x in nums if x < 100]
    if mon is None or not years or not days:
        return None, clock is not None
    return epoch(years[0], mon, days[0], clock), clock is not None


def slashed(v: str) -> tuple[float | None, bool]:
    """'06/01/2024 14:03:22': month/day and day/month are both in use; the first reading
    that is a valid date wins."""
    a, b, rest = v.split("/", 2)
    clock = _TIME.search(rest[4:])
    for mon, day in ((int(a), int(b)), (int(b), int(a))):
        ep = epoch(int(rest[:4]), mon, day, clock)
        if ep is not None:
            return ep, clock is not None
    return None, clock is not None


def epoch(year: int, mon: int, day: int, clock: re.Match[str] | None) -> float | None:
    h = mi = sec = 0
    if clock is not None:
        h, mi, sec = int(clock.group("h")), int(clock.group("mi")), int(clock.group("s") or 0)
        ap = (clock.group("ap") or "").lower()
        if ap == "p" and h < 12:
            h += 12
        elif ap == "a" and h == 12:
            h = 0
    try:
        return datetime(year, mon, day, h, mi, sec, tzinfo=UTC).timestamp()
    except ValueError:
        return None
