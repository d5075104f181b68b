"""The routing stream's entries as Redis keeps them (pure; used by shared/redis_state.py):
what one costs against the byte bound, how many the bound allows, an entry's fact time and
the stream id of a moment."""

from __future__ import annotations

# Redis's memory per stream entry beyond its fields' bytes (entry header, per-field
# lengths, the radix tree's share, the allocator's size classes: up to a quarter more),
# fitted on MEMORY USAGE of streams of facts of 0 to 2,000 blocks (redis 7): it errs
# high for small facts, within 3% low for 4 KiB ones (bench/RESULTS.md).
ENTRY_OVERHEAD = 16
ENTRY_FACTOR = 1.3


def entry_bytes(fields: dict[bytes, bytes]) -> int:
    """Redis memory one stream entry takes, as the byte bound counts it."""
    return ENTRY_OVERHEAD + int(ENTRY_FACTOR * sum(len(k) + len(v) for k, v in fields.items()))


def stream_maxlen(max_bytes: int, cap: int, written_bytes: int, written: int) -> int:
    """How many facts the stream may keep: the byte bound over the mean bytes per fact
    measured so far (no measurement yet: the count cap)."""
    if written <= 0 or written_bytes <= 0:
        return cap
    return max(1, min(cap, max_bytes * written // written_bytes))


def entry_time(fields: dict[bytes, bytes]) -> float:
    """A stream entry's fact time, or 0 when it has none that reads."""
    try:
        return float(fields.get(b"a", b"0"))
    except ValueError:
        return 0.0


def stream_id(at: float) -> bytes:
    """The first stream id at or after unix time `at` (ids are milliseconds)."""
    return f"{max(0, int(at * 1000))}-0".encode()
