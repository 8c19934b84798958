"""StepClock: wall-clock laps of one engine step (schedule / prepare / forward / strategy / update)."""

from __future__ import annotations

import time


class StepClock:
    def __init__(self):
        self._last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now
