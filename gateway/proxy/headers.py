"""The headers that tell a client what the gateway did with its request and why its cache
may miss (pure: the route decision and the hygiene findings in, header pairs out).

    x-gateway-cache: route=prefix, predicted=1184, findings=2, first=timestamp,
        severity=warning, message=0, offset=27, tokens_at_risk=1150, fix=move_or_round
    x-gateway-hygiene: timestamp@0:27;uuid@tools:112
    x-gateway-fix: move the time from message 0 (system) into the last user message
        (message 3), after the cached prefix, or round it to the day

`x-gateway-cache` is an RFC 8941 dictionary: `route` (the policy's reason, as
`x-gateway-route`), `predicted` (the cached prompt tokens the gateway expects on the
chosen replica; absent when it cannot tell), and when the request has hygiene findings,
their number and the first one: the warning that puts the most prompt tokens at risk
(else the costliest `info`), with its `kind` as `first`, `severity`, `message` (index into
`messages`, or the part's role, e.g. `tools`), `offset` (the character within that
message's content), `tokens_at_risk` (also what fixing it saves per request) and `fix`
(the remedy's family as one token, gateway.hygiene.remedy.FIX_CODES), last so that readers
of the earlier items are undisturbed. `x-gateway-fix` is that first finding's remedy, one
line of at most 400 characters (remedy.MAX_REMEDY_CHARS) in printable ASCII.
`x-gateway-hygiene` lists every warning as `kind@message:offset` (at most 8). All are on
unless `[hygiene] header = false`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from gateway.hygiene.finding import Finding
from gateway.hygiene.remedy import fix_code

MAX_LISTED: Final = 8
_TOKEN_OK: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                             "0123456789_-.:*")


def _token(text: str) -> str:
    """An sf-token: what the gateway names is its own vocabulary; anything else becomes a
    quoted sf-string, so a header never carries a separator it did not mean."""
    if text and text[0].isalpha() and all(c in _TOKEN_OK for c in text):
        return text
    kept = "".join(c for c in text if c.isascii() and c.isprintable() and c not in '"\\')
    return f'"{kept}"'


def first_finding(findings: Sequence[Finding]) -> Finding | None:
    if not findings:
        return None
    return max(findings, key=lambda f: (f.severity == "warning", f.tokens_at_risk))


def _place(f: Finding) -> str:
    return str(f.message_index) if f.message_index is not None else (f.role or "prompt")


def cache_header(route: str, predicted: int | None, findings: Sequence[Finding]) -> str:
    items = [f"route={_token(route)}"]
    if predicted is not None:
        items.append(f"predicted={predicted}")
    first = first_finding(findings)
    if first is not None:
        place = _place(first)
        items += [f"findings={len(findings)}", f"first={_token(first.kind)}",
                  f"severity={first.severity}",
                  f"message={place if place.isdigit() else _token(place)}",
                  f"offset={first.char_offset}", f"tokens_at_risk={first.tokens_at_risk}",
                  f"fix={fix_code(first.kind)}"]
    return ", ".join(items)


def fix_header(findings: Sequence[Finding]) -> str | None:
    """The first finding's remedy as header text: printable ASCII (a tool name in another
    script becomes `?`), None when it has none."""
    first = first_finding(findings)
    if first is None or not first.remedy:
        return None
    return "".join(c if c.isascii() and c.isprintable() else "?" for c in first.remedy)


def hygiene_header(findings: Sequence[Finding]) -> str | None:
    items = [f"{f.kind}@{_place(f)}:{f.char_offset}"
             for f in findings if f.severity == "warning"][:MAX_LISTED]
    return ";".join(items) if items else None


def response_headers(route: str, predicted: int | None, findings: Sequence[Finding], *,
                     enabled: bool) -> list[tuple[bytes, bytes]]:
    """The header pairs for one answer (none when `[hygiene] header` is off)."""
    if not enabled:
        return []
    out = [(b"x-gateway-cache", cache_header(route, predicted, findings).encode("latin-1"))]
    listed = hygiene_header(findings)
    if listed is not None:
        out.append((b"x-gateway-hygiene", listed.encode("latin-1")))
    fix = fix_header(findings)
    if fix is not None:
        out.append((b"x-gateway-fix", fix.encode("ascii")))
    return out


def repredicted(headers: Sequence[tuple[bytes, bytes]], route: str, predicted: int | None,
                findings: Sequence[Finding]) -> list[tuple[bytes, bytes]]:
    """`headers` with `x-gateway-cache` (where present) saying `predicted`: a P/D request's
    cached tokens are the prefill replica's (the answer's usage reports them), so its
    prediction is the one the client can check."""
    value = cache_header(route, predicted, findings).encode("latin-1")
    return [(k, value if k == b"x-gateway-cache" else v) for k, v in headers]
