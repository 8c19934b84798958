"""Serving across machines, without a cluster: where replicas and ranks go (dp_supervision's node
rules, executor/placement.py's bundles and pinning), the memory plan per node, the liveness
rules on a fake clock (dp_liveness.py), each rank's own address for the process group
(distributed/comm.py), and `--ray-address` meaning Ray for tensor parallelism too (launch.py).
The real two-host runs are tests/test_cluster_netns.py (slow)."""

from __future__ import annotations

import threading

import pytest
import torch

from cover_vllm.config import EngineConfig
from cover_vllm.distributed.comm import GroupComm, gloo_device, local_address, own_address
from cover_vllm.entrypoints.server.dp_liveness import Liveness, LivenessPolicy
from cover_vllm.entrypoints.server.dp_supervision import (RestartPolicy, replica_config,
                                                          restart_node, spread_nodes)
from cover_vllm.executor.placement import (BUNDLE_CPUS, NODE_LABEL, NodeInfo, group_bundles,
                                           make_group)


# ---- nodes -------------------------------------------------------------------------------------
def test_replicas_get_distinct_nodes_when_there_are_enough_else_a_flagged_round_robin():
    assert spread_nodes(2, ["a", "b", "c"]) == (["a", "b"], True)
    assert spread_nodes(3, ["a", "b", "c"]) == (["a", "b", "c"], True)
    assert spread_nodes(3, ["a", "b"]) == (["a", "b", "a"], False)
    assert spread_nodes(2, ["a"]) == (["a", "a"], False)
    with pytest.raises(ValueError, match="no alive Ray node"):
        spread_nodes(1, [])


def test_a_restart_avoids_nodes_where_a_replica_was_just_lost_unless_no_other_is_alive():
    load = {"a": 1, "b": 0}
    assert restart_node(["a", "b", "c"], load, avoid={"b"}) == ("c", True)   # least loaded
    assert restart_node(["a", "b"], load, avoid={"b"}) == ("a", True)        # b saw a loss
    assert restart_node(["a", "b"], load, avoid={"a", "b"}) == ("b", False)  # fallback, flagged
    assert restart_node(["a", "b"], {}, avoid=()) == ("a", True)             # ties: the first
    assert restart_node([], load, avoid=()) == (None, False)


def test_a_lost_node_is_quarantined_for_quarantine_s():
    policy = RestartPolicy(quarantine_s=60.0)
    lost = {"a": 100.0, "b": 30.0}
    assert policy.quarantined(lost, now=120.0) == {"a"}        # b's loss is 90 s old
    assert policy.quarantined(lost, now=161.0) == set()
    assert RestartPolicy(quarantine_s=0.0).quarantined(lost, now=100.0) == set()
    with pytest.raises(ValueError, match="quarantine_s"):
        RestartPolicy(quarantine_s=-1.0)


def test_memory_is_planned_for_what_else_runs_on_the_node():
    config = EngineConfig(model="cover-tiny")                  # memory_fraction 0.9
    assert replica_config(config) is config                    # alone on its node
    assert replica_config(config, 3).memory_fraction == pytest.approx(0.3)   # placed together
    # joining a node where another replica planned 0.45: what it left
    assert replica_config(config, 1, [0.45]).memory_fraction == pytest.approx(0.45)
    # joining one that planned the whole 0.9: an equal share (the node is over-committed)
    assert replica_config(config, 1, [0.9]).memory_fraction == pytest.approx(0.45)
    assert replica_config(config, 1, [0.3]).memory_fraction == pytest.approx(0.6)
    gpu = EngineConfig(model="cover-tiny", device="cuda")       # own devices: nothing to split
    assert replica_config(gpu, 2, [0.9]) is gpu


# ---- placement groups --------------------------------------------------------------------------
def test_one_bundle_per_rank_with_a_gpu_each_or_one_for_a_driver_and_its_local_ranks():
    cpu = {"CPU": BUNDLE_CPUS}
    assert group_bundles(2, "cpu", ranks_on_ray=True) == [cpu, cpu]
    assert group_bundles(2, "cuda", ranks_on_ray=True) == [{**cpu, "GPU": 1.0}] * 2
    assert group_bundles(4, "cuda", ranks_on_ray=False) == [{**cpu, "GPU": 4.0}]
    assert group_bundles(1, "cpu", ranks_on_ray=False) == [cpu]


class _Util:
    def __init__(self, labels: bool):
        self.made = []
        if labels:
            def placement_group(bundles, strategy=None, bundle_label_selector=None):
                self.made.append((bundles, strategy, bundle_label_selector))
        else:
            def placement_group(bundles, strategy=None):
                self.made.append((bundles, strategy, None))
        self.placement_group = placement_group


class _Ray:
    def __init__(self, labels: bool):
        self.util = _Util(labels)


