"""RayRanks: tensor-parallel ranks 1..N-1 as Ray actors ("ray" backend); `ensure_ray` starts a
small local Ray instance when none is running.

Control messages (the SchedulerOutput, replies) are actor calls; tensors move between ranks
through torch.distributed (cover_vllm.distributed.comm), never through Ray. Every `ray.get` has a
timeout. Placement (executor/placement.py): rank r runs in bundle r of its driver's placement
group, so the group shares the driver's node. A driver that is itself in a group with a bundle
per rank (a data-parallel replica) uses that one; otherwise (the server's or an LLM's own
engine) RayRanks reserves a `STRICT_PACK` group pinned to the driver's node, bundle 0 held for
the driver, and releases it at shutdown. Each bundle holds a token CPU share: the engine sets its
own torch thread count, and a 2-core machine can host a driver plus several ranks or replicas.
The driver's rendezvous address is its node's IP (or COVER_VLLM_HOST_IP).
"""

from __future__ import annotations

import os
import time
from typing import Any

from cover_vllm.config import EngineConfig
from cover_vllm.distributed.comm import own_address
from cover_vllm.executor.base import STEP_METHODS, RemoteRankError
from cover_vllm.executor.placement import (BUNDLE_CPUS, current_node, group_bundles, in_bundle,
                                           make_group, remove_group, wait_group)
from cover_vllm.executor.remote import ShardWorker

OBJECT_STORE_BYTES = 128 << 20      # control messages only: a small object store is plenty


def ray_module():
    """`import ray`, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("distributed_executor_backend='ray' (and data-parallel serving) need "
                          "Ray: pip install 'cover-vllm[ray]'") from exc
    return ray


def ensure_ray(num_cpus: int | None = None) -> bool:
    """Connect to Ray (RAY_ADDRESS) or start a small local instance; True if this call started
    it (the caller then owns it and shuts it down)."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(configure_logging=False)
        return False
    ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
             object_store_memory=OBJECT_STORE_BYTES, configure_logging=False,
             log_to_driver=True)
    return True


def actor_options(config: EngineConfig) -> dict[str, Any]:
    gpu = 1 if str(config.device).startswith("cuda") else 0
    return {"num_cpus": BUNDLE_CPUS, "num_gpus": gpu, "max_restarts": 0}


class RayRanks:
    # how the group's own placement group packs; a test sets "STRICT_SPREAD" to force a TP group
    # across nodes (the rendezvous between hosts), which serving never wants
    strategy = "STRICT_PACK"

    def __init__(self) -> None:
        self._actors: list[Any] = []
        self._owns_ray = False
        self._group: Any = None            # the placement group this object reserved, if any
        self.host = "127.0.0.1"
        self.pids: list[int] = []

    def start(self, config: EngineConfig, world_size: int) -> None:
        ray = ray_module()
        self._owns_ray = ensure_ray()
        self.host = own_address(ray.util.get_node_ip_address())
        group = ray.util.get_current_placement_group()
        if group is None or group.bundle_count < world_size:
            self._group = group = make_group(ray, group_bundles(world_size, config.device, True),
                                             current_node(), self.strategy)
            wait_group(ray, group, f"{world_size} tensor-parallel bundles on the driver's "
                       f"{current_node()}")
        cls = ray.remote(ShardWorker)
        options = actor_options(config)
        self._actors = [cls.options(**options, **in_bundle(group, rank)).remote(
            config, rank, world_size) for rank in range(1, world_size)]

    def _pid(self, rank: int) -> int | None:
        return self.pids[rank - 1] if rank - 1 < len(self.pids) else None

    def _get(self, rank: int, ref: Any) -> Any:
        ray = ray_module()
        try:
            return ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as exc:
            cause = str(exc).strip().splitlines()
            detail = next((ln for ln in cause if "Error" in ln), cause[0] if cause else "")
            raise RemoteRankError(rank, f"its actor died ({detail.strip()[:300]})", True,
                                  self._pid(rank)) from None
        except ray.exceptions.RayTaskError as exc:
            raise RemoteRankError(rank, str(exc), pid=self._pid(rank)) from None

    def call(self, method: str, *args: Any) -> tuple[str, list[Any]]:
        return method, [getattr(actor, method).remote(*args) for actor in self._actors]

    def wait(self, pending: tuple[str, list[Any]], timeout_s: float) -> list[Any]:
        ray = ray_module()
        method, refs = pending
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        results = []
        for rank, ref in enumerate(refs, 1):
            if ref not in ready:
                raise RemoteRankError(rank, f"no answer within {timeout_s:g} s (hung or "
                                      "overloaded)", pid=self._pid(rank))
            value = self._get(rank, ref)
            if method in STEP_METHODS and value is not None:     # its traceback
                raise RemoteRankError(rank, value, pid=self._pid(rank))
            results.append(value)
        return results

    def diagnose(self, pending: Any, grace_s: float) -> list[RemoteRankError]:
        if not isinstance(pending, tuple) or not pending[1]:
            return []
        ray = ray_module()
        method, refs = pending
        rank_of = {ref: rank for rank, ref in enumerate(refs, 1)}
        remaining, found = list(refs), []
        deadline = time.monotonic() + grace_s
        while remaining and not found and time.monotonic() < deadline:
            ready, remaining = ray.wait(remaining, num_returns=1,
                                        timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    value = self._get(rank_of[ref], ref)
                    if method in STEP_METHODS and value is not None:   # a traceback
                        found.append(RemoteRankError(rank_of[ref], value,
                                                     pid=self._pid(rank_of[ref])))
                except RemoteRankError as err:
                    found.append(err)
        return sorted(found, key=lambda e: e.rank)

    def shutdown(self) -> None:
        if not self._actors and not self._owns_ray and self._group is None:
            return
        ray = ray_module()
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:       # already dead
                pass
        self._actors = []
        remove_group(ray, self._group)
        self._group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
