"""Logs: one line per record on stderr, through the standard `logging` module, in one
format for the gateway, the simulator and every library logger (uvicorn, aiohttp):
`json` (default: an object per line) or `text` (for a person at a terminal).

Fields passed with `extra=` become keys of the object (or `key=value` pairs in text);
secrets are never passed (replica API keys stay in `ReplicaSettings`, whose repr hides
them). uvicorn's `color_message` (the same message with ANSI colours) is dropped.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

import orjson

LogFormat = Literal["json", "text"]

# attributes every LogRecord has; anything else came from `extra=`
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName",
                                                     "color_message"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_extras(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


def _show(value: object) -> str:
    """A bare word or number as is; anything else (spaces, quotes, lists, a control
    character such as a terminal escape in a client's text) as JSON."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value and value.isprintable() \
            and not any(c.isspace() or c in '"=' for c in value):
        return value
    return orjson.dumps(value, default=str).decode()


class TextFormatter(logging.Formatter):
    """`2026-11-23 22:40:01.123 INFO  gateway.serve: message key=value ...` (UTC)."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.created))
        parts = [f"{when}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: "
                 f"{record.getMessage()}"]
        parts.extend(f"{key}={_show(value)}" for key, value in _extras(record).items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(level: str, fmt: LogFormat = "json") -> None:
    """Route every logger (the gateway's, the simulator's, uvicorn's, aiohttp's) to one
    handler on stderr in `fmt`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "aiohttp"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    # uvicorn's own access lines carry no routing facts; the gateway writes its own.
    logging.getLogger("uvicorn.access").disabled = True