def test_a_group_is_pinned_to_its_node_by_label_or_by_the_node_resource_on_older_ray():
    node = NodeInfo("ab" * 28, "10.231.0.2")
    bundles = group_bundles(2, "cpu", True)
    ray = _Ray(labels=True)
    make_group(ray, bundles, node)
    assert ray.util.made == [(bundles, "STRICT_PACK", [{NODE_LABEL: node.node_id}, {}])]
    old = _Ray(labels=False)
    make_group(old, bundles, node, "STRICT_SPREAD")
    assert old.util.made == [([{**bundles[0], "node:10.231.0.2": 0.001}, bundles[1]],
                              "STRICT_SPREAD", None)]
    unpinned = _Ray(labels=True)
    make_group(unpinned, bundles, None)
    assert unpinned.util.made == [(bundles, "STRICT_PACK", None)]
    assert str(node) == f"node {'ab' * 6} (10.231.0.2)"


# ---- liveness ----------------------------------------------------------------------------------
def test_liveness_rules_on_a_fake_clock():
    policy = LivenessPolicy(probe_interval_s=2.0, probe_deadline_s=5.0, step_deadline_s=30.0,
                            unavailable_grace_s=10.0)
    seen = Liveness(policy, now=100.0)
    assert seen.age(103.5) == pytest.approx(3.5)
    assert seen.answered(104.0, step_age_s=1.0) is None and seen.age(104.0) == 0.0
    assert "within 5 s (last seen 6.0 s ago)" in seen.missed(110.0)
    assert "step has run for 31.0 s" in seen.answered(111.0, step_age_s=31.0)
    # "temporarily unavailable": retried within the grace, lost once it has lasted the grace
    assert seen.unavailable(120.0) is None and seen.unavailable(129.9) is None
    assert "unavailable for 10.0 s" in seen.unavailable(130.0)
    seen.seen(131.0)                            # it answered: the grace starts over next time
    assert seen.unavailable(135.0) is None and seen.unavailable(144.0) is None
    seen.seen(90.0)                             # a late report never moves last_seen back
    assert seen.last_seen == 131.0
    with pytest.raises(ValueError, match="probe_deadline_s must be > 0"):
        LivenessPolicy(probe_deadline_s=0)


# ---- each rank's own address -------------------------------------------------------------------
def test_a_rank_uses_its_own_address_the_route_to_rank_0_or_the_override(monkeypatch):
    monkeypatch.delenv("COVER_VLLM_HOST_IP", raising=False)
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address("127.0.0.2") == "127.0.0.1"   # the route to 127.0.0.2 leaves from .1
    assert own_address("10.0.0.5") == "10.0.0.5"
    monkeypatch.setenv("COVER_VLLM_HOST_IP", "127.0.0.3")
    assert local_address("127.0.0.1") == "127.0.0.3" and own_address("10.0.0.5") == "127.0.0.3"


def test_the_group_forms_with_rank_0_and_rank_1_on_different_addresses(monkeypatch):
    """Rank 0 serves the store and its gloo device on 127.0.0.2; rank 1 reaches it there but
    creates its own device on its own address (127.0.0.1, the route's source), as a rank on
    another host must (a device on rank 0's address fails there: "Cannot resolve ... to a
    (local) address")."""
    monkeypatch.delenv("COVER_VLLM_HOST_IP", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    comms = [GroupComm(r, 2, "cpu", timeout_s=30.0) for r in range(2)]
    port = comms[0].serve_store("127.0.0.2")
    joined, errors = [None, None], []

    def join(rank: int) -> None:
        try:
            joined[rank] = comms[rank].connect("127.0.0.2", port)
            t = torch.full((3,), float(rank + 1))
            comms[rank].all_reduce(t)
            assert t.tolist() == [3.0, 3.0, 3.0]
        except Exception as exc:                 # reported below, on the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in comms:
        c.close()
    assert not errors, errors
    assert joined == ["127.0.0.2", "127.0.0.1"]


def test_gloo_socket_ifname_picks_the_device_by_interface(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert gloo_device("192.0.2.123") is not None      # the address is not used, nor checked


# ---- --ray-address means Ray for tensor parallelism ---------------------------------------------
def test_ray_address_puts_tensor_parallel_ranks_on_ray_or_says_what_to_pass():
    from cover_vllm.entrypoints.server.launch import ServeArgs, make_app

    tp2 = EngineConfig(model="cover-tiny", tensor_parallel_size=2)
    on_cluster = ServeArgs(engine=tp2, ray_address="10.231.0.1:6379")
    assert on_cluster.engine_config.distributed_executor_backend == "ray"
    assert on_cluster.needs_ray
    assert ServeArgs(engine=tp2).engine_config is tp2          # no cluster named: mp as before
    mp = tp2.with_overrides(distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="pass --distributed-executor-backend ray"):
        make_app(ServeArgs(engine=mp, ray_address="10.231.0.1:6379"))
    dp = ServeArgs(engine=mp, ray_address="10.231.0.1:6379", data_parallel_size=2)
    assert dp.needs_ray and dp.engine_config is mp           # replicas on the cluster, mp inside
