"""Removing `"kv_transfer_params": {...}` from JSON that arrives in pieces, without holding
it whole (pure).

An SSE event longer than gateway.pd.answer's `max_event_bytes` (a Responses stream's
`response.completed` carries the whole response, logprobs included, then the params) is
not held until it ends: its bytes go on as they come, through a `KeyDropper`, which holds
at most the key, its colon and one comma at a time. A non-null value is dropped with its
key and one adjacent comma, so the JSON stays valid; `null` is left as the engine wrote it
(nothing to hide, and the bytes stay the engine's).

Why a byte search finds only keys: inside a JSON string every `"` is escaped, so the bytes
`"kv_transfer_params"` followed by `:` occur only as a key, unless the first quote is an
escaped one (an odd run of backslashes before it), which is checked. The value is skipped
by its structure (strings with their escapes, nested brackets), never by a search.
"""

from __future__ import annotations

from typing import Literal

KEY = b'"kv_transfer_params"'
_WS = b" \t\r\n"
_HELD_BEFORE = _WS + b",\\"
MAX_HELD = 4096  # bytes of commas, spaces and backslashes held before a possible key
_CLOSE = {ord("{"): ord("}"), ord("["): ord("]")}

State = Literal["pass", "colon", "value", "skip", "comma"]


def _escaped(data: bytes, at: int) -> bool:
    """Whether the byte at `at` is preceded by an odd run of backslashes."""
    n = 0
    while at - n - 1 >= 0 and data[at - n - 1] == 0x5C:
        n += 1
    return n % 2 == 1


def _first_not_ws(data: bytes) -> int:
    """Index of the first byte of `data` that is not JSON whitespace (len when none)."""
    i = 0
    while i < len(data) and data[i] in _WS:
        i += 1
    return i


class KeyDropper:
    def __init__(self) -> None:
        self._state: State = "pass"
        self._pending = b""  # pass: bytes not yet emitted (a key may begin in them)
        self._held = b""  # colon/value: the comma, key and colon, until the value shows
        self._comma_before = False  # the key had a comma before it (dropped with it)
        self._depth = 0  # skip: brackets open in the dropped value
        self._in_string = False
        self._escape = False
        self._scalar = False  # skip: a number/true/false, which ends at , } ] or space

    def feed(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        data = chunk
        while data:
            data = self._step(data, out)
        return b"".join(out)

    def finish(self) -> bytes:
        """The bytes still held (a key whose value never came is not passed on)."""
        pending, self._pending = self._pending, b""
        return pending if self._state == "pass" else b""

    def _step(self, data: bytes, out: list[bytes]) -> bytes:
        """Consume some of `data` in the current state; the rest to go on with."""
        if self._state == "pass":
            buf = self._pending + data
            self._pending = b""
            at = buf.find(KEY)
            while at >= 0 and _escaped(buf, at):
                at = buf.find(KEY, at + 1)
            if at < 0:
                # a key may begin in the last bytes; the comma, spaces and backslashes
                # before them stay too (the comma goes with the key; an odd run of
                # backslashes makes its quote an escaped one), at most MAX_HELD in all
                cut = max(0, len(buf) - len(KEY))
                floor = max(0, cut - MAX_HELD)
                while cut > floor and buf[cut - 1] in _HELD_BEFORE:
                    cut -= 1
                out.append(buf[:cut])
                self._pending = buf[cut:]
                return b""
            start = at
            while start > 0 and buf[start - 1] in _WS:
                start -= 1
            self._comma_before = start > 0 and buf[start - 1] == ord(",")
            start = start - 1 if self._comma_before else at
            out.append(buf[:start])
            self._held = buf[start:at + len(KEY)]
            self._state = "colon"
            return buf[at + len(KEY):]
        if self._state == "colon":
            i = _first_not_ws(data)
            if i == len(data):
                self._held += data
                return b""
            if data[i] != ord(":"):  # not a key after all: go on as it was
                out.append(self._held)
                self._held, self._state = b"", "pass"
                return data
            self._held += data[:i + 1]
            self._state = "value"
            return data[i + 1:]
        if self._state == "value":
            i = _first_not_ws(data)
            if i == len(data):
                self._held += data
                return b""
            if data[i] == ord("n"):  # null: leave it as written
                out.append(self._held)
                self._held, self._state = b"", "pass"
                return data
            self._held = b""
            self._state = "skip"
            self._depth, self._in_string, self._escape = 0, False, False
            self._scalar = data[i] not in (ord("{"), ord("["), ord('"'))
            return data[i:]
        if self._state == "skip":
            return self._skip(data)
        # "comma": after a value that was first in its object, drop the comma after it
        i = _first_not_ws(data)
        if i == len(data):
            return b""
        self._state = "pass"
        return data[i + 1:] if data[i] == ord(",") else data[i:]

    def _skip(self, data: bytes) -> bytes:
        """Drop the value's bytes; the rest after it."""
        for i, c in enumerate(data):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == 0x5C:
                    self._escape = True
                elif c == ord('"'):
                    self._in_string = False
                    if self._depth == 0:
                        return self._done(data[i + 1:])
                continue
            if self._scalar:
                if c in b",}]" or c in _WS:
                    return self._done(data[i:])
                continue
            if c == ord('"'):
                self._in_string = True
            elif c in _CLOSE:
                self._depth += 1
            elif c in _CLOSE.values():
                self._depth -= 1
                if self._depth == 0:
                    return self._done(data[i + 1:])
        return b""

    def _done(self, rest: bytes) -> bytes:
        self._state = "pass" if self._comma_before else "comma"
        return rest
