"""How a data-parallel server heals, without Ray: the rules in dp_supervision.py (routing,
health, restart backoff, the memory split) and DPRouter over stand-in replica actors (a dead
replica is skipped, a request it never started moves to a live one, a restart brings it back)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from cover_vllm.config import EngineConfig
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
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            await asyncio.sleep(0.001)             # a real actor call yields to the event loop
            return self.fn(*args)
        return call()


class _Actor:
    """A replica actor stand-in: remembers its requests; `dead` makes every call fail as a
    killed Ray actor's would."""

    def __init__(self, index: int):
        self.index, self.dead, self.requests = index, False, []
        self.outbox: list = []

    def __getattr__(self, name):
        def call(*args):
            if self.dead:
                raise ray.exceptions.RayActorError()
            return getattr(self, f"_{name}")(*args)
        return _Method(call)

    def _add_request(self, request_id, prompt, params, context_len):
        self.requests.append(request_id)

    def _poll(self, timeout_s, after):
        return [], {"running": len(self.requests)}

    def _ready(self):
        return {"index": self.index, "pid": 1000 + self.index, "num_pages": 8}

    def _shutdown(self):
        self.dead = True

    def _abort(self, request_id):
        pass


class _ActorClass:
    def __init__(self):
        self.made: list[_Actor] = []

    def remote(self, config, index):
        self.made.append(_Actor(index))
        return self.made[-1]


def _router(num_replicas: int, policy: RestartPolicy):
    from cover_vllm.entrypoints.server.dp_router import DPRouter, _Replica

    router = DPRouter.__new__(DPRouter)          # what __init__ sets, minus Ray
    router.error_cls, router.metrics, router.poll_s, router.restart = RuntimeError, None, 0.01, \
        policy
    router.config, router._owns_ray, router._stopped = None, False, False
    router._streams, router._tasks = {}, set()
    router._actor_cls = _ActorClass()
    router._replicas = [_Replica(i, router._actor_cls.remote(None, i))
                        for i in range(num_replicas)]
    router.infos = [r.actor._ready() for r in router._replicas]
    return router


def _submission(rid: str):
    from cover_vllm.engine.driver import Submission
    from cover_vllm.sampling_params import SamplingParams

    return Submission(rid, [1, 2, 3], SamplingParams(max_tokens=4))


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
