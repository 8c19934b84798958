"""How a data-parallel server heals: which replica takes a request, when the server is healthy,
how a dead replica is restarted (backoff, a cap), and how replicas on one host split its memory.

Pure rules over small replica states, so they are tested without Ray; DPRouter (dp_router.py)
applies them.

* Routing: a request goes to the live replica with the fewest requests in flight (ties: the
  lowest index); dead and restarting replicas get none.
* Health: the server is healthy (GET /health 200) while at least one replica serves; it is
  unhealthy (503) only when none does, and dead for good (the server exits) when none serves and
  none is being restarted.
* Restarts: a dead replica is rebuilt in the background; attempt k (0-based, counted over the
  server's life) waits `min(base_delay_s * 2**k, max_delay_s)` first, and after `max_restarts`
  attempts the replica stays dead.
* Memory: replicas that share a host share its budget. Each gets memory_utilization / R, where R
  is the number of replicas per host (all N on a one-node Ray cluster, the local case; on a
  cluster of several nodes the replicas are spread and R = ceil(N / nodes)). An explicit
  kv_cache_memory_bytes is the user's own per-replica figure and is left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence, TypeVar

from cover_vllm.config import EngineConfig


class ReplicaState(Protocol):
    index: int
    alive: bool             # serves requests
    restarting: bool        # dead, and a restart is pending or loading
    in_flight: int          # requests routed to it and not finished


R = TypeVar("R", bound=ReplicaState)


def pick_replica(replicas: Sequence[R]) -> R | None:
    """The live replica with the fewest requests in flight (ties: lowest index), or None."""
    live = [r for r in replicas if r.alive]
    return min(live, key=lambda r: (r.in_flight, r.index)) if live else None


def health_problem(replicas: Sequence[ReplicaState]) -> str | None:
    """None while at least one replica serves (a degraded server still serves), else why not."""
    if any(r.alive for r in replicas):
        return None
    restarting = [str(r.index) for r in replicas if r.restarting]
    if restarting:
        return (f"no data-parallel replica can serve now (replica {', '.join(restarting)} "
                f"restarting)")
    return "no data-parallel engine replica is alive"


def fatal_problem(replicas: Sequence[ReplicaState]) -> str | None:
    """Why the replicas can never serve again (every one dead, none being restarted), else None."""
    if any(r.alive or r.restarting for r in replicas):
        return None
    return "every data-parallel replica is dead and none is being restarted"


@dataclass(frozen=True)
class RestartPolicy:
    """Background restarts of a dead replica: exponential backoff, at most `max_restarts`
    attempts per replica over the server's life (then it stays dead)."""

    max_restarts: int = 5
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.base_delay_s <= self.max_delay_s:
            raise ValueError(f"need 0 <= base_delay_s <= max_delay_s, got {self.base_delay_s} "
                             f"and {self.max_delay_s}")

    def delay_s(self, attempt: int) -> float | None:
        """Seconds to wait before restart attempt `attempt` (0-based), or None past the cap."""
        if attempt >= self.max_restarts:
            return None
        return min(self.base_delay_s * 2 ** min(attempt, 62), self.max_delay_s)


def replicas_per_host(num_replicas: int, num_nodes: int) -> int:
    """How many of `num_replicas` share one host when spread over `num_nodes` nodes."""
    return math.ceil(num_replicas / max(1, num_nodes))


def replica_config(config: EngineConfig, per_host: int) -> EngineConfig:
    """`config` for one of `per_host` replicas sharing a host: memory_utilization / per_host,
    unless the user fixed the KV pool (kv_cache_memory_bytes) or there is nothing to split."""
    if per_host <= 1 or config.kv_cache_memory_bytes is not None:
        return config
    return config.with_overrides(memory_utilization=config.memory_fraction / per_host,
                                 gpu_memory_utilization=None)
