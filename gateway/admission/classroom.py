"""What each class may fill now (pure state, no I/O): the room limits `high`, `normal`
and `low` see, and the two ways the lower classes yield while a higher class comes:
- `low` leaves `normal` its share of what `low` would fill while `normal` or `high`
  requests come (a `normal` request beside a `low` flood finds a free sequence, as
  `high` does beside both); alone, `low` fills what `normal` would;
- a full KV cache only steers `high` always, and a lower class while no `high` was routed
  or queued lately (room.py, "The KV usage steers, and holds none"); one shed or refused
  takes no block and counts for nothing.
"Lately" is twice the shares' half-life. The times are the gateway's, not a model's."""

from __future__ import annotations

import math

from gateway.admission.config import AdmissionConfig, Priority
from gateway.admission.room import RoomLimits, reserved


class ClassRoom:
    def __init__(self, config: AdmissionConfig, sized_s_per_token: float) -> None:
        cap = float(config.replica_max_in_flight or math.inf)
        full = RoomLimits(cap, config.replica_max_queued_prefill_tokens, config.kv_usage_limit,
                          sized_s_per_token=sized_s_per_token)
        lower = reserved(full, config.lower_class_room, config.lower_class_prefill_room)
        # `high` is not held back for queued prefill: that wait is the same in the engine
        # as here (it goes behind what is queued either way) plus a dispatch, and the
        # lower classes' share keeps that queue to about a step; only sequence slots
        # and the KV cache hold it here (a full cache only steers it: room.py, "The KV
        # usage steers, and holds none").
        high = RoomLimits(cap, math.inf, config.kv_usage_limit)
        self._limits: dict[Priority, RoomLimits] = {"high": high, "normal": lower, "low": lower}
        self._low_yielding = reserved(lower, config.lower_class_room, 1.0)
        self._active_s = 2.0 * config.share_half_life_s
        self._above_low_at = -math.inf  # timer: the last arrival of a class above `low`
        self._high_at = -math.inf  # timer: the last `high` routed or queued

    def arrived(self, cls: Priority, now: float) -> None:
        """A request of `cls` arrived at `now` (timer), whatever becomes of it."""
        if cls != "low":
            self._above_low_at = now

    def admitted(self, cls: Priority, now: float) -> None:
        """A request of `cls` was routed or queued at `now` (timer): not shed nor refused."""
        if cls == "high":
            self._high_at = now

    def limits(self, cls: Priority, now: float) -> RoomLimits:
        """`cls`'s room limits at `now` (timer): `low` yields more while others come."""
        if cls == "low" and now - self._above_low_at <= self._active_s:
            return self._low_yielding
        return self._limits[cls]

    def cache_steers(self, cls: Priority, now: float) -> bool:
        """Whether a full cache only steers `cls` at `now` (timer): always `high`; a lower
        class while no `high` came lately."""
        return cls == "high" or now - self._high_at > self._active_s
