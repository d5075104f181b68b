"""Digest of a whole usage log for `gateway report` (pure).

The same figures as `/stats` (`gateway.usage.stats`), with windows relative to the log's
last timestamp (what "the last minute" means for a log read later), plus the top sessions
and tenants by uncached prompt tokens: the requests that paid for prefill.

uncached tokens = prompt_tokens - cached_tokens, over records whose engine reported
cached_tokens (a P/D request's: its prefill replica's own hits, and the tokens it pulled
back from a decoder neither cached nor uncached). Prompt tokens of records without
cached_tokens are shown apart (`unknown_prompt_tokens`) rather than guessed as
all-uncached or all-cached.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.usage.details import CachedTokensReporting, missing_cached_tokens_warning
from gateway.usage.record import UsageRecord
from gateway.usage.stats import UsageWindows

NO_SESSION = "(none)"


class _Spend:
    __slots__ = ("cached", "prompt", "requests", "uncached", "unknown")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt = 0
        self.cached = 0
        self.uncached = 0
        self.unknown = 0

    def add(self, rec: UsageRecord) -> None:
        self.requests += 1
        prompt = rec.prompt_tokens
        if prompt is None:
            return
        self.prompt += prompt
        # P/D: the prefill replica's own hits; tokens it pulled back from a decoder were
        # neither cached nor computed (UsageRecord.cache_split)
        own, cached, _ = rec.cache_split()
        if cached is None or own is None:
            self.unknown += prompt
        else:
            self.cached += cached
            self.uncached += max(0, own - cached)

    def as_json(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "requests": self.requests,
            "prompt_tokens": self.prompt,
            "cached_tokens": self.cached,
            "uncached_tokens": self.uncached,
            "unknown_prompt_tokens": self.unknown,
        }


def _top(spend: dict[str, _Spend], n: int) -> list[dict[str, Any]]:
    ranked = sorted(spend.items(), key=lambda kv: (-kv[1].uncached, -kv[1].unknown, kv[0]))
    return [s.as_json(name) for name, s in ranked[:n]]


def digest(
    records: Iterable[UsageRecord],
    *,
    top: int = 10,
    bucket_s: float = 10.0,
    ttft_target_ms: float = 1000.0,
    tpot_target_ms: float = 100.0,
) -> dict[str, Any]:
    windows = UsageWindows(
        bucket_s=bucket_s, ttft_target_ms=ttft_target_ms, tpot_target_ms=tpot_target_ms
    )
    details = CachedTokensReporting()
    sessions: dict[str, _Spend] = {}
    tenants: dict[str, _Spend] = {}
    count = 0
    for rec in records:
        count += 1
        windows.add(rec)
        details.add(rec)
        skey = rec.session or NO_SESSION
        s = sessions.get(skey)
        if s is None:
            s = sessions[skey] = _Spend()
        s.add(rec)
        tkey = rec.tenant or NO_SESSION
        t = tenants.get(tkey)
        if t is None:
            t = tenants[tkey] = _Spend()
        t.add(rec)
    last = windows.last_ts
    warnings = [missing_cached_tokens_warning(r) for r in details.missing()]
    out: dict[str, Any] = {
        "records": count,
        "first_ts": windows.first_ts,
        "last_ts": last,
        "windows": {} if last is None else windows.windows(last),
        "top_sessions": _top(sessions, top),
        "top_tenants": _top(tenants, top),
        "warnings": warnings,
    }
    whole = out["windows"].get("all")
    if whole is not None:
        for key, label in (("ttft", "TTFT"), ("tpot", "TPOT")):
            fig = whole[key]
            if fig["ok"] is False:
                warnings.append(
                    f"{label} p99 over the whole log is {fig['p99_ms']:.0f} ms "
                    f"(target {fig['target_ms']:.0f} ms)"
                )
        if whole["records_without_cached_tokens"]:
            warnings.append(
                f"{whole['records_without_cached_tokens']} records have prompt_tokens but no "
                "cached_tokens; they are left out of cached_ratio and delivered"
            )
    return out
