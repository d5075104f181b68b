"""What the client must not see of an engine's answer, and what the gateway reads from a
streamed one (pure).

`kv_transfer_params` in an answer (a P/D decoder's own, vLLM's `bidirectional_kv_xfer`; a
`both` replica's with a KV connector) names the engine's host, port, engine id and block
ids: another tenant's client must never learn them, and no client needs them (the gateway
routes the legs). They are removed from every relayed answer, after the gateway has read
them: `strip_json` for a whole JSON body, `StreamAnswer` for an SSE stream (vLLM puts them
on the stream's final chunk).

Where each endpoint's answer carries them (vLLM 0.32): chat and completions at the top of
the body or the final chunk; Responses in the response object (the body, or nested in the
stream's `response.completed` event: `response.kv_transfer_params`); Messages at the top
of the body (its stream carries none: vLLM's converter drops them). Every depth is
stripped, so each of these shapes reaches the client without them.

`StreamAnswer(collect=True)` also collects the streamed answer's text, so turn two
without re-prefill (gateway.pd.pullback) works for streamed turns with the same exact
check as for a whole answer: the text of choice 0 (`delta.content` for chat, `text` for
completions). A stream the next turn cannot be rebuilt from gets no text (`reply` None,
nothing kept): more than one choice, tool calls (a whole answer's text is its content
alone too), reasoning (D's KV holds the thinking, which the next turn does not send:
`carries_reasoning`, also read from a whole answer), or more than `max_reply_chars`
characters (the bound on what is held).

Cost: without collection, a chunk that ends on an event boundary and holds no
`"kv_transfer_params"` goes through untouched after one byte search; only events that
hold it are parsed and rewritten. A partial event is held until its blank line arrives
(vLLM writes each event in one piece), at most `max_event_bytes`; past that the event's
bytes go on as they come, through gateway.pd.keydrop's `KeyDropper`, which removes
non-null params from JSON in pieces (a Responses stream's `response.completed` carries the
whole response, logprobs included, and its params after it), up to the event's blank line.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.pd.keydrop import KeyDropper
from gateway.pd.tokenids import MARK, IdsNuller, StreamIds, ids_only, null_doc, null_ids
from gateway.usage.extract import carries_reasoning

KEY = b'"kv_transfer_params"'
MAX_REPLY_CHARS = 1 << 20  # characters of a streamed answer collected for reuse
MAX_EVENT_BYTES = 1 << 20  # a partial event held longer than this is let go


def _strip(doc: Any) -> bool:
    """Remove every non-null `kv_transfer_params` from a parsed answer, at any depth (a
    Responses event nests the response object); whether one was removed. vLLM writes
    `"kv_transfer_params": null` on every answer without a connector: nothing to hide
    there, and leaving it keeps the answer's bytes as the engine sent them."""
    removed = False
    if isinstance(doc, dict):
        if doc.get("kv_transfer_params") is not None:
            del doc["kv_transfer_params"]
            removed = True
        for value in doc.values():
            removed = _strip(value) or removed
    elif isinstance(doc, list):
        for value in doc:
            removed = _strip(value) or removed
    return removed


def strip_json(data: bytes, ids: bool = False) -> bytes:
    """A whole JSON answer without its `kv_transfer_params` (unchanged bytes when it has
    none, or only nulls); `ids`: the token ids the gateway asked for written `null`, as
    the answer would have had them (gateway.pd.tokenids)."""
    if ids:
        data = null_ids(data)
    if KEY not in data:
        return data
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    return orjson.dumps(doc) if _strip(doc) else data


def _boundary(buf: bytes) -> int:
    """End (exclusive) of the last complete event in buf, 0 when there is none."""
    a = buf.rfind(b"\n\n")
    b = buf.rfind(b"\n\r\n")
    return max(a + 2 if a >= 0 else 0, b + 3 if b >= 0 else 0)


def _split(region: bytes) -> list[bytes]:
    """Complete events, each with its blank line."""
    out: list[bytes] = []
    start = i = 0
    n = len(region)
    while i < n:
        j = region.find(b"\n", i)
        if j < 0:
            break
        if region[j + 1:j + 2] == b"\n":
            end = j + 2
        elif region[j + 1:j + 3] == b"\r\n":
            end = j + 3
        else:
            i = j + 1
            continue
        out.append(region[start:end])
        start = i = end
    if start < n:
        out.append(region[start:])
    return out


def _rewritten(event: bytes, doc: dict[str, Any]) -> bytes:
    """The event with its `data:` replaced by `doc`; its other lines (`event:`, `id:`, a
    Responses stream's event names) kept in place."""
    end = event[len(event.rstrip(b"\r\n")):] or b"\n\n"
    lines = event.rstrip(b"\r\n").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(b"data:"))
    kept = [line for line in lines if not line.startswith(b"data:")]
    kept.insert(at, b"data: " + orjson.dumps(doc))
    return b"\n".join(kept) + end


def _doc(event: bytes) -> dict[str, Any] | None:
    """The JSON object an event's `data:` lines carry, None for anything else."""
    parts = [line[5:].removeprefix(b" ") for line in event.splitlines()
             if line.startswith(b"data:")]
    if not parts:
        return None
    try:
        doc = orjson.loads(b"\n".join(parts))
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


