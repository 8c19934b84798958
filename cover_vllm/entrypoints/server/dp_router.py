"""DPRouter: N engine replicas (Ray actors, dp_replica.py) behind one least-loaded router that
heals: a dead replica leaves the routing at once and is restarted in the background.

Data-parallel serving (`cover-vllm serve --data-parallel-size N`). The router is asyncio-side
and implements the EngineClient protocol (client.py), like the server's engine loop, so the
server can hold either. The rules it applies (routing, health, restart backoff, the memory
split between replicas on one host) are in dp_supervision.py.

A request goes to the live replica with the fewest requests in flight and stays there. One
asyncio task per replica long-polls it for outputs and routes them to the streams. A replica
dies when its actor is gone (noticed by the poll within `poll_s`, or by a submit) or reports its
engine dead (a tensor-parallel worker died). Then its requests that have seen no output yet move
to a live replica (nothing was streamed, and the server fixed their seeds, so nothing is lost or
repeated); the others fail: `stream.get()` raises `error_cls` (pass the server's
EngineRequestError). A request refused by a dying replica is placed on another the same way.
The dead replica is rebuilt in the background (RestartPolicy) and rejoins once loaded. The router
is `fatal` (the server exits) only when every replica is dead and none is being restarted.
Validation errors of Engine.add_request (ValueError / TypeError) are raised by `submit` unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from cover_vllm.config import EngineConfig
from cover_vllm.engine.driver import Submission
from cover_vllm.entrypoints.server.dp_replica import EngineReplica
from cover_vllm.entrypoints.server.dp_supervision import (RestartPolicy, fatal_problem,
                                                          health_problem, pick_replica,
                                                          replica_config, replicas_per_host)
from cover_vllm.executor.ray_ranks import ensure_ray, ray_module
from cover_vllm.outputs import RequestOutput

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0


class ReplicaStream:
    """One request's outputs (or its error), in arrival order."""

    def __init__(self, submission: Submission, replica: int):
        self.submission, self.replica = submission, replica
        self.started = False               # an output was routed to it (it cannot move now)
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def request_id(self) -> str:
        return self.submission.request_id

    def put(self, item: RequestOutput | Exception) -> None:
        self.started = True
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item


@dataclass
class _Replica:
    index: int
    actor: Any
    alive: bool = True
    restarting: bool = False           # dead; a restart is waiting out its backoff or loading
    in_flight: int = 0                 # requests routed here and not finished / aborted
    served: int = 0                    # requests that finished here
    handled: int = 0                   # number of the last output routed (acknowledged next poll)
    attempts: int = 0                  # restart attempts so far (RestartPolicy caps them)
    restarts: int = 0                  # restarts that brought it back
    gauges: dict[str, int] = field(default_factory=dict)
    task: asyncio.Task | None = None   # its poll loop
    restart_task: asyncio.Task | None = None


