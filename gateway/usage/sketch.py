"""A mergeable quantile sketch with bounded relative error (the DDSketch idea).

A positive value x falls in bucket i = ceil(log_gamma(x)) with gamma = (1 + a) / (1 - a);
every value in bucket i lies in (gamma^(i-1), gamma^i], and the estimate
2 gamma^i / (gamma + 1) is within a relative error `a` of each of them. Zero and negative
values are counted apart (estimate 0). Merging two sketches adds their counts, so the
stats windows keep one sketch per time bucket and merge those a window covers.

Knob: `a` (relative accuracy, default 1%). Memory is one dict entry per distinct bucket:
values 1..131072 need at most log(131072)/log(gamma) ~ 590 entries at a = 1%.
"""

from __future__ import annotations

import math
from typing import Final

DEFAULT_ACCURACY: Final = 0.01


class QuantileSketch:
    __slots__ = ("_counts", "_gamma", "_inv_log_gamma", "count", "zeros")

    def __init__(self, accuracy: float = DEFAULT_ACCURACY) -> None:
        if not 0 < accuracy < 1:
            raise ValueError("accuracy must be in (0, 1)")
        self._gamma = (1 + accuracy) / (1 - accuracy)
        self._inv_log_gamma = 1.0 / math.log(self._gamma)
        self._counts: dict[int, int] = {}
        self.zeros = 0
        self.count = 0

    def add(self, value: float) -> None:
        self.count += 1
        if value <= 0:
            self.zeros += 1
            return
        i = math.ceil(math.log(value) * self._inv_log_gamma)
        counts = self._counts
        counts[i] = counts.get(i, 0) + 1

    def merge(self, other: QuantileSketch) -> None:
        if other._gamma != self._gamma:
            raise ValueError("cannot merge sketches of different accuracy")
        self.count += other.count
        self.zeros += other.zeros
        counts = self._counts
        for i, n in other._counts.items():
            counts[i] = counts.get(i, 0) + n

    def quantile(self, q: float) -> float | None:
        """Estimate of the q-quantile (0 <= q <= 1), None when empty.

        Rank rule: the value at rank ceil(q * count) (1-based), i.e. the smallest value
        with at least a fraction q of the values at or below it.
        """
        if self.count == 0:
            return None
        rank = max(1, math.ceil(q * self.count))
        if rank <= self.zeros:
            return 0.0
        seen = self.zeros
        for i in sorted(self._counts):
            seen += self._counts[i]
            if seen >= rank:
                return 2.0 * self._gamma**i / (self._gamma + 1.0)
        return 2.0 * self._gamma ** max(self._counts) / (self._gamma + 1.0)
