"""HygieneAnalyzer: findings for one request from patterns and from drift.

Per request (`scan`):
1. `prompt.parse` turns the body into rendered-order parts (tools, messages / prompt).
2. The state entry of the request's session (or, without one, of the implicit
   conversation it continues, recognised by its earlier messages (conversations.py), so
   a history rewrite is compared with the conversation's previous request; or, for a
   request that continues none, of its template: a hash of the model, the sorted tool
   names and the first 256 chars of the first part with volatile-looking spans masked, so
   a timestamp at the top does not hide the template, compared on the head only) is
   looked up in an LRU, keyed by the request's tenant too. `drift.diverge` names the
   first break against that previous request (`evidence="drift"`).
3. Pattern evidence comes from the parts a client regenerates per request: tools,
   system/developer messages and user messages before the last user message (assistant
   and tool messages replay the past; the last user message has nothing cached behind it).
   Parts identical to the previous request's are not reported (what stays the same does
   not break anything), nor are values seen in the previous request. A STRONG hit with at
   least `warn_min_tokens` behind it is a `warning`, anything else `info`.
   Hits are cached per part hash (`scan_cache_entries`), so an unchanged system prompt or
   tool list costs a hash, not a scan.
4. The new request becomes the entry's snapshot.

Past the parse, a request pays for what it does not share with the entry's previous
request (gateway.hygiene.incremental): the leading parts with that request's roles and
digests are neither looked up in the hit cache (unless they had hits), nor walked by
drift, nor signed again.

Each finding carries its remedy, written from where it was found (gateway.hygiene.remedy):
the previous request's tool order is at hand for a `tool_order` finding.

`rewrite` applies the opt-in body rewrites. Findings are logged (deduplicated, summed up)
by the usage recorder (gateway.hygiene.lograte) and shown to the client by
gateway.proxy.headers. Pure: `now` is a parameter.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal

import xxhash

from gateway.hygiene import rewrite as rewrites
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.conversations import MessageOwners
from gateway.hygiene.drift import Divergence, Snapshot, diverge
from gateway.hygiene.finding import Finding
from gateway.hygiene.incremental import (
    SCANNED_ROLES,
    earlier,
    has_talk,
    identifying,
    same_prefix,
    scan_end,
    scan_positions,
)
from gateway.hygiene.patterns import STRONG, WEAK, Hit, classify_span, scan_text
from gateway.hygiene.prompt import Prompt, parse, validate
from gateway.hygiene.remedy import remedy, where

# Message digests remembered per conversation slot to recognise implicit conversations.
_DIGESTS_PER_CONVERSATION = 16
_TEMPLATE_CHARS = 256
_MAX_VALUES = 512
_MAX_FINDINGS = 16
_SPAN_CHARS = 200
_WS = re.compile(r"\s+")


class HygieneAnalyzer:
    def __init__(self, config: HygieneConfig) -> None:
        self.config = config
        # Every entry is the tenant's own (the API key's; None without keys): a request is
        # compared only with its own tenant's earlier requests, so one tenant that sends
        # another's session id, messages or template learns nothing of their prompts from
        # its findings, and plants none in theirs.
        self._sessions: OrderedDict[tuple[str | None, str], Snapshot] = OrderedDict()
        self._templates: OrderedDict[tuple[str | None, int], Snapshot] = OrderedDict()
        self._conversations: OrderedDict[int, Snapshot] = OrderedDict()
        self._owners = MessageOwners(_DIGESTS_PER_CONVERSATION * config.max_sessions)
        self._hits: OrderedDict[int, tuple[Hit, ...]] = OrderedDict()
        self._template_keys: OrderedDict[tuple[object, ...], int] = OrderedDict()

    def scan(
        self,
        body: Mapping[str, Any],
        endpoint: Literal["chat", "completions"],
        session: str | None,
        now: float,
        *,
        validated: bool = False,
        tenant: str | None = None,
    ) -> list[Finding]:
        """Findings for one request. `validated=True` says the caller has already checked
        the body at least as strictly as `prompt.validate` (the proxy's `parse_inbound`,
        `gateway lint`'s reader), so the check is not repeated; otherwise a body `validate`
        rejects has no findings."""
        if not self.config.enabled:
            return []
        if not validated:
            try:
                validate(body, endpoint)
            except ValueError:
                return []  # the proxy answers malformed bodies; nothing to judge here
        p = parse(body, endpoint)
        if not p.parts:
            return []
        state: OrderedDict[Any, Snapshot]
        key: Any
        conv: int | None = None
        talk = session is None and has_talk(p)
        if talk:
            conv = self._owners.find_latest(earlier(p, tenant))
            if conv is not None and conv not in self._conversations:
                conv = None  # its snapshot was forgotten: nothing to compare with
        head_only = session is None and conv is None
        if session is not None:
            state, key, cap = self._sessions, (tenant, session), self.config.max_sessions
        elif conv is not None:
            state, key, cap = self._conversations, conv, self.config.max_sessions
        else:
            state, key, cap = (
                self._templates,
                (tenant, self._template_key(body, p)),
                self.config.max_templates,
            )
        old = state.get(key)
        same = same_prefix(old, p) if old is not None else 0
        hits = {k: self._hits_of(p, k) for k in scan_positions(p, old, same)}
        findings: list[Finding] = []
        seen: frozenset[str] = frozenset()
        if old is not None:
            seen = old.values
            d = diverge(old, p, head_only=head_only, known=hits, same=same)
            if d is not None:
                findings.append(self._drift_finding(p, d, session, head_only=head_only,
                                                    before=old.tool_names))
        findings.extend(self._pattern_findings(p, hits, same, seen, findings, session, now,
                                               _MAX_FINDINGS - len(findings)))
        values = (
            frozenset(p.parts[k].text[h.start : h.end] for k, found in hits.items()
                      for h in found)
            if hits
            else frozenset()
        )
        if len(values) > _MAX_VALUES:
            values = frozenset(sorted(values)[:_MAX_VALUES])
        snapshot = Snapshot.of(
            p, values, self.config.drift_text_chars,
            hit_parts=tuple([k for k, found in hits.items() if found]), scan_end=scan_end(p),
            prev=old, same=same,
        )
        _remember(state, key, snapshot, cap)
        if talk:
            if conv is None:
                conv = self._owners.open()
            else:  # new conversations still teach their template's head
                template = (tenant, self._template_key(body, p))
                _remember(self._templates, template, snapshot, self.config.max_templates)
            _remember(self._conversations, conv, snapshot, self.config.max_sessions)
            # Every message, the shared ones too: recording renews a message's recency in
            # the owners' LRU, and a live conversation (its early messages, a SHARED mark
            # many conversations repeat) must stay the freshest under pressure; recording
            # only the new ones would let them age out from their first request on (5 us
            # at 48 messages is what that would save).
            self._owners.record(conv, identifying(p, tenant))
        return findings[:_MAX_FINDINGS]

    def rewrite(self, body: dict[str, Any]) -> bool:
        changed = False
        if self.config.rewrite_schema_keys:
            changed = rewrites.sort_schema_keys(body) or changed
        if self.config.rewrite_sort_tools:
            changed = rewrites.sort_tools(body) or changed
        return changed

    # -- internals -------------------------------------------------------------------

    def _hits_of(self, p: Prompt, k: int) -> tuple[Hit, ...]:
        part = p.parts[k]
        cached = self._hits.get(part.digest)
        if cached is not None:
            self._hits.move_to_end(part.digest)
            return cached
        found = tuple(scan_text(part.text))
        self._hits[part.digest] = found
        if len(self._hits) > self.config.scan_cache_entries:
            self._hits.popitem(last=False)
        return found

    def _template_key(self, body: Mapping[str, Any], p: Prompt) -> int:
        k = 1 if p.tools and len(p.parts) > 1 else 0
        scanned = p.parts[k].role in SCANNED_ROLES and k < scan_end(p)
        # The key is a function of these alone (the part's hits follow from its digest);
        # most requests repeat a template, and masking and folding its head each time was
        # a few percent of the gateway's CPU per request.
        model, tools = str(body.get("model", "")), "\x00".join(sorted(t.name for t in p.tools))
        cache_key = (model, p.endpoint, tools, k, scanned, p.parts[k].role, p.parts[k].digest)
        cached = self._template_keys.get(cache_key)
        if cached is not None:
            self._template_keys.move_to_end(cache_key)
            return cached
        h = xxhash.xxh3_64()
        h.update(model.encode())
        h.update(p.endpoint.encode())
        h.update(tools.encode())
        text = p.parts[k].text[: 2 * _TEMPLATE_CHARS]
        masked: list[str] = []
        pos = 0
        for hit in self._hits_of(p, k) if scanned else ():
            if hit.start >= len(text):
                break
            masked.append(text[pos : hit.start])
            masked.append("\x00" + hit.kind)
            pos = max(pos, hit.end)
        masked.append(text[pos:])
        # clients that re-wrap or trim whitespace still send the same template
        head = _WS.sub(" ", "".join(masked)).strip()[:_TEMPLATE_CHARS]
        h.update(p.parts[k].role.encode() + b"\x00" + head.encode("utf-8", "surrogatepass"))
        key: int = h.intdigest()
        self._template_keys[cache_key] = key
        if len(self._template_keys) > self.config.max_templates:
            self._template_keys.popitem(last=False)
        return key

    def _drift_finding(
        self, p: Prompt, d: Divergence, session: str | None, head_only: bool,
        before: tuple[str, ...],
    ) -> Finding:
        part = p.parts[d.part]
        raw = part.text[d.offset : d.end]
        tokens = p.tokens_after(d.part, d.offset)
        # without a session, an unexplained difference may just be another user's prompt
        confident = d.classified or not head_only
        warn = confident and tokens >= self.config.warn_min_tokens
        return Finding(
            kind=d.kind,
            severity="warning" if warn else "info",
            evidence="drift",
            message_index=part.message_index,
            role=part.role,
            char_offset=d.offset,
            span=self._span(d.kind, raw),
            tokens_at_risk=tokens,
            session=session,
            remedy=_remedy(d.kind, p, d.part, d.offset, lambda: _time_of_day(d.kind, raw),
                           before),
        )

    def _pattern_findings(
        self,
        p: Prompt,
        hits: dict[int, tuple[Hit, ...]],
        same: int,
        seen: frozenset[str],
        drift: list[Finding],
        session: str | None,
        now: float,
        room: int,
    ) -> list[Finding]:
        """At most `room` findings (the rest would be cut from the request's list): a
        prompt with thousands of ids writes no more remedies than are kept."""
        out: list[Finding] = []
        window = self.config.recent_window_s
        for k, found in hits.items():
            if k < same or not found:
                continue
            part = p.parts[k]
            for hit in found:
                strength = hit.strength(now, window)
                if strength < WEAK:
                    continue
                if len(out) >= room:
                    return out
                value = part.text[hit.start : hit.end]
                if value in seen or _covered(drift, part.message_index, part.role, hit):
                    continue
                tokens = p.tokens_after(k, hit.start)
                warn = strength == STRONG and tokens >= self.config.warn_min_tokens
                out.append(
                    Finding(
                        kind=hit.kind,
                        severity="warning" if warn else "info",
                        evidence="pattern",
                        message_index=part.message_index,
                        role=part.role,
                        char_offset=hit.start,
                        span=self._span(hit.kind, value),
                        tokens_at_risk=tokens,
                        session=session,
                        remedy=_remedy(hit.kind, p, k, hit.start, hit.dated),
                    )
                )
        return out

    def _span(self, kind: str, text: str) -> str:
        if self.config.redact:
            return f"<{kind}:{len(text)} chars>"
        return text[:_SPAN_CHARS]


def _remedy(kind: str, p: Prompt, k: int, offset: int,
            time_of_day: bool | Callable[[], bool], before: tuple[str, ...] = ()) -> str:
    """The finding's remedy (gateway.hygiene.remedy); "" when writing it fails: a bug in a
    remedy costs the finding its remedy, never the request its answer."""
    try:
        dated = time_of_day if isinstance(time_of_day, bool) else time_of_day()
        return remedy(kind, where(p, k, offset, dated, before))
    except Exception:
        return ""


def _time_of_day(kind: str, text: str) -> bool:
    """Whether a timestamp drift found names more than a date (the remedy rounds it)."""
    if kind != "timestamp":
        return True
    hit = classify_span(text, 0)
    return hit is None or hit.dated


def _remember(state: OrderedDict[Any, Snapshot], key: Any, snapshot: Snapshot,
              cap: int) -> None:
    state[key] = snapshot
    state.move_to_end(key)
    if len(state) > cap:
        state.popitem(last=False)


def _covered(drift: list[Finding], index: int | None, role: str, hit: Hit) -> bool:
    return any(
        f.message_index == index and f.role == role and hit.start <= f.char_offset < hit.end + 1
        for f in drift
    )
