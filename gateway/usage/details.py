"""Which replicas answer without `prompt_tokens_details.cached_tokens` (pure).

vLLM fills `cached_tokens` only with `--enable-prompt-tokens-details`. A replica is
listed as missing it when it sent usage (`prompt_tokens` known) without `cached_tokens`
and has never reported `cached_tokens`. A single report takes it off the list for good:
vLLM <= 0.23 leaves the details out whenever nothing was cached, so a replica with the
flag on can look "missing" during a cold start, but never after its first cache hit.

`probe(replica, reports)` takes the verdict of the monitor's start-up probe (two identical
small completions, the second a cache hit, so a replica with the flag reports details in at
least one): it overrides what was known, in both directions, because a replica that came
(back) up may have been restarted with different flags. It counts as one record.
"""

from __future__ import annotations

from gateway.usage.record import UsageRecord


def missing_cached_tokens_warning(replica: str) -> str:
    return (
        f"replica {replica} does not report cached_tokens: "
        "start vLLM with --enable-prompt-tokens-details"
    )


class CachedTokensReporting:
    def __init__(self) -> None:
        self._reporting: set[str] = set()
        self._missing: dict[str, int] = {}  # replica -> records without cached_tokens

    def add(self, rec: UsageRecord) -> bool:
        """Track one record; True when it is the first sign that its replica lacks the flag."""
        replica = rec.replica
        if rec.prompt_tokens is None or replica is None:
            return False
        if rec.cached_tokens is not None:
            if replica not in self._reporting:
                self._reporting.add(replica)
                self._missing.pop(replica, None)
            return False
        if replica in self._reporting:
            return False
        n = self._missing.get(replica, 0)
        self._missing[replica] = n + 1
        return n == 0

    def forget(self, replica: str) -> None:
        """The replica left the fleet."""
        self._reporting.discard(replica)
        self._missing.pop(replica, None)

    def missing(self) -> list[str]:
        return sorted(self._missing)

    def reports(self, replica: str) -> bool | None:
        """True: has reported cached_tokens; False: only usage without it; None: no usage yet."""
        if replica in self._reporting:
            return True
        return False if replica in self._missing else None

    def probe(self, replica: str, reports: bool) -> bool:
        """Record a start-up probe's verdict; True when it newly marks the replica missing."""
        if reports:
            self._reporting.add(replica)
            self._missing.pop(replica, None)
            return False
        self._reporting.discard(replica)
        newly = replica not in self._missing
        self._missing[replica] = self._missing.get(replica, 0) + 1
        return newly
