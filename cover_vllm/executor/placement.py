"""Where an engine's processes run on a Ray cluster: one placement group per engine, holding its
driver and every tensor-parallel rank on one node, and the node each process reports.

As vLLM does, each engine (a data-parallel replica, or the server's own engine when only its
ranks are Ray actors) reserves one placement group of `STRICT_PACK` bundles, one bundle per
process: the driver takes bundle 0 and rank r bundle r. So a TP group never straddles hosts and
its all-reduces never cross the network. Ranks that are local processes of the driver ("mp")
share one bundle with it, holding all the group's devices. A bundle asks for `BUNDLE_CPUS` of a
CPU (Ray refuses empty bundles; the engine sets its own thread count, so Ray's CPU count is not
what limits it) and, on GPUs, one GPU per process. The group is pinned to a chosen node by
Ray's node-id label (Ray >= 2.49; older Ray: the node's `node:<ip>` resource), so the caller,
not luck, decides the node.

Pure planning (`group_bundles`) is tested without Ray; the rest are thin Ray calls.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

BUNDLE_CPUS = 0.01                 # a token CPU share per process (see the module docstring)
NODE_LABEL = "ray.io/node-id"      # Ray's label of every node with its id
GROUP_TIMEOUT_S = 60.0             # how long a placement group may take to be reserved


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node: its id (hex) and the IP address Ray knows it by."""

    node_id: str
    ip: str

    def __str__(self) -> str:
        return f"node {self.node_id[:12]} ({self.ip})"


def alive_nodes(ray: Any) -> list[NodeInfo]:
    """The cluster's alive nodes, in Ray's order."""
    return [NodeInfo(n["NodeID"], n["NodeManagerAddress"]) for n in ray.nodes()
            if n.get("Alive")]


def current_node() -> NodeInfo | None:
    """The node this process runs on, when it is a Ray driver or worker; else None (an "mp"
    rank, or no Ray at all). Never imports Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return NodeInfo(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def process_bundle(device: str, gpus: int = 1) -> dict[str, float]:
    """What one engine process reserves: a token CPU share and, on CUDA, `gpus` GPUs."""
    bundle = {"CPU": BUNDLE_CPUS}
    if str(device).startswith("cuda"):
        bundle["GPU"] = float(gpus)
    return bundle


def group_bundles(world_size: int, device: str, ranks_on_ray: bool) -> list[dict[str, float]]:
    """The bundles of one engine's group: one per rank when ranks 1..N-1 are Ray actors (the
    driver holds bundle 0); else one for the driver and its local rank processes, with a GPU
    for each of them."""
    if ranks_on_ray:
        return [process_bundle(device) for _ in range(world_size)]
    return [process_bundle(device, world_size)]


def _pinned(bundles: list[dict[str, float]], node: NodeInfo,
            labels: bool) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """`bundles` and placement_group kwargs that hold bundle 0 to `node`."""
    if labels:
        return bundles, {"bundle_label_selector": [{NODE_LABEL: node.node_id}]
                         + [{} for _ in bundles[1:]]}
    first = {**bundles[0], f"node:{node.ip}": 0.001}       # Ray < 2.49: the node's resource
    return [first, *bundles[1:]], {}


def make_group(ray: Any, bundles: list[dict[str, float]], node: NodeInfo | None,
               strategy: str = "STRICT_PACK") -> Any:
    """A placement group of `bundles` (bundle 0 on `node` when given); not yet waited for."""
    kwargs: dict[str, Any] = {}
    if node is not None:
        labels = "bundle_label_selector" in inspect.signature(
            ray.util.placement_group).parameters
        bundles, kwargs = _pinned(bundles, node, labels)
    return ray.util.placement_group(bundles, strategy=strategy, **kwargs)


def wait_group(ray: Any, group: Any, what: str, timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """Block until `group` is reserved; else remove it and raise RuntimeError saying what could
    not be placed and why that usually is."""
    if group.wait(timeout_s):
        return
    remove_group(ray, group)
    raise RuntimeError(f"Ray could not reserve {what} within {timeout_s:g} s (bundles "
                       f"{group.bundle_specs}): the node is gone or lacks the resources")


def in_bundle(group: Any, index: int) -> dict[str, Any]:
    """Actor options that run it in bundle `index` of `group`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=index)}


def remove_group(ray: Any, group: Any) -> None:
    """Release `group` (its actors are killed with it); a no-op once Ray is down or it is gone."""
    if group is None or not ray.is_initialized():
        return
    try:
        ray.util.remove_placement_group(group)
    except Exception:                # already removed, or its node is gone
        pass
