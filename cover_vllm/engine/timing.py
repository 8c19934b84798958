"""StepClock: wall-clock laps of one engine step (schedule / prepare / forward / strategy / update)
and, on CUDA, the forward's span on the device (CUDA events)."""

from __future__ import annotations

import time

import torch


class StepClock:
    """Host laps (`lap`), and with a CUDA `device` the device time of the work queued between
    `start_device` and `stop_device`: two CUDA events on the device's current stream, read by
    `device_s` once the end event has completed. Off CUDA (or `device=None`: nobody observes)
    the device calls do nothing and `device_s` is None."""

    def __init__(self, device: torch.device | None = None):
        self._last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self._cuda = device if device is not None and device.type == "cuda" else None
        self._events: tuple | None = None

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now

    def start_device(self) -> None:
        if self._cuda is None:
            return
        self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._events[0].record(torch.cuda.current_stream(self._cuda))

    def stop_device(self) -> None:
        """Record the end event and wait for the device, so that the host lap that follows
        measures the forward's run time (only while observed on CUDA)."""
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self._cuda))
            self._events[1].synchronize()

    def device_s(self) -> float | None:
        """Seconds between the two events on the device's timeline (waits for the end event):
        the span of the forward's kernels, the gaps where the device waited for the host's
        launches included; None when no events were recorded."""
        if self._events is None:
            return None
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1e3
