"""How a data-parallel server heals, without Ray: the rules in dp_supervision.py (routing,
health, restart backoff, the memory split) and DPRouter with its ReplicaLauncher over a
stand-in Ray (nodes, placement groups, replica actors): a dead replica is skipped, a request it
never started moves to a live one, a restart brings it back; a frozen replica (no probe answer),
a lasting "unavailable" or a step past the deadline takes it out, a blip does not, and the
restart avoids the node where it was lost."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from cover_vllm.config import EngineConfig
from cover_vllm.entrypoints.server.dp_liveness import LivenessPolicy
from cover_vllm.executor.placement import NodeInfo
from cover_vllm.entrypoints.server.dp_supervision import (RestartPolicy, fatal_problem,
                                                          health_problem, pick_replica,
                                                          replica_config, replicas_per_host)


@dataclass
class _State:
    index: int
    alive: bool = True
    restarting: bool = False
    in_flight: int = 0


def test_routing_skips_dead_and_restarting_replicas_and_picks_the_least_loaded():
    replicas = [_State(0, in_flight=1), _State(1, alive=False), _State(2, in_flight=1),
                _State(3, alive=False, restarting=True)]
    assert pick_replica(replicas).index == 0                   # tie: the lowest index
    replicas[0].in_flight = 5
    assert pick_replica(replicas).index == 2
    assert pick_replica([_State(0, alive=False), _State(1, alive=False, restarting=True)]) is None
    assert pick_replica([]) is None


def test_health_is_ok_while_one_replica_serves_and_fatal_only_when_none_can_come_back():
    one_up = [_State(0, alive=False, restarting=True), _State(1)]
    assert health_problem(one_up) is None and fatal_problem(one_up) is None
    restarting = [_State(0, alive=False, restarting=True), _State(1, alive=False)]
    assert "replica 0 restarting" in health_problem(restarting)
    assert fatal_problem(restarting) is None                   # it may still come back
    gone = [_State(0, alive=False), _State(1, alive=False)]
    assert "no data-parallel engine replica is alive" == health_problem(gone)
    assert "none is being restarted" in fatal_problem(gone)


def test_restart_backoff_doubles_up_to_the_cap_and_stops_after_max_restarts():
    policy = RestartPolicy(max_restarts=6, base_delay_s=1.0, max_delay_s=10.0)
    assert [policy.delay_s(k) for k in range(7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, None]
    assert RestartPolicy(max_restarts=0).delay_s(0) is None
    assert RestartPolicy().delay_s(10 ** 6) is None
    assert RestartPolicy(max_restarts=10 ** 6).delay_s(10 ** 5) == RestartPolicy().max_delay_s
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="base_delay_s <= max_delay_s"):
        RestartPolicy(base_delay_s=5.0, max_delay_s=1.0)


def test_replicas_on_one_host_split_its_memory_budget():
    assert replicas_per_host(2, 1) == 2 and replicas_per_host(4, 3) == 2
    assert replicas_per_host(3, 0) == 3
    config = EngineConfig(model="cover-tiny")
    assert replica_config(config, 1) is config
    assert replica_config(config, 2).memory_fraction == pytest.approx(0.45)
    vllm_named = EngineConfig(model="cover-tiny", gpu_memory_utilization=0.8)
    half = replica_config(vllm_named, 2)
    assert half.memory_fraction == pytest.approx(0.4) and half.gpu_memory_utilization is None
    fixed = EngineConfig(model="cover-tiny", kv_cache_memory_bytes=1 << 20)
    assert replica_config(fixed, 4) is fixed                   # the user's own per-replica pool


# ---- DPRouter over stand-in actors ------------------------------------------------------------
ray = pytest.importorskip("ray")        # its exception types only: no Ray instance is started


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def options(self, **options):                  # e.g. ping's concurrency group
        return self

    def remote(self, *args):
        actor, name = self.actor, self.name

        async def call():
            await asyncio.sleep(0.001)             # a real actor call yields to the event loop
            if actor.frozen:                       # its node is stopped: no answer, ever
                await asyncio.Event().wait()
            if actor.dead:
                raise ray.exceptions.RayActorError()
            if actor.unavailable:
                actor.refused += 1
                raise ray.exceptions.ActorUnavailableError("connection lost", None)
            return getattr(actor, f"_{name}")(*args)
        return call()


class _Actor:
    """A replica actor stand-in on `node`: remembers its requests; `dead` makes every call fail
    as a killed Ray actor's would, `frozen` leaves every call unanswered (a stopped node),
    `unavailable` fails them as Ray's "temporarily unavailable"."""

    def __init__(self, index: int, node: str):
        self.index, self.node, self.requests = index, node, []
        self.dead = self.frozen = self.unavailable = False
        self.refused = 0                      # calls failed as "unavailable"
        self.step_age_s = 0.0

    def __getattr__(self, name):
        return _Method(self, name)

    def _add_request(self, request_id, prompt, params, context_len):
        if max(prompt) >= 64:
            raise ValueError(f"token id {max(prompt)} outside the vocabulary")
        self.requests.append(request_id)

    def _poll(self, timeout_s, after):
        return [], {"running": len(self.requests)}

    def _ping(self):
        return {"step_age_s": self.step_age_s}

    def _ready(self):
        return {"index": self.index, "pid": 1000 + self.index, "num_pages": 8,
                "node_id": self.node, "node_ip": f"10.0.0.{self.node[-1]}", "ranks": []}

    def _shutdown(self):
        self.dead = True

    def _abort(self, request_id):
        pass


