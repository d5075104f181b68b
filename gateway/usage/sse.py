"""An incremental tap on a relayed Server-Sent-Events stream (pure).

`SseUsageTap.feed(chunk)` takes raw upstream bytes, split anywhere, and returns the bytes to
forward to the client; `finish()` returns whatever is still held at the end of the stream.
Afterwards `usage` holds the engine's usage from the last event that carried one (the final
`"choices": []` chunk; with `continuous_usage_stats` every chunk carries a running one and the
last wins).

The Responses API's events carry the response object (`response.created` ...
`response.completed`): its `usage` and its `id` (`response_id`) are read from it; the
Messages API's `message_start` carries `message.usage` and `message_delta` a top-level
`usage`: the two are merged, the later fields winning (vLLM's delta has them all,
Anthropic's only `output_tokens`). Every such event contains `"usage"` (null until the
end for Responses), so the same byte search finds them.

Two modes:
- pass-through (`strip=False`): every chunk is forwarded at once, unchanged. The tap only
  keeps the bytes of the event still in progress, to read usage when it completes.
- strip (`strip=True`, the gateway injected `stream_options.include_usage`): complete events
  are forwarded as soon as their terminating blank line arrives, except the usage-only chunk
  (`"choices": []` with a `usage` object), which the client never asked for. A partial event
  is held until its end arrives (vLLM writes each event in one piece, so nothing waits).

Cost: per chunk a reverse search for the last event boundary and a forward search for
`"usage"` (C byte searches; the held tail is concatenated only when an event was split
across reads). Token chunks are never sliced, split or parsed; when `"usage"` appears, only
the event holding it and the ones after it are split into events and JSON-parsed (in a
coalesced read, the 60 token events before it are forwarded as one untouched slice).
Events end with a blank line, `\\n\\n` or `\\r\\n\\r\\n`; comment lines
(`: ...`) and `data: [DONE]` pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson

from gateway.usage.extract import Usage, usage_from_mapping

_USAGE = b'"usage"'


def _last_boundary(buf: bytes) -> int:
    """End index (exclusive) of the last complete event in buf, 0 if there is none."""
    if buf.endswith(b"\n\n"):  # the usual read: whole events
        return len(buf)
    a = buf.rfind(b"\n\n")
    b = buf.rfind(b"\n\r\n")
    return max(a + 2 if a >= 0 else 0, b + 3 if b >= 0 else 0)


def _event_start(buf: bytes, at: int) -> int:
    """Start index of the event that contains index `at` (just after the blank line
    before it, 0 if none)."""
    a = buf.rfind(b"\n\n", 0, at)
    b = buf.rfind(b"\n\r\n", 0, at)
    return max(a + 2 if a >= 0 else 0, b + 3 if b >= 0 else 0)


def _events(region: bytes) -> Iterator[bytes]:
    """Split a region of complete events into events, each with its terminator."""
    start = 0
    n = len(region)
    i = 0
    while i < n:
        j = region.find(b"\n", i)
        if j < 0:
            break
        # a blank line: "\n\n" or "\n\r\n"
        if j + 1 < n and region[j + 1] == 0x0A:
            end = j + 2
        elif j + 2 < n and region[j + 1] == 0x0D and region[j + 2] == 0x0A:
            end = j + 3
        else:
            i = j + 1
            continue
        yield region[start:end]
        start = i = end
    if start < n:
        yield region[start:]


def _data(event: bytes) -> bytes | None:
    """The joined `data:` payload of one event, None when it has none."""
    parts = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


MAX_EVENT_BYTES = 1024 * 1024  # a partial event held longer than this is let go (see feed)


# the Responses API stream's events that come only once the prompt is prefilled: the
# first delta of whatever the answer holds (`response.created` and `.in_progress` come
# with the headers, before it); `gateway serve`'s relay and the picker time a Responses
# stream's first token at the first chunk holding one
RESPONSES_FIRST_TOKEN: tuple[bytes, ...] = (
    b'"response.output_text.delta"', b'"response.function_call_arguments.delta"',
    b'"response.reasoning_text.delta"', b'"response.reasoning_summary_text.delta"',
    b'"response.refusal.delta"')


def first_token_in(chunk: bytes, markers: tuple[bytes, ...] | None) -> bool:
    """Whether a stream's `chunk` holds its first token: any bytes, or with `markers` one
    of them."""
    return bool(chunk) and (markers is None or any(m in chunk for m in markers))


class SseUsageTap:
    def __init__(self, *, strip: bool, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.strip = strip
        self.max_event_bytes = max_event_bytes
        self.usage: Usage | None = None
        self.stripped = 0  # usage-only events removed (for tests and logs)
        self.response_id: str | None = None  # Responses API streams
        self._merged: dict[str, object] = {}  # Messages API: message_start + message_delta
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        out = self._feed(chunk)
        if len(self._tail) > self.max_event_bytes:
            # An event this long is no usage chunk (a replica writing one endless event):
            # stop holding it, so the tap's memory stays bounded whatever comes.
            held, self._tail = self._tail, b""
            if self.strip:
                return out + held
        return out

    def _feed(self, chunk: bytes) -> bytes:
        buf = self._tail + chunk if self._tail else chunk
        cut = _last_boundary(buf)
        self._tail = buf[cut:] if cut < len(buf) else b""
        at = buf.find(_USAGE, 0, cut) if cut else -1
        if at < 0:  # token chunks: no slicing, no parsing
            if not self.strip:
                return chunk
            return buf if cut == len(buf) else buf[:cut]
        # Events before the one that holds the first `"usage"` are forwarded untouched;
        # only that one and those after it are split and parsed.
        start = _event_start(buf, at)
        kept = self._scan(buf[start:cut])
        if not self.strip:
            return chunk
        if start == 0:
            return kept
        return buf[:start] + kept if kept else buf[:start]

    @property
    def pending(self) -> bool:
        """An event has started but its terminating blank line has not arrived."""
        return bool(self._tail)

    def finish(self) -> bytes:
        """End of stream: release the held partial event (a stream cut mid-event)."""
        tail, self._tail = self._tail, b""
        if tail and _USAGE in tail:
            kept = self._scan(tail)
            return kept if self.strip else b""
        return tail if self.strip else b""

    def _scan(self, region: bytes) -> bytes:
        """Read usage from the events in region; return region minus usage-only events."""
        kept: list[bytes] = []
        removed = False
        for event in _events(region):
            if _USAGE not in event:
                kept.append(event)
                continue
            data = _data(event)
            doc = None
            if data is not None and data != b"[DONE]":
                try:
                    doc = orjson.loads(data)
                except orjson.JSONDecodeError:
                    doc = None
            if isinstance(doc, dict) and "choices" not in doc:
                self._api_event(doc)
            elif isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                self.usage = usage_from_mapping(doc["usage"])
                if self.strip and doc.get("choices") == []:
                    removed = True
                    self.stripped += 1
                    continue
            kept.append(event)
        return b"".join(kept) if removed else region

    def _api_event(self, doc: dict[str, object]) -> None:
        """An event of the Responses or Messages stream (never stripped)."""
        inner = doc.get("response")
        if isinstance(inner, dict):  # Responses: response.created ... response.completed
            rid = inner.get("id")
            if isinstance(rid, str) and self.response_id is None:
                self.response_id = rid
            if isinstance(inner.get("usage"), dict):
                self.usage = usage_from_mapping(inner["usage"])
            return
        message = doc.get("message")
        usage = message.get("usage") if isinstance(message, dict) else doc.get("usage")
        if isinstance(usage, dict):
            self._merged.update(usage)
            self.usage = usage_from_mapping(self._merged)
