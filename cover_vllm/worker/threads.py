"""Torch intra-op threads for one worker: the user's number, else one that does not oversubscribe.

On a small shared CPU machine torch's default (every core) is the slowest choice twice over: a
tiny model's step is op dispatch, not arithmetic, so extra threads only add synchronisation, and
two processes that each take every core run several times slower than with one thread each
(measured: the same cover-tiny eval 4.2 s with one thread, 69.3 s with two beside another job).
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

TINY_HIDDEN_SIZE = 256      # below this width a step is dispatch-bound: one thread is fastest


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _busy_jiffies() -> tuple[int, int, int] | None:
    """(busy, total) CPU jiffies of the whole machine from /proc/stat, and this process's own
    (utime + stime, every thread) from /proc/self/stat; None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    total = sum(fields[:8])                                             # guest time is in user
    return total - idle, total, int(own[11]) + int(own[12])


def busy_cores_elsewhere(window_s: float = 0.25) -> float:
    """Cores kept busy by other processes, sampled over `window_s` now (/proc/stat minus this
    process's own time). The 1-minute load average is the fallback: it lags a finished job by
    minutes (a bench started right after an install saw load 0.9 on an idle machine and took
    one thread of two) and counts this process's own work."""
    before = _busy_jiffies()
    if before is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    time.sleep(window_s)
    after = _busy_jiffies()
    busy, total, own = (a - b for a, b in zip(after, before))
    if total <= 0:
        return 0.0
    cores = os.cpu_count() or 1
    return max(0.0, (busy - own) / total * cores)


def default_num_threads(hidden_size: int, num_ranks: int = 1) -> int:
    """1 for a tiny model; else the usable cores not busy with other processes right now,
    shared among `num_ranks` tensor-parallel processes."""
    if hidden_size < TINY_HIDDEN_SIZE:
        return 1
    cores = usable_cores()
    free = max(1, round(cores - busy_cores_elsewhere()))
    return max(1, min(cores, free) // max(1, num_ranks))


def apply_num_threads(requested: int | None, hidden_size: int, num_ranks: int = 1) -> int:
    """Set torch's intra-op threads (the user's `requested`, else the default above); returns
    the number set."""
    threads = requested if requested is not None else default_num_threads(hidden_size, num_ranks)
    torch.set_num_threads(threads)
    logger.info("torch intra-op threads: %d%s", threads,
                "" if requested is not None else " (default for this model and machine load)")
    return threads
