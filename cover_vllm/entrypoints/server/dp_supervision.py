"""How a data-parallel server heals: which replica takes a request, when the server is healthy,
how a dead replica is restarted (backoff, a cap), which node each replica runs on, and how
replicas on one host split its memory.

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
* Nodes: at start, replicas go to distinct alive nodes when there are at least as many as
  replicas (strict spread); otherwise round robin over the nodes (a fallback the router logs).
  A restart goes to the alive node with the fewest replicas among those where no replica was
  lost in the last `quarantine_s` (a node the router saw die may still be "alive" to Ray for
  seconds); only when every alive node is such a node does it go to the least loaded of them.
* Memory: replicas that share a host share its budget (CPU: host memory; on GPUs each replica's
  bundles hold devices of its own, so nothing is split). R replicas placed on one host together
  get memory_utilization / R each; a replica joining a host where others already planned theirs
  gets what they left, and never less than an equal share (the host is then over-committed, which
  the launcher logs). An explicit kv_cache_memory_bytes is the user's own per-replica figure and is
  left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Hashable, Mapping, Protocol, Sequence, TypeVar

from cover_vllm.config import EngineConfig


class ReplicaState(Protocol):
    index: int
    alive: bool             # serves requests
    restarting: bool        # dead, and a restart is pending or loading
    in_flight: int          # requests routed to it and not finished


R = TypeVar("R", bound=ReplicaState)
N = TypeVar("N", bound=Hashable)       # a node (executor/placement.py NodeInfo)


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
    quarantine_s: float = 60.0      # a node where a replica was lost gets no restart this long

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.base_delay_s <= self.max_delay_s:
            raise ValueError(f"need 0 <= base_delay_s <= max_delay_s, got {self.base_delay_s} "
                             f"and {self.max_delay_s}")
        if self.quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {self.quarantine_s}")

    def quarantined(self, lost: Mapping[N, float], now: float) -> set[N]:
        """The nodes where a replica was lost (node -> when) within `quarantine_s` of `now`."""
        return {node for node, when in lost.items() if now - when < self.quarantine_s}

    def delay_s(self, attempt: int) -> float | None:
        """Seconds to wait before restart attempt `attempt` (0-based), or None past the cap."""
        if attempt >= self.max_restarts:
            return None
        return min(self.base_delay_s * 2 ** min(attempt, 62), self.max_delay_s)


def spread_nodes(num_replicas: int, nodes: Sequence[N]) -> tuple[list[N], bool]:
    """Each replica's node at start: distinct nodes, in order, when there are at least as many
    as replicas (True); else round robin over `nodes` (False: the caller logs the fallback)."""
    if not nodes:
        raise ValueError("no alive Ray node to place a data-parallel replica on")
    return [nodes[i % len(nodes)] for i in range(num_replicas)], len(nodes) >= num_replicas


def restart_node(nodes: Sequence[N], load: Mapping[N, int],
                 avoid: Collection[N]) -> tuple[N | None, bool]:
    """The node for a replica being restarted, and whether it avoids every node in `avoid`:
    the least loaded (`load`: replicas placed there; ties: the first) alive node not in
    `avoid`; when all are, the least loaded of them (False: the caller logs it); None when no
    node is alive."""
    fresh = [n for n in nodes if n not in avoid]
    pool = fresh or list(nodes)
    if not pool:
        return None, False
    return min(pool, key=lambda n: (load.get(n, 0), pool.index(n))), bool(fresh)


def replicas_per_host(num_replicas: int, num_nodes: int) -> int:
    """How many of `num_replicas` share one host when spread over `num_nodes` nodes."""
    return math.ceil(num_replicas / max(1, num_nodes))


def replica_config(config: EngineConfig, per_host: int = 1,
                   others: Sequence[float] = ()) -> EngineConfig:
    """`config` for one of `per_host` replicas placed together on a host where `others` (the
    memory fractions other replicas planned there) already run: what the others left, split
    `per_host` ways, and never less than an equal share of the host. Unchanged when the user
    fixed the KV pool (kv_cache_memory_bytes), on GPUs (each replica has devices of its own),
    or when there is nothing to split."""
    if (per_host <= 1 and not others) or config.kv_cache_memory_bytes is not None or \
            str(config.device).startswith("cuda"):
        return config
    total = config.memory_fraction
    fraction = max((total - sum(others)) / per_host, total / (len(others) + per_host))
    return config.with_overrides(memory_utilization=fraction, gpu_memory_utilization=None)