class _FakeRay:
    """What ReplicaLauncher calls on Ray, over stand-in nodes, groups and actors: the real
    launcher, placement rules and router run on top."""

    exceptions = ray.exceptions

    def __init__(self, nodes: list[str]):
        self.alive = {n: True for n in nodes}
        self.made: list[_Actor] = []
        self.removed: list = []
        fake = self

        def placement_group(bundles, strategy=None, bundle_label_selector=None):
            return SimpleNamespace(node=bundle_label_selector[0]["ray.io/node-id"],
                                   bundles=bundles, strategy=strategy, wait=lambda t: True)
        self.util = SimpleNamespace(placement_group=placement_group,
                                    remove_placement_group=self.removed.append)

        class ActorClass:
            def options(self, **options):
                self.group = options["scheduling_strategy"].placement_group
                return self

            def remote(self, config, index):
                fake.made.append(_Actor(index, self.group.node))
                return fake.made[-1]
        self.actor_cls = ActorClass()

    def remote(self, **options):
        return lambda cls: self.actor_cls

    def nodes(self):
        return [{"NodeID": n, "NodeManagerAddress": f"10.0.0.{n[-1]}", "Alive": up}
                for n, up in self.alive.items()]

    def is_initialized(self):
        return True

    def kill(self, actor, no_restart=True):
        actor.dead = True


FAST_PROBES = LivenessPolicy(probe_interval_s=0.01, probe_deadline_s=0.2, step_deadline_s=5.0,
                             unavailable_grace_s=0.3, retry_s=0.01)


def _router(num_replicas: int, policy: RestartPolicy, nodes=("node0", "node1"),
            probes: LivenessPolicy = LivenessPolicy()):
    """A DPRouter as __init__ builds it, on a _FakeRay cluster of `nodes`."""
    from cover_vllm.entrypoints.server.dp_launch import ReplicaLauncher
    from cover_vllm.entrypoints.server.dp_router import DPRouter
    from cover_vllm.entrypoints.server.dp_state import ReplicaSlot
    from cover_vllm.entrypoints.server.dp_liveness import Liveness

    fake = _FakeRay(list(nodes))
    router = DPRouter.__new__(DPRouter)          # what __init__ sets, minus Ray
    router.error_cls, router.metrics, router.poll_s, router.restart = RuntimeError, None, 0.01, \
        policy
    router.probes, router._lost_nodes = probes, {}
    router.config, router._owns_ray, router._stopped = None, False, False
    router._streams, router._tasks = {}, set()
    router.fake = fake
    router.launcher = ReplicaLauncher(fake, EngineConfig(model="cover-tiny"))
    placed = router.launcher.start_nodes(num_replicas)
    assert placed == [NodeInfo(n, f"10.0.0.{n[-1]}") for n in nodes][:num_replicas]
    router._replicas = [ReplicaSlot(i, router.launcher.launch(i, node),
                                    Liveness(probes, time.monotonic()))
                        for i, node in enumerate(placed)]
    router.infos = [r.actor._ready() for r in router._replicas]
    return router


