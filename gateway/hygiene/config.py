"""Hygiene settings (TOML section `[hygiene]`, env `GATEWAY_HYGIENE__*`).

Knobs:
- `enabled`: run the analyzer at all.
- `redact`: findings carry `<kind:N chars>` instead of the offending text.
- `header`: answer proxied calls with `x-gateway-cache` (route, predicted cached tokens,
  the first finding with its cost and fix), `x-gateway-hygiene` (every warning's place)
  and `x-gateway-fix` (the first finding's remedy); on by default (gateway.proxy.headers).
- `rewrite_sort_tools` / `rewrite_schema_keys`: opt-in body rewrites that keep the prefix
  stable (tools sorted by function name; JSON keys inside tool schemas sorted). Message
  content is never changed.
- `warn_min_tokens`: a break with fewer prompt tokens behind it is `info`, not `warning`
  (a break in front of a short tail costs almost nothing).
- `recent_window_s`: a timestamp within this distance of `now` is read as "the current time".
- `max_sessions` / `max_templates`: LRU caps of the drift state (one entry per session, one
  per template for requests without a session).
- `drift_text_chars`: per entry, message/tool text kept verbatim to locate a divergence to
  the character (earliest parts first; the part where it runs out keeps a prefix); past it
  only hashes are kept (the divergence is then located to the message). Worst case about
  (max_sessions + max_templates) x drift_text_chars characters: 42 MB of ASCII at the
  defaults. 8 KiB covers the head of the prompt, where volatile values live.
- `scan_cache_entries`: LRU of pattern-scan results keyed by content hash, so an unchanged
  system prompt or tool list is scanned once, not on every request.
- `log_interval_s` / `log_max_per_s`: the log gets the same kind at the same place for the
  same session/template at most once per interval, and at most this many findings per
  second; what is held back is logged as one summary line per interval
  (gateway.hygiene.lograte).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class HygieneConfig:
    enabled: bool = True
    redact: bool = True
    header: bool = True
    rewrite_sort_tools: bool = False
    rewrite_schema_keys: bool = False
    warn_min_tokens: int = 64
    recent_window_s: float = 2 * 86400.0
    max_sessions: int = 4096
    max_templates: int = 1024
    drift_text_chars: int = 8192
    scan_cache_entries: int = 1024
    log_interval_s: float = 60.0
    log_max_per_s: int = 20

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_templates", "scan_cache_entries", "log_max_per_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"hygiene.{name} must be >= 1")
        for name in ("warn_min_tokens", "drift_text_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"hygiene.{name} must be >= 0")
        if self.recent_window_s <= 0 or self.log_interval_s < 0:
            raise ValueError("hygiene.recent_window_s must be > 0 and log_interval_s >= 0")
