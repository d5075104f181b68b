"""The "Prefix cache hit rate" of vLLM's periodic log line (``CachingMetrics``).

Each engine step that admitted requests contributes one record (requests, queried tokens,
hit tokens). Records sit in a deque; while the window holds more than ``max_requests``
requests and more than one record, the oldest record is dropped whole, so the newest record
is always kept. The rate is token-weighted: hits / queries over the window. Only a prefix
cache reset clears it.
"""

from __future__ import annotations

from collections import deque


class HitRateWindow:
    def __init__(self, max_requests: int = 1000) -> None:
        self.max_requests = max_requests
        self._records: deque[tuple[int, int, int]] = deque()
        self.requests = 0
        self.queries = 0
        self.hits = 0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        if requests == 0:
            return
        self._records.append((requests, queries, hits))
        self.requests += requests
        self.queries += queries
        self.hits += hits
        while self.requests > self.max_requests and len(self._records) > 1:
            r, q, h = self._records.popleft()
            self.requests -= r
            self.queries -= q
            self.hits -= h

    def rate(self) -> float:
        """Hit rate in [0, 1]; 0 when nothing was queried (vLLM prints 0.0%)."""
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self._records.clear()
        self.requests = self.queries = self.hits = 0