def _submission(rid: str, prompt=(1, 2, 3)):
    from cover_vllm.engine.driver import Submission
    from cover_vllm.sampling_params import SamplingParams

    return Submission(rid, list(prompt), SamplingParams(max_tokens=4))


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.001)


def test_a_dead_replica_is_skipped_its_unstarted_requests_move_and_it_comes_back():
    router = _router(2, RestartPolicy(max_restarts=2, base_delay_s=0.0, max_delay_s=0.0))

    async def run():
        first = [await router.submit(_submission(f"r{i}")) for i in range(2)]
        assert [s.replica for s in first] == [0, 1]
        old = router._replicas[1].actor
        old.dead = True                               # killed: its next call fails
        third = await router.submit(_submission("r2"))  # least loaded is 1: refused, moves on
        assert third.replica == 0 and not router._replicas[1].alive
        survivor = router._replicas[0].actor           # r1 had produced nothing: it moves
        await _until(lambda: "r1" in survivor.requests)
        assert survivor.requests == ["r0", "r2", "r1"] and first[1].replica == 0
        assert router.health() is None and router.fatal() is None   # replica 0 serves
        await _until(lambda: router._replicas[1].alive)             # restarted, rejoined
        counts = router.replica_counts()[1]
        assert counts["restarts"] == 1 and not counts["restarting"]
        assert router._replicas[1].actor is not old and router.infos[1]["pid"] == 1001
        assert (await router.submit(_submission("r3"))).replica == 1
        for t in [r.task for r in router._replicas if r.task] + list(router._tasks):
            t.cancel()
    asyncio.run(run())


def test_a_started_request_fails_and_spent_restarts_leave_the_router_fatal():
    router = _router(1, RestartPolicy(max_restarts=0))

    async def run():
        stream = await router.submit(_submission("r0"))
        stream.started = True                          # an output already reached the client
        router._replica_died(router._replicas[0], RuntimeError("boom"), router._replicas[0].actor)
        with pytest.raises(RuntimeError, match="replica 0 died: boom"):
            await stream.get()
        with pytest.raises(RuntimeError, match="no data-parallel engine replica is alive"):
            await router.submit(_submission("r1"))
    asyncio.run(run())
    assert "none is being restarted" in router.fatal()


# ---- liveness and placement: DPRouter over the stand-in cluster ---------------------------------
def _stop_tasks(router) -> None:
    for t in [t for r in router._replicas for t in (r.task, r.probe_task, r.restart_task) if t]:
        t.cancel()


def test_a_frozen_replica_leaves_the_routing_its_requests_move_and_it_restarts_elsewhere(caplog):
    """Replica 1's node stops answering: its probe misses the deadline, its request moves to
    replica 0, the server is degraded (not unhealthy), and the replica is rebuilt on node0 (not
    on node1, which Ray still lists alive) with half of node0's memory, without waiting for the
    frozen actor to shut down."""
    router = _router(2, RestartPolicy(base_delay_s=0.0, max_delay_s=0.0), probes=FAST_PROBES)
    frozen = router._replicas[1].actor

    async def run():
        first = [await router.submit(_submission(f"r{i}")) for i in range(2)]
        assert [s.replica for s in first] == [0, 1] and frozen.node == "node1"
        frozen.frozen = True
        await _until(lambda: not router._replicas[1].alive or router._replicas[1].restarts)
        survivor = router._replicas[0].actor
        await _until(lambda: "r1" in survivor.requests)      # undelivered: moved, not failed
        assert first[1].replica == 0 and router.health() is None
        await _until(lambda: router._replicas[1].alive)
        replica = router._replicas[1]
        assert replica.actor is not frozen and replica.actor.node == "node0"
        assert replica.placed.fraction == pytest.approx(0.45)
        assert "node node0 (10.0.0.0) is over-committed: its replicas planned " \
            "memory_utilization 1.35 in all (the budget is 0.9)" in caplog.text
        assert frozen.dead and len(router.fake.removed) == 1   # old actor killed, group removed
        assert set(router._lost_nodes) == {NodeInfo("node1", "10.0.0.1")}
        counts = router.replica_counts()
        assert [c["node_id"] for c in counts] == ["node0", "node0"]
        assert all(c["last_seen_s"] >= 0 for c in counts)
        _stop_tasks(router)
    asyncio.run(run())