class DPRouter:
    def __init__(self, config: EngineConfig, data_parallel_size: int, *,
                 error_cls: type[Exception] = RuntimeError, metrics: Any = None,
                 poll_s: float = 0.5, restart: RestartPolicy = RestartPolicy()):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or \
                data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got "
                             f"{data_parallel_size!r}")
        ray = ray_module()
        self.error_cls, self.metrics, self.poll_s = error_cls, metrics, poll_s
        self.restart = restart
        self._owns_ray = ensure_ray()
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        self.config = replica_config(config, replicas_per_host(data_parallel_size, nodes))
        if self.config is not config:
            logger.info("%d data-parallel replicas per host: each plans memory_utilization=%.3g",
                        replicas_per_host(data_parallel_size, nodes),
                        self.config.memory_fraction)
        self._streams: dict[str, ReplicaStream] = {}
        self._tasks: set[asyncio.Task] = set()        # background moves (strong references)
        self._stopped = False
        self._actor_cls = ray.remote(EngineReplica).options(
            num_cpus=0, max_concurrency=4, max_restarts=0,
            scheduling_strategy="SPREAD" if nodes > 1 else "DEFAULT")
        self._replicas = [_Replica(i, self._actor_cls.remote(self.config, i))
                          for i in range(data_parallel_size)]
        try:
            self.infos = ray.get([r.actor.ready.remote() for r in self._replicas],
                                 timeout=READY_TIMEOUT_S)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"a data-parallel engine replica failed to start: "
                               f"{_brief(exc)}") from None

    # ---- the EngineClient protocol ---------------------------------------------------------
    def start(self) -> None:
        """Start the poll tasks if an event loop runs here (else on the first submit)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._ensure_polling()

    @property
    def is_alive(self) -> bool:
        return not self._stopped and any(r.alive for r in self._replicas)

    def health(self) -> str | None:
        """None while at least one replica serves (the others may be dead or restarting)."""
        if self._stopped:
            return "the server is shutting down"
        return health_problem(self._replicas)

    def fatal(self) -> str | None:
        """Why no replica can ever serve again (all dead, none restarting), else None."""
        return None if self._stopped else fatal_problem(self._replicas)

    async def submit(self, submission: Submission) -> ReplicaStream:
        self._ensure_polling()
        stream = ReplicaStream(submission, -1)
        await self._place(stream)
        return stream

    async def _place(self, stream: ReplicaStream) -> None:
        """Queue `stream`'s request on a live replica; one that refuses it because it is dead
        or dying is skipped for the next (the request never ran there)."""
        sub, tried = stream.submission, set()
        while True:
            replica = None if self._stopped else pick_replica(
                [r for r in self._replicas if r.index not in tried])
            if replica is None:
                raise self.error_cls(self.health() or "no data-parallel replica can take the "
                                     "request (every live one refused it)")
            tried.add(replica.index)
            stream.replica = replica.index
            replica.in_flight += 1
            self._streams[stream.request_id] = stream
            actor = replica.actor
            try:
                await actor.add_request.remote(sub.request_id, list(sub.prompt_token_ids),
                                               sub.params, sub.context_len)
                return
            except BaseException as exc:
                self._forget(stream)
                if not isinstance(exc, Exception):           # cancelled: nothing was queued
                    raise
                cause = _cause(exc)
                if isinstance(cause, (ValueError, TypeError)):
                    raise cause from None
                if isinstance(exc, ray_module().exceptions.RayActorError):
                    self._replica_died(replica, exc, actor)
                logger.warning("data-parallel replica %d refused %s (%s); trying another",
                               replica.index, sub.request_id, _brief(exc))

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self._forget(stream)
        replica = self._replicas[stream.replica]
        if replica.alive:
            replica.actor.abort.remote(request_id)          # fire and forget
        self._outcome("abort")

    def stop(self, timeout: float = 30.0) -> None:
        """Fail every open stream, stop the replicas and (if this router started it) Ray."""
        if self._stopped:
            return
        self._stopped = True
        ray = ray_module()
        for stream in list(self._streams.values()):
            stream.put(self.error_cls("the server is shutting down"))
        self._streams.clear()
        for task in [*self._tasks, *(t for r in self._replicas for t in (r.task, r.restart_task)
                                     if t is not None)]:
            task.cancel()
        stops = [r.actor.shutdown.remote() for r in self._replicas if r.alive]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=timeout)
        for r in self._replicas:
            _kill(r.actor)
            r.alive = r.restarting = False
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    # ---- counters --------------------------------------------------------------------------
    def replica_counts(self) -> list[dict[str, Any]]:
        """Per replica: index, alive, restarting, restarts, in_flight, served (finished
        requests), last gauges."""
        return [{**r.gauges, "index": r.index, "alive": r.alive, "restarting": r.restarting,
                 "restarts": r.restarts, "in_flight": r.in_flight, "served": r.served}
                for r in self._replicas]

    # ---- polling ---------------------------------------------------------------------------
    def _ensure_polling(self) -> None:
        for r in self._replicas:
            if r.alive and (r.task is None or r.task.done()):     # none yet, or its loop ended
                r.task = asyncio.get_running_loop().create_task(self._poll(r))

    async def _poll(self, replica: _Replica) -> None:
        ray, actor = ray_module(), replica.actor
        while replica.alive and replica.actor is actor and not self._stopped:
            try:
                items, gauges = await actor.poll.remote(self.poll_s, replica.handled)
            except asyncio.CancelledError:
                raise
            except ray.exceptions.RayActorError as exc:
                self._replica_died(replica, exc, actor)
                return
            replica.gauges = gauges
            for number, request_id, item in items:
                if number > replica.handled:       # a resend of what was routed is skipped
                    self._route(replica, request_id, item)
                    replica.handled = number
            if gauges.get("fatal"):                          # its engine died (a TP worker)
                self._replica_died(replica, RuntimeError(gauges["fatal"]), actor)
            self._publish()

    def _route(self, replica: _Replica, request_id: str, item: RequestOutput | str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.replica != replica.index:
            return                                           # aborted meanwhile
        if isinstance(item, str):
            self._forget(stream)
            stream.put(self.error_cls(item))
            self._outcome("error")
            return
        stream.put(item)
        if item.finished:
            self._forget(stream)
            replica.served += 1
            if self.metrics is not None:
                self.metrics.on_finished(item)

    def _replica_died(self, replica: _Replica, exc: Exception, actor: Any) -> None:
        """`actor` (replica's current actor, else a stale report) is dead: move or fail its
        requests and schedule its restart."""
        if not replica.alive or replica.actor is not actor:
            return
        replica.alive = False
        error = f"data-parallel replica {replica.index} died: {_brief(exc)}"
        logger.error("%s; %s", error, "restarting it" if not self._stopped else "stopping")
        for stream in [s for s in self._streams.values() if s.replica == replica.index]:
            self._forget(stream)
            if stream.started or self._stopped:
                stream.put(self.error_cls(error))
                self._outcome("error")
            else:
                self._background(self._move(stream))
        self._publish()
        delay = self.restart.delay_s(replica.attempts)
        if self._stopped:
            return
        if delay is None:
            logger.error("data-parallel replica %d stays dead: its %d restart attempts are "
                         "spent", replica.index, replica.attempts)
            _kill(actor)
            return
        replica.restarting = True
        replica.restart_task = asyncio.get_running_loop().create_task(
            self._restart(replica, delay))

    async def _move(self, stream: ReplicaStream) -> None:
        """Place a request whose replica died before it produced anything on a live one."""
        try:
            await self._place(stream)
        except Exception as exc:
            stream.put(exc if isinstance(exc, self.error_cls) else self.error_cls(str(exc)))
            self._outcome("error")

    async def _restart(self, replica: _Replica, delay: float) -> None:
        """Rebuild `replica` after `delay` s, retrying on the policy's backoff; it rejoins the
        routing once its engine has loaded."""
        try:
            await asyncio.wait_for(_awaited(replica.actor.shutdown.remote()), 10.0)
        except Exception:                                    # gone already, or stuck
            pass
        _kill(replica.actor)
        while delay is not None and not self._stopped:
            await asyncio.sleep(delay)
            replica.attempts += 1
            actor = self._actor_cls.remote(self.config, replica.index)
            try:
                info = await asyncio.wait_for(_awaited(actor.ready.remote()), READY_TIMEOUT_S)
            except Exception as exc:
                _kill(actor)
                delay = self.restart.delay_s(replica.attempts)
                logger.error("restart %d of data-parallel replica %d failed (%s)%s",
                             replica.attempts, replica.index, _brief(exc),
                             "" if delay is not None else "; it stays dead")
                continue
            except BaseException:                            # cancelled: the router stops
                _kill(actor)
                raise
            if replica.task is not None:
                replica.task.cancel()
            replica.actor, replica.handled, replica.gauges = actor, 0, {}
            replica.alive, replica.restarting = True, False
            replica.restarts += 1
            self.infos[replica.index] = info
            logger.warning("data-parallel replica %d is back (restart %d, pid %s)",
                           replica.index, replica.restarts, info.get("pid"))
            replica.task = asyncio.get_running_loop().create_task(self._poll(replica))
            return
        replica.restarting = False

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, stream: ReplicaStream) -> None:
        if self._streams.pop(stream.request_id, None) is not None:
            self._replicas[stream.replica].in_flight -= 1

    def _outcome(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.on_outcome(outcome)

    def _publish(self) -> None:
        if self.metrics is None:
            return
        live = [r.gauges for r in self._replicas if r.alive and r.gauges]
        self.metrics.publish(*(sum(g.get(k, 0) for g in live)
                               for k in ("running", "waiting", "pages_used", "pages_total")))


def _cause(exc: BaseException) -> Any:
    """The user-level exception inside a Ray error (RayTaskError.cause), else `exc` itself."""
    return getattr(exc, "cause", None) or exc


def _brief(exc: BaseException, limit: int = 400) -> str:
    """A Ray error's first meaningful lines, not its whole remote traceback."""
    lines = [ln.strip() for ln in str(_cause(exc)).splitlines() if ln.strip()]
    text = " ".join(lines[:3]) or type(exc).__name__
    return text[:limit]


async def _awaited(ref: Any) -> Any:
    return await ref


def _kill(actor: Any) -> None:
    ray = ray_module()
    if not ray.is_initialized():                             # never start Ray to kill
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:                                        # already gone
        pass
