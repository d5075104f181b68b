"""Virtual (simulated) time of one replica, driven by wall time and engine steps.

While the engine is busy, simulated time advances by exactly the modelled step durations;
a moment inside a step maps to step start + elapsed wall x speed, capped at the step's end.
While idle, simulated time advances with wall time x speed until work arrives (``wake``),
which pins the clock until the step that serves it begins. Pure: wall time is a parameter.
"""

from __future__ import annotations


class VirtualClock:
    def __init__(self, speed: float, wall: float) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.speed = speed
        self._sim = 0.0
        self._wall = wall
        self._step_end: float | None = None

    def now(self, wall: float) -> float:
        elapsed = max(0.0, wall - self._wall) * self.speed
        if self._step_end is not None:
            return min(self._sim + elapsed, self._step_end)
        return self._sim + elapsed

    def wake(self, wall: float) -> float:
        """Work arrived: pin the clock here until the next step begins, so the wall-clock
        latency of waking the step loop is not counted (x speed) as queueing."""
        if self._step_end is None:
            self._sim = self.now(wall)
            self._wall = wall
            self._step_end = self._sim
        return self.now(wall)

    def begin_step(self, wall: float, duration: float) -> float:
        """Start a step now; returns its simulated start."""
        if self._step_end is None:
            self._sim = self.now(wall)
        self._wall = wall
        self._step_end = self._sim + duration
        return self._sim

    def end_step(self, wall: float) -> float:
        """The step's work is done; returns its simulated end."""
        assert self._step_end is not None
        self._sim = self._step_end
        self._wall = wall
        return self._sim

    def idle(self, wall: float) -> None:
        """The engine has no work: from here on time flows with the wall clock."""
        self._step_end = None
        self._wall = wall
