"""StepClock: wall-clock laps of one engine step (schedule / prepare / forward / strategy / update),
the forward's span on a CUDA device, and the decoders' work on the logits' device.

Host time, as the benches report it, is the time the device would sit idle waiting for the host:
a step's wall time minus the forward and minus the decoders' tensor work on the logits
(`decide_s`). On a GPU that work is kernels the host only launches; on the CPU the logits'
device is the host itself, so the same work is timed op by op (`LogitsOpTimer`): only the aten
ops that read or write a tensor spanning the vocabulary (its last dimension, or its trailing
dimensions where a row is split into chunks) count as device work,
not the Python around them nor any op on the small per-row tensors ([n, W] masks, counts).
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _touches(tree, vocab: int) -> bool:
    """Whether a tensor of `tree` (an op's args or result: tensors, lists, tuples, dicts) spans
    the vocabulary in its trailing dimensions: [..., vocab], or a view of such rows split into
    chunks ([..., vocab / c, c]: the CPU argmax's chunked maxima, strategies/sampling.py
    `greedy`). The leading dimension never counts, so [n, W] with n·W = vocab does not."""
    if isinstance(tree, torch.Tensor):
        shape, span = tree.shape, 1
        for d in range(tree.dim() - 1, 0 if tree.dim() > 1 else -1, -1):
            span *= shape[d]
            if span >= vocab:
                return span == vocab
        return False
    if isinstance(tree, (list, tuple)):
        return any(_touches(t, vocab) for t in tree)
    if isinstance(tree, dict):
        return any(_touches(t, vocab) for t in tree.values())
    return False


class LogitsOpTimer(TorchDispatchMode):
    """While active, sums the seconds spent inside aten ops on the logits (an argument or a
    result with the vocabulary as last dimension: softmax, argmax, the rows' gathers) into
    `seconds`. Dispatching every op into Python costs the host about 10-20 us an op, so a
    step timed this way is slower than others outside those ops: the benches take the steps'
    phases from a run without it and `decide_s` from an untimed pass with it
    (benchmarks/step_ops.py)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.seconds = vocab, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        end = time.perf_counter()
        if _touches(args, self.vocab) or _touches(kwargs, self.vocab) or \
                _touches(out, self.vocab):
            self.seconds += end - start
        return out


class StepClock:
    """Host laps (`lap`), and with a CUDA `device` the device time of the work queued between
    `start_device` and `stop_device`: two CUDA events on the device's current stream, read by
    `device_s` once the end event has completed. Off CUDA (or `device=None`: nobody observes)
    the device calls do nothing and `device_s` is None. `deciding` times the decoders' work on
    the logits (`decide_s`) when observed: CUDA events on CUDA; on the CPU, `LogitsOpTimer`
    when `vocab` is given (an observer asked for it: `StepObserver.times_logits`)."""

    def __init__(self, device: torch.device | None = None, vocab: int = 0):
        self._last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self._device, self._vocab = device, vocab
        self._cuda = device if device is not None and device.type == "cuda" else None
        self._events: tuple | None = None
        self._decide: tuple | LogitsOpTimer | None = None

    @classmethod
    def observed(cls, device: torch.device, observers, vocab: int) -> "StepClock":
        """The clock of one engine step: device timing only while observed, op timing on the
        logits only when an observer asks for it (its `times_logits`)."""
        wanted = any(getattr(o, "times_logits", False) for o in observers)
        return cls(device if observers else None, vocab if wanted else 0)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now

    def start_device(self) -> None:
        if self._cuda is None:
            return
        self._events = self._record()

    def _record(self) -> tuple:
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
        events[0].record(torch.cuda.current_stream(self._cuda))
        return events

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
        return None if self._events is None else self._span(self._events)

    @staticmethod
    def _span(events: tuple) -> float:
        start, end = events
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    @contextlib.contextmanager
    def deciding(self):
        """The decoders' phase: with an observed device, time its work on the logits (CUDA: the
        span of the phase's kernels, as `device_s`; CPU: `LogitsOpTimer`; meta: nothing)."""
        if self._cuda is not None:
            self._decide = self._record()
            yield
            self._decide[1].record(torch.cuda.current_stream(self._cuda))
        elif self._device is not None and self._device.type == "cpu" and self._vocab:
            with LogitsOpTimer(self._vocab) as timer:
                self._decide = timer
                yield
        else:
            yield

    def decide_s(self) -> float | None:
        """Seconds of the decoders' work on the logits' device in `deciding` (None: not timed)."""
        if isinstance(self._decide, LogitsOpTimer):
            return self._decide.seconds
        return None if self._decide is None else self._span(self._decide)
