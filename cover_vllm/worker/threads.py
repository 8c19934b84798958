"""Torch intra-op threads for one worker: the user's number, else one that does not oversubscribe.

On a small shared CPU machine torch's default (every core) is the slowest choice twice over: a
tiny model's step is op dispatch, not arithmetic, so extra threads only add synchronisation, and
two processes that each take every core run several times slower than with one thread each
(measured: the same cover-tiny eval 4.2 s with one thread, 69.3 s with two beside another job).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

TINY_HIDDEN_SIZE = 256      # below this width a step is dispatch-bound: one thread is fastest


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_num_threads(hidden_size: int, num_ranks: int = 1) -> int:
    """1 for a tiny model; else the usable cores not already busy (the 1-minute load average
    counts the runnable processes), shared among `num_ranks` tensor-parallel processes."""
    if hidden_size < TINY_HIDDEN_SIZE:
        return 1
    cores = usable_cores()
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = max(1, round(cores - busy))
    return max(1, min(cores, free) // max(1, num_ranks))


def apply_num_threads(requested: int | None, hidden_size: int, num_ranks: int = 1) -> int:
    """Set torch's intra-op threads (the user's `requested`, else the default above); returns
    the number set."""
    threads = requested if requested is not None else default_num_threads(hidden_size, num_ranks)
    torch.set_num_threads(threads)
    logger.info("torch intra-op threads: %d%s", threads,
                "" if requested is not None else " (default for this model and machine load)")
    return threads
