"""ReplicaLauncher: starts each data-parallel replica in a placement group of its own, on the node
dp_supervision's rules pick, with the memory plan of that node, and logs where it landed.

A replica's group (executor/placement.py) holds its EngineReplica actor in bundle 0 and, with
the "ray" backend, tensor-parallel rank r in bundle r (RayRanks finds the group from inside the
actor), all on one node (`STRICT_PACK`, pinned to the chosen node). At start the replicas go to
distinct alive nodes when there are enough (`spread_nodes`; a logged round robin otherwise); a
restart goes to an alive node where no replica was just lost (`restart_node`). Retiring a
replica kills its actor and removes its group, which ends its rank actors too.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any, Collection, Sequence

from cover_vllm.config import EngineConfig
from cover_vllm.entrypoints.server.dp_replica import PROBE_GROUP, EngineReplica
from cover_vllm.entrypoints.server.dp_supervision import (replica_config, restart_node,
                                                          spread_nodes)
from cover_vllm.executor.placement import (BUNDLE_CPUS, NodeInfo, alive_nodes, current_node,
                                           group_bundles, in_bundle, make_group, remove_group,
                                           wait_group)
from cover_vllm.executor.tp_executor import describe_rank
from cover_vllm.logger import init_logger

logger = init_logger(__name__)
MAX_CONCURRENCY = 4        # a replica's request threads: a long poll never blocks add_request


@dataclass
class Launched:
    """One replica's actor, its placement group, the node the group is pinned to, and the memory
    fraction it planned."""

    actor: Any
    group: Any
    node: NodeInfo
    fraction: float


class ReplicaLauncher:
    def __init__(self, ray: Any, config: EngineConfig):
        self.ray, self.config = ray, config
        ranks_on_ray = (config.tensor_parallel_size > 1
                        and config.distributed_executor_backend == "ray")
        self.bundles = group_bundles(config.tensor_parallel_size, config.device, ranks_on_ray)
        self.actor_cls = ray.remote(concurrency_groups={PROBE_GROUP: 1})(EngineReplica)
        self.options = {"num_cpus": BUNDLE_CPUS, "num_gpus": self.bundles[0].get("GPU", 0),
                        "max_concurrency": MAX_CONCURRENCY, "max_restarts": 0}

    def start_nodes(self, num_replicas: int) -> list[NodeInfo]:
        """Each replica's node at start (distinct nodes when there are enough), replica 0 on
        the router's own node when it is one of the cluster's."""
        here = current_node()
        nodes = sorted(alive_nodes(self.ray), key=lambda n: n.node_id != getattr(here, "node_id",
                                                                                 None))
        chosen, spread = spread_nodes(num_replicas, nodes)
        if not spread:
            logger.warning("%d data-parallel replicas but %d alive Ray node(s): replicas share "
                           "nodes (round robin) and split their memory", num_replicas,
                           len(nodes))
        return chosen

    def node_for_restart(self, placed: Sequence[NodeInfo],
                         avoid: Collection[NodeInfo]) -> NodeInfo:
        """The node for a restart, given where the other replicas are (`placed`) and the nodes
        where a replica was just lost (`avoid`); RuntimeError when no node is alive."""
        node, fresh = restart_node(alive_nodes(self.ray), Counter(placed), avoid)
        if node is None:
            raise RuntimeError("no alive Ray node")
        if not fresh:
            logger.warning("every alive Ray node lost a replica recently: restarting on %s "
                           "anyway", node)
        return node

    def launch(self, index: int, node: NodeInfo, others: Sequence[float] = (),
               together: int = 1) -> Launched:
        """Reserve replica `index`'s group on `node` (blocks until reserved, RuntimeError if it
        cannot be) and start its actor there; `others` are the memory fractions the replicas
        already on `node` planned, `together` how many start there with this one."""
        config = replica_config(self.config, together, others)
        planned = sum(others) + together * config.memory_fraction
        if config is not self.config and planned > self.config.memory_fraction + 1e-9:
            logger.warning("%s is over-committed: its replicas planned memory_utilization %.3g "
                           "in all (the budget is %.3g)", node, planned,
                           self.config.memory_fraction)
        group = make_group(self.ray, self.bundles, node)
        wait_group(self.ray, group, f"data-parallel replica {index}'s placement group on {node}")
        actor = self.actor_cls.options(**self.options, **in_bundle(group, 0)).remote(config,
                                                                                     index)
        return Launched(actor, group, node, config.memory_fraction)

    async def relaunch(self, index: int, others: Sequence[Launched],
                       avoid: Collection[NodeInfo]) -> Launched:
        """Launch replica `index` anew (off the event loop): on the node for a restart given
        the other live replicas (`others`) and the nodes to avoid, planning its memory for the
        replicas already there."""
        node = await asyncio.to_thread(self.node_for_restart, [o.node for o in others], avoid)
        return await asyncio.to_thread(self.launch, index, node,
                                       [o.fraction for o in others if o.node == node])

    def retire(self, launched: Launched | None) -> None:
        """Kill the replica's actor and remove its group (and so its rank actors)."""
        if launched is None:
            return
        kill(self.ray, launched.actor)
        remove_group(self.ray, launched.group)

    @staticmethod
    def describe(index: int, launched: Launched, info: dict[str, Any]) -> None:
        """Log where replica `index` and each of its ranks run: one line each."""
        node = NodeInfo(info["node_id"], info["node_ip"]) if info.get("node_id") else None
        logger.info("data-parallel replica %d (pid %s) on %s, memory_utilization %.3g%s", index,
                    info.get("pid"), node or launched.node, launched.fraction,
                    "" if node in (None, launched.node) else f" (its group is on {launched.node})")
        for rank in info.get("ranks", []):
            logger.info("data-parallel replica %d: %s", index, describe_rank(rank))


def kill(ray: Any, actor: Any) -> None:
    """ray.kill, never starting Ray to do it; an actor already gone is fine."""
    if not ray.is_initialized():
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:                                        # already gone
        pass
