"""A plain text progress bar on stderr (no tqdm): redrawn in place with '\\r', at most
`steps` times over the whole run so a slow terminal is not flooded; when stderr is not a
terminal (a log file, CI) only a few plain lines are written instead."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(
        self, total: int, label: str = "", stream: TextIO | None = None, steps: int = 50,
        enabled: bool = True,
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self.errors = 0
        self._tty = self.stream.isatty()
        self._every = max(1, self.total // (steps if self._tty else 4))

    def advance(self, n: int = 1, error: bool = False) -> None:
        self.done += n
        self.errors += int(error)
        if self.enabled and (self.done % self._every == 0 or self.done >= self.total):
            self._draw()

    def _draw(self) -> None:
        width = 30
        filled = min(width, width * self.done // self.total)
        bar = "#" * filled + "." * (width - filled)
        errors = f" errors={self.errors}" if self.errors else ""
        start, end = ("\r", "") if self._tty else ("", "\n")
        self.stream.write(f"{start}{self.label} [{bar}] {self.done}/{self.total}{errors}{end}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            if self._tty:
                self._draw()
                self.stream.write("\n")
            self.stream.flush()