class StreamAnswer:
    def __init__(self, *, collect: bool, max_reply_chars: int = MAX_REPLY_CHARS,
                 max_event_bytes: int = MAX_EVENT_BYTES, strip_ids: bool = False,
                 collect_ids: bool = False) -> None:
        self.collect = collect
        # the token ids the gateway asked for (gateway.pd.tokenids): hidden from the client
        self.strip_ids = strip_ids
        # and read, for token mode's check (collect only; bounded like the text)
        self._ids = StreamIds(max_reply_chars) if collect and collect_ids else None
        self.max_reply_chars = max_reply_chars
        self.max_event_bytes = max_event_bytes
        self.params: dict[str, Any] | None = None  # the last event's kv_transfer_params
        self._parts: list[str] = []
        self._chars = 0
        self._whole = collect  # the text collected so far is the whole answer's
        self.reasoned = False  # a collected event carried reasoning
        self._tail = b""
        # an event longer than max_event_bytes, going on in pieces up to its blank line
        self._over: KeyDropper | None = None
        self._over_last = b""  # its last two bytes (a blank line split between chunks)
        self._over_ids: IdsNuller | None = None  # and its id lists, when stripped

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt's ids then choice 0's generated ids (collect_ids), None when they
        cannot be told exactly."""
        return self._ids.ids if self._ids is not None and self._whole else None

    @property
    def reply(self) -> str | None:
        """The answer's text (collect only), None when it cannot be told exactly."""
        return "".join(self._parts) if self._whole else None

    def feed(self, chunk: bytes) -> bytes:
        """Upstream bytes in, the bytes to pass on out (complete events)."""
        if self._over is not None:
            return self._overflow(chunk)
        if not self._tail and not self.collect and KEY not in chunk and (
                chunk.endswith(b"\n\n") or not chunk) and not (
                self.strip_ids and MARK in chunk):
            return chunk  # token chunks: untouched
        buf = self._tail + chunk
        cut = _boundary(buf)
        self._tail = buf[cut:]
        out = self._events(buf[:cut]) if cut else b""
        if len(self._tail) > self.max_event_bytes:
            # no final chunk of chat or completions is this long: stop trusting the text,
            # and let the event go in pieces, its params removed as they pass
            self._whole = False
            tail, self._tail = self._tail, b""
            self._over, self._over_last = KeyDropper(), b""
            self._over_ids = IdsNuller() if self.strip_ids else None
            out += self._overflow(tail)
        return out

    def _overflow(self, chunk: bytes) -> bytes:
        """Bytes of an over-long event through its KeyDropper, up to its blank line; what
        follows it is fed as usual."""
        over = self._over
        assert over is not None
        joined = self._over_last + chunk
        ends = [i + len(sep) for sep in (b"\n\n", b"\n\r\n")
                if (i := joined.find(sep)) >= 0]
        ids = self._over_ids
        if not ends:
            self._over_last = joined[-2:]
            out = over.feed(chunk)
            return out if ids is None else ids.feed(out)
        end = min(ends) - len(self._over_last)
        out = over.feed(chunk[:end]) + over.finish()
        if ids is not None:
            out = ids.feed(out) + ids.finish()
        self._over, self._over_last, self._over_ids = None, b"", None
        return out + self.feed(chunk[end:])

    def finish(self) -> bytes:
        """End of stream: what is still held (a last event without its blank line)."""
        if self._over is not None:
            out, self._over = self._over.finish(), None
            ids, self._over_ids = self._over_ids, None
            return out if ids is None else ids.feed(out) + ids.finish()
        tail, self._tail = self._tail, b""
        if not tail:
            return b""
        return self._events(tail)

    def _events(self, region: bytes) -> bytes:
        changed = False
        out: list[bytes] = []
        for event in _split(region):
            has_key = KEY in event
            has_ids = self.strip_ids and MARK in event
            doc = _doc(event) if has_key or has_ids or self.collect else None
            if doc is not None and self.collect:
                self._read(doc)
            if has_ids:
                changed = True
                if doc is not None and ids_only(doc):
                    continue  # a chunk the client would not have had
                event = null_ids(event)  # vLLM's bytes, each id list written null
                if doc is not None:
                    null_doc(doc)  # if the params' removal re-serializes the event
            if has_key and doc is not None:
                params = doc.get("kv_transfer_params")
                nested = doc.get("response")  # a Responses stream's response.completed
                if params is None and isinstance(nested, dict):
                    params = nested.get("kv_transfer_params")
                if isinstance(params, dict) and params:
                    self.params = params
                if _strip(doc):
                    event, changed = _rewritten(event, doc), True
            elif has_key:  # not JSON we can rewrite: dropped rather than passed on
                event, changed = b"", True
            out.append(event)
        return b"".join(out) if changed else region

    def _read(self, doc: dict[str, Any]) -> None:
        """Add the text an event carries for choice 0 (chat delta or completion text)."""
        if not self._whole:
            return
        if self._ids is not None:
            self._ids.read(doc)
        choices = doc.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self._whole = False
                return
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if carries_reasoning(delta):
                    self.reasoned = True  # D's KV holds thinking the text has not
                if delta.get("tool_calls") or self.reasoned:
                    self._whole = False
                    return
                text = delta.get("content")
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                self._chars += len(text)
                if self._chars > self.max_reply_chars:
                    self._whole, self._parts = False, []
                    return
                self._parts.append(text)