def test_transient_unavailability_is_retried_and_a_lasting_one_takes_the_replica_out():
    patient = LivenessPolicy(probe_interval_s=0.01, probe_deadline_s=5.0,
                             unavailable_grace_s=600.0, retry_s=0.01)
    router = _router(2, RestartPolicy(max_restarts=0), probes=patient)
    blip = router._replicas[1].actor

    async def run():
        router.start()
        blip.unavailable = True                 # every poll and probe fails "unavailable"
        await _until(lambda: blip.refused >= 20)
        assert router._replicas[1].alive        # twenty retries later: still in the routing
        placed = [await router.submit(_submission(f"a{i}")) for i in range(2)]
        assert [s.replica for s in placed] == [0, 0]     # replica 1 refused a1: it went to 0
        assert router._replicas[1].alive and blip.requests == []
        blip.unavailable = False
        later = await router.submit(_submission("r1"))
        assert later.replica == 1 and blip.requests == ["r1"]
        _stop_tasks(router)
    asyncio.run(run())
    strict = _router(2, RestartPolicy(max_restarts=0), probes=FAST_PROBES)

    async def lasting():
        strict.start()
        strict._replicas[1].actor.unavailable = True
        await _until(lambda: not strict._replicas[1].alive)
        assert strict._replicas[0].alive and strict.health() is None
        _stop_tasks(strict)
    asyncio.run(lasting())


def test_a_replica_whose_step_runs_past_the_step_deadline_is_taken_out():
    router = _router(2, RestartPolicy(max_restarts=0), probes=FAST_PROBES)

    async def run():
        stream = await router.submit(_submission("r0"))
        stream.started = True                    # an output reached the client: it fails
        router._replicas[0].actor.step_age_s = FAST_PROBES.step_deadline_s + 1
        with pytest.raises(RuntimeError, match="replica 0 is lost: its engine step has run"):
            await stream.get()
        assert router._replicas[1].alive and router.health() is None
        _stop_tasks(router)
    asyncio.run(run())


def test_a_request_being_placed_on_a_replica_that_freezes_moves_instead_of_hanging():
    """add_request to a frozen replica never returns: the submit returns once the probe takes
    the replica out, with the request placed on the live one (exactly once)."""
    router = _router(2, RestartPolicy(max_restarts=0), probes=FAST_PROBES)
    router._replicas[1].actor.frozen = True

    async def run():
        router.start()
        first = await router.submit(_submission("r0"))        # tie: replica 0
        second = await router.submit(_submission("r1"))       # replica 1: frozen, then moved
        await _until(lambda: len(router._replicas[0].actor.requests) == 2)
        assert (first.replica, second.replica) == (0, 0)
        assert router._replicas[0].actor.requests == ["r0", "r1"]
        assert router.replica_counts()[0]["in_flight"] == 2
        assert not router._replicas[1].alive and router.health() is None
        _stop_tasks(router)
    asyncio.run(run())


def test_one_router_serves_one_event_loop_after_another_and_bad_input_still_raises():
    """What tests and notebooks do (asyncio.run per call): nothing the router keeps is bound to
    the first loop, and a replica's ValueError reaches the caller unchanged."""
    router = _router(2, RestartPolicy(max_restarts=0))

    async def submit(rid, prompt=(1, 2, 3)):
        stream = await router.submit(_submission(rid, prompt))
        _stop_tasks(router)
        return stream.replica
    assert asyncio.run(submit("r0")) == 0
    assert asyncio.run(submit("r1")) == 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(submit("bad", (10 ** 6,)))
    assert [c["in_flight"] for c in router.replica_counts()] == [1, 1]
