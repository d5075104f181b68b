"""Read a usage log (JSON lines of `UsageRecord`s, as the file sink writes them) back into
records, with an error that names the offending line.

Validation is strict on the fields every figure depends on (`ts`, `latency_ms`, `status`,
the token counts) and lenient on the rest: unknown keys are ignored so a log written by a
newer gateway still reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import Any

import orjson

from gateway.hygiene.finding import findings_from_json
from gateway.usage.record import UsageRecord

_INT_OR_NONE = (
    "prompt_tokens",
    "cached_tokens",
    "predicted_cached_tokens",
    "best_available_tokens",
    "completion_tokens",
    "transferred_tokens",
    "prefill_cached_tokens",
    "pulled_tokens",
)
_STR_OR_NONE = ("tenant", "replica", "route", "session", "error", "engine_request_id",
                "prefill_replica", "cached_from")
_FIELDS = tuple(f.name for f in fields(UsageRecord))


class LogError(ValueError):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line
        self.reason = reason


def _number(obj: dict[str, Any], key: str, line: int, optional: bool) -> None:
    v = obj.get(key)
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise LogError(line, f"field {key!r} must be a number, got {v!r}")


def record_from_json(obj: Any, line: int) -> UsageRecord:
    if not isinstance(obj, dict):
        raise LogError(line, "not a JSON object")
    _number(obj, "ts", line, optional=False)
    _number(obj, "latency_ms", line, optional=False)
    _number(obj, "ttft_ms", line, optional=True)
    status = obj.get("status")
    if isinstance(status, bool) or not isinstance(status, int):
        raise LogError(line, f"field 'status' must be an integer, got {status!r}")
    for key in _INT_OR_NONE:
        v = obj.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise LogError(line, f"field {key!r} must be a non-negative integer or null")
    for key in _STR_OR_NONE:
        v = obj.get(key)
        if v is not None and not isinstance(v, str):
            raise LogError(line, f"field {key!r} must be a string or null")
    model = obj.get("model")
    if not isinstance(model, str):
        raise LogError(line, "field 'model' must be a string")
    exact = obj.get("pulled_exact")
    if exact is not None and not isinstance(exact, bool):
        raise LogError(line, "field 'pulled_exact' must be a boolean or null")
    hygiene = obj.get("hygiene", 0)
    if isinstance(hygiene, bool) or not isinstance(hygiene, int):
        raise LogError(line, "field 'hygiene' must be an integer")
    kwargs = {k: obj[k] for k in _FIELDS if k in obj}
    try:
        kwargs["findings"] = findings_from_json(obj.get("findings"))
    except ValueError as e:
        raise LogError(line, str(e)) from None
    kwargs.setdefault("request_id", "")
    kwargs["request_id"] = str(kwargs["request_id"])
    kwargs["stream"] = bool(obj.get("stream", False))
    for key in ("tenant", "replica", "route", "prompt_tokens", "cached_tokens",
                "predicted_cached_tokens", "best_available_tokens", "completion_tokens",
                "ttft_ms", "session"):  # fmt: skip
        kwargs.setdefault(key, None)
    return UsageRecord(**kwargs)


def read_records(lines: Iterable[bytes],
                 on_error: Callable[[LogError], None] | None = None) -> Iterator[UsageRecord]:
    """Records of a JSON-lines log; blank lines are skipped. A bad line raises LogError,
    or, with `on_error`, is handed to it and skipped (a log cut mid-line by a crash or a
    rotation must not cost the whole report)."""
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise LogError(n, f"not valid JSON ({e})") from None
            rec = record_from_json(obj, n)
        except LogError as err:
            if on_error is None:
                raise
            on_error(err)
            continue
        yield rec
